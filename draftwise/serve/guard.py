"""A guard sees text before it is streamed and may block it: `--guard module:function`, `--block-regex`.

Text is held back by a window of characters: a request's text leaves the server only once `window` more
characters have followed it, and every check sees all the text so far. A blocked phrase no longer than the
window therefore completes (and is caught) while all of it is still held back, however many tokens it spans:
nothing of it is ever sent. A block ends the request with finish_reason "content_filter"; what was held back
is dropped. When the request ends otherwise, the whole text is checked once more before the rest is sent.

A guard function is called as function(request, text): request is the request's JSON body (a dict), text all
of its output so far; it returns "block" or False to block, anything else allows.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from draftwise.errors import DraftwiseError

DEFAULT_WINDOW = 64  # characters; a blocked phrase longer than this may be partly sent before it is caught
# How far back of a new piece --block-regex looks (at least the window): a match must end in new text, and
# searching all the text at every piece made a long reply's checks quadratic on the model's thread, seconds of it
# for a long reply (docs/experiments/constants/README.md). A match longer than this is caught by the whole text's
# check at the end.
REGEX_REACH = 2048


@dataclass
class Guard:
    check: Callable[[dict, str], object] | None = None
    pattern: re.Pattern | None = None
    window: int = DEFAULT_WINDOW

    def blocks(self, request: dict, text: str, new: int | None = None) -> bool:
        """Whether the text is blocked; new: how many of its last characters are new (None: check it all)."""
        start = 0 if new is None else max(0, len(text) - new - max(self.window, REGEX_REACH))
        if self.pattern is not None and self.pattern.search(text, start):  # (pos keeps lookbehinds and ^ as on all)
            return True
        if self.check is not None:
            verdict = self.check(request, text)
            return verdict is False or verdict == "block"
        return False

    def stream(self, request: dict) -> "GuardedText":
        return GuardedText(self, request)


@dataclass
class GuardedText:
    """One request's text on its way out: add() each piece, get back what may be sent now."""

    guard: Guard
    request: dict
    text: str = ""
    sent: int = 0  # characters of text already released
    blocked: bool = field(default=False)

    def add(self, piece: str, final: bool = False) -> str | None:
        """The text that may leave now (all of it when final), or None when the text is blocked."""
        self.text += piece
        if self.guard.blocks(self.request, self.text, None if final else len(piece)):
            self.blocked = True
            return None
        end = len(self.text) if final else max(self.sent, len(self.text) - self.guard.window)
        out, self.sent = self.text[self.sent:end], end
        return out


def load_guard(spec: str | None, block_regex: str | None, window: int = DEFAULT_WINDOW) -> Guard | None:
    """The server's guard from its options, or None; a bad option is a DraftwiseError that says what is wrong."""
    if spec is None and block_regex is None:
        return None
    if window < 0:
        raise DraftwiseError(f"--guard-window must be >= 0 characters, got {window}")
    pattern = None
    if block_regex is not None:
        try:
            pattern = re.compile(block_regex)
        except re.error as err:
            raise DraftwiseError(f"--block-regex is not a valid regular expression: {err}") from err
    return Guard(_import_check(spec) if spec else None, pattern, window)


def _import_check(spec: str) -> Callable[[dict, str], object]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DraftwiseError(f"--guard must be module:function (e.g. mypackage.safety:check), got {spec!r}")
    try:
        check = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise DraftwiseError(f"--guard {spec}: cannot import it: {err}") from err
    if not callable(check):
        raise DraftwiseError(f"--guard {spec} is not a function")
    return check
