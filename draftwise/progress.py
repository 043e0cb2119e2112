"""Progress bars: ours are tqdm on stderr; transformers draws its own, switched with ours."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """Show transformers' own bars only when the caller asked for progress; restore the setting after."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()
    try:
        yield
    finally:
        (logging.enable_progress_bar if was_enabled else logging.disable_progress_bar)()


def bar(items, desc: str, disable: bool = False):
    """A tqdm bar on stderr over items (a list: its length is the total)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=disable, dynamic_ncols=True, leave=False)
