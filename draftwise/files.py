"""Reading the user's files, with errors that say why not; writing ours whole or not at all."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from draftwise.errors import DraftwiseError


def read_prompt_file(path: Path, what: str = "prompt file") -> str:
    """The file's text, or a DraftwiseError that says why it cannot be read (what: the file's role, for that)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DraftwiseError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise DraftwiseError(f"{what} is a directory: {path}") from None
    except UnicodeDecodeError as err:
        raise DraftwiseError(f"{what} is not UTF-8 text: {path} ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DraftwiseError(f"cannot read {what} {path}: {err.strerror or err}") from None


def read_stdin_prompt(stdin) -> str:
    """Standard input's text, decoded as UTF-8 whatever the locale, or a DraftwiseError that says where it is not."""
    raw = getattr(stdin, "buffer", None)
    if raw is None:  # already text (a test's StringIO)
        return stdin.read()
    data = raw.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DraftwiseError(f"standard input is not UTF-8 text ({err.reason} at byte {err.start})") from None


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """write(a partial file beside path), then rename it to path: an interrupted write leaves no half file there.
    The partial is named for its writer (process and thread), so two writing one path never write into one file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    try:
        write(partial)
    except BaseException:
        partial.unlink(missing_ok=True)  # nor a half file beside it
        raise
    partial.replace(path)


def prepare_out(path: str | Path, holds: str = "results.json, report.md and the plots") -> Path:
    """The --out folder, made now (before minutes of work), or a DraftwiseError that says why it cannot be."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise DraftwiseError(f"--out {path} is a file; give a folder for {holds}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DraftwiseError(f"--out {path}: cannot make the folder ({err.strerror or err})") from None
    return out
