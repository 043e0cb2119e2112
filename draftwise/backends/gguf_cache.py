"""The blocks of a GGUF file packed into qgemm.c's layout, kept in a file of their own so a later load maps them.

    cache = PackCache.of(gguf)           # the cache of this file, as it is now (size, mtime), or an empty one
    cache = PackCache.of(gguf, "q4")     # its draft's blocks (the wider ones re-quantized): a file of their own
    packed = cache.get(name, order)      # a Packed over the cache file's bytes (read once, on huge pages), or None
    cache.save(all_packed)               # after a load that packed: written once, whole (files.write_whole)

Packing a 1.5B model's blocks takes seconds of numpy (gguf_weights.pack_raw); reading them back takes a fraction of
a second from the page cache. They are read into an anonymous mapping on huge pages (huge_pages.py), not mapped from
the file: a decoding step streams them faster so. The bytes are pack_raw's own, so a load from the cache gives the
same bits as a load that packs.

The file lives under $DRAFTWISE_HOME/kernels/packed (never beside a user's file, never in a repository), named for
the GGUF's path and the kind of blocks; it holds the GGUF's path, size and mtime, the kind and LAYOUT, and is used
only while all match (a file replaced, or a release that packs otherwise, packs again and overwrites it). The path
also says whose it is: the store counts and removes a model's with it (models/packed.py). Anything unreadable in it
(truncated, another version, a tensor missing) is a miss, never an error: the load packs from the GGUF as if it were
absent.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from draftwise.backends.gguf_weights import Packed
from draftwise.backends.huge_pages import read_into_arena
from draftwise.files import write_whole
from draftwise.models.packed import FILE_BLOCKS, MAGIC, cache_path, read_index

LAYOUT = 1  # pack_raw's layout of the bytes (raise it when qgemm.c's layout changes)
ALIGN = 64  # every array starts on a cache line (and a page of its own is not needed: the kernel reads linearly)
FIELDS = ("q", "sc", "mn", "d", "dmin")
DTYPES = {"|u1", "|i1", "<f4"}  # what Packed's arrays are: a cache naming another type is not read


def _identity(gguf: Path, blocks: str) -> dict:
    stat = gguf.stat()
    return {"layout": LAYOUT, "gguf": os.path.abspath(gguf), "blocks": blocks, "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


class PackCache:
    """The packed tensors of one GGUF file, read from its cache file, or none yet."""

    def __init__(self, gguf: Path, path: Path, entries: dict, data: np.ndarray | None, blocks: str = FILE_BLOCKS):
        self.gguf, self.path, self.entries, self.data, self.blocks = gguf, path, entries, data, blocks

    @classmethod
    def of(cls, gguf: str | os.PathLike[str], blocks: str = FILE_BLOCKS) -> "PackCache":
        """blocks: which blocks (FILE_BLOCKS, the file's own; another name, a draft's re-quantized ones)."""
        gguf = Path(gguf)
        path = cache_path(gguf, blocks)
        entries, data = {}, None
        try:
            entries, data = _read(path, _identity(gguf, blocks))
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            entries, data = {}, None  # absent, stale or damaged: a miss
        return cls(gguf, path, entries, data, blocks)

    def get(self, name: str, order: str) -> Packed | None:
        """The packed tensor (order: how its channels were ordered, "file" or llama_order's heads), or None."""
        entry = self.entries.get(name)
        if entry is None or entry["order"] != order or self.data is None:
            return None
        arrays = {}
        for field in FIELDS:
            if field == "mn" and entry["shared"]:
                arrays["mn"] = arrays["sc"]
                continue
            offset, count, dtype = entry[field]
            arrays[field] = self.data[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)
        return Packed(*(arrays[f] for f in FIELDS), entry["n"], entry["k"], entry["group"], entry["supers"],
                      entry["bits"])

    def save(self, tensors: dict[str, tuple[Packed, str]]) -> bool:
        """Write {name: (packed, order)} as this file's cache, whole or not at all; False when it cannot be written
        (a read-only store, a full disk): the load goes on without one."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(self.path, lambda partial: _write(partial, _identity(self.gguf, self.blocks), tensors))
        except OSError:
            return False
        return True


def _write(path: Path, identity: dict, tensors: dict[str, tuple[Packed, str]]) -> None:
    entries, at = {}, 0
    for name, (packed, order) in tensors.items():
        entry = {"order": order, "n": packed.n, "k": packed.k, "group": packed.group, "supers": packed.supers,
                 "bits": packed.bits, "shared": packed.mn is packed.sc}
        for field in FIELDS:
            if field == "mn" and entry["shared"]:
                continue
            array = getattr(packed, field)
            entry[field] = (at, int(array.size), array.dtype.str)
            at += -(-array.nbytes // ALIGN) * ALIGN
        entries[name] = entry
    index = json.dumps({**identity, "data_bytes": at, "tensors": entries}).encode()
    head = MAGIC + struct.pack("<Q", len(index)) + index
    start = -(-len(head) // ALIGN) * ALIGN
    with open(path, "wb") as f:
        f.write(head + b"\0" * (start - len(head)))
        for packed, _ in tensors.values():
            for field in FIELDS:
                if field == "mn" and packed.mn is packed.sc:
                    continue
                data = memoryview(np.ascontiguousarray(getattr(packed, field))).cast("B")
                f.write(data)
                f.write(b"\0" * (-len(data) % ALIGN))


def _read(path: Path, identity: dict) -> tuple[dict, np.ndarray]:
    index, head = read_index(path)
    if any(index.get(key) != value for key, value in identity.items()):
        raise ValueError("stale")
    start = -(-head // ALIGN) * ALIGN
    data_bytes = int(index["data_bytes"])
    if path.stat().st_size < start + data_bytes:
        raise ValueError("truncated")
    # read, not mapped: a page-cache mapping is on 4 KiB pages, and a step streams these bytes faster from huge ones
    data = read_into_arena(path, start, data_bytes) if data_bytes else np.zeros(0, dtype=np.uint8)
    for entry in index["tensors"].values():  # each entry whole and inside the data, or the cache is not read
        if not isinstance(entry.get("order"), str) or not isinstance(entry.get("shared"), bool) or \
                not all(isinstance(entry.get(key), int) for key in ("n", "k", "group", "supers", "bits")):
            raise ValueError("entry of another kind")
        for field in FIELDS:
            if field != "mn" or not entry["shared"]:
                offset, count, dtype = entry[field]
                if dtype not in DTYPES or offset % ALIGN or count < 0:
                    raise ValueError("entry of another kind")
                if offset < 0 or offset + count * np.dtype(dtype).itemsize > data_bytes:
                    raise ValueError("entry past the end")
    return index["tensors"], data
