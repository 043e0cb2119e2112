"""The packing cache's files, by the GGUF file they were packed from: where they live, and which are a file's.

The quant backend keeps a GGUF file's blocks packed for its kernel in $DRAFTWISE_HOME/kernels/packed
(backends/gguf_cache.py writes and reads them); the store counts them with the model whose file they were packed
from and removes them with it (`draftwise models list`, `draftwise models rm`). Each cache file's index names that
file ("gguf": its absolute path), so even an entry gone stale (the file replaced since) is found.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from draftwise.models.home import store_home

MAGIC = b"DWPACK1\n"
SUFFIX = ".dwpack"
FILE_BLOCKS = "file"  # the file's own blocks, packed (a target's, and a draft's 4-bit ones)
MOST_INDEX_BYTES = 1 << 28


def cache_dir() -> Path:
    return store_home() / "kernels" / "packed"


def cache_path(gguf: Path, blocks: str = FILE_BLOCKS) -> Path:
    """Where the cache of a GGUF file's blocks lives: one file a path and kind of blocks (a new version of the file
    overwrites it). blocks: FILE_BLOCKS, or another kind's name (a draft's re-quantized ones) in a file of its own."""
    where = hashlib.sha256(str(Path(os.path.abspath(gguf))).encode()).hexdigest()[:16]
    kind = "" if blocks == FILE_BLOCKS else f"-{blocks}"
    return cache_dir() / f"{Path(gguf).stem}-{where}{kind}{SUFFIX}"


def read_index(path: Path) -> tuple[dict, int]:
    """(a cache file's index, the size of its header): ValueError for a file that is not one."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a pack cache")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MOST_INDEX_BYTES:
            raise ValueError("index too large")
        index = json.loads(f.read(length))
    if not isinstance(index, dict):
        raise ValueError("index of another kind")
    return index, len(MAGIC) + 8 + length


def cache_files() -> list[tuple[Path, Path | None]]:
    """(each cache file, the GGUF file its index names (_real); None where it names none or is unreadable)."""
    files = []
    for path in sorted(cache_dir().glob(f"*{SUFFIX}")) if cache_dir().is_dir() else []:
        try:
            named = read_index(path)[0].get("gguf")
        except (OSError, ValueError, struct.error):
            named = None
        files.append((path, _real(Path(named)) if isinstance(named, str) else None))
    return files


def _real(file: Path) -> Path:
    """file in its real folder (a link to the folder followed; a linked file is still itself: a store's own name)."""
    file = Path(os.path.abspath(file))
    return file.parent.resolve() / file.name


def entries_of(where: Path, files: list[tuple[Path, Path | None]] | None = None) -> list[Path]:
    """The cache files packed from a GGUF file, or from any file in a folder (a store model's), current or stale: by
    the path their index names; one written before indexes named it, by the name cache_path gives it. files:
    cache_files(), when the caller asks of several."""
    one = Path(where).is_file() or Path(where).suffix == ".gguf"
    where = _real(where) if one else Path(os.path.abspath(where)).resolve()
    ggufs = [where] if one else sorted(where.glob("*.gguf"))
    legacy = {cache_path(file) for file in ggufs}
    return [path for path, named in (cache_files() if files is None else files)
            if (named is not None and (named == where or where in named.parents))
            or (named is None and path in legacy)]


def entries_bytes(where: Path, files: list[tuple[Path, Path | None]] | None = None) -> int:
    """What the cache files of a GGUF file, or of a folder's, take on disk."""
    return sum(path.stat().st_size for path in entries_of(where, files) if path.is_file())


def remove_entries(where: Path) -> int:
    """Remove the cache files of a GGUF file, or of a folder's; the bytes freed."""
    freed = 0
    for path in entries_of(where):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        freed += size
    return freed
