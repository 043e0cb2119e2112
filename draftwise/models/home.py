"""Where the store lives (beneath both the store and its draft versions)."""
from __future__ import annotations

import os
from pathlib import Path


def store_home() -> Path:
    """$DRAFTWISE_HOME, or ~/.cache/draftwise; read on every call so that tests and users can redirect it."""
    env = os.environ.get("DRAFTWISE_HOME")
    return Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "draftwise"
