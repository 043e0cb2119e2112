"""The optional extras: which command needs which packages, and the one error that says how to install them.

`pip install draftwise` is the library and `draftwise generate`; the server, the benchmark and load driver, and
training each come with an extra (pyproject.toml's [project.optional-dependencies]). A command calls `need` before
its work starts, so a missing package is one line naming the `pip install` to run, not a traceback minutes in.
"""
from __future__ import annotations

import importlib

from draftwise.errors import DraftwiseError

# extra -> the modules it brings (import names, not pip names: prometheus-client installs prometheus_client)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "bench": ("matplotlib", "httpx"),
    "train": ("peft",),
    "ray": ("ray",),
}


def need(extra: str, *modules: str, what: str) -> None:
    """Import each of modules (all of the extra's when none are named), or raise a DraftwiseError naming the
    `pip install 'draftwise[extra]'` that brings them. what: who needs them, as the error's subject."""
    for name in modules or EXTRAS[extra]:
        if name not in EXTRAS[extra]:
            raise ValueError(f"the {extra!r} extra does not bring {name!r}")  # (a slip in draftwise itself)
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise DraftwiseError(f"{what} needs {name}, which is not installed here: "
                                 f"pip install 'draftwise[{extra}]'") from err
