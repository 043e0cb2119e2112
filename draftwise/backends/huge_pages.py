"""Memory on 2 MiB pages for the weights a decoding step streams.

A step reads every weight once, a gigabyte in 4 KiB pages is a quarter of a million page walks, and a CPU's
prefetchers stop at every 4 KiB boundary: on a 2-core Zen 4 the kernel streamed the same blocks about 10% faster from
2 MiB pages than from 4 KiB ones. Linux gives an anonymous mapping huge pages where it is asked to (madvise), which is
the default setting of transparent huge pages on most distributions; a page-cache mapping of a file gets 4 KiB pages.
So the packed weights are read into an anonymous mapping, asked for huge pages, rather than mapped from their file.
Where the kernel gives none (THP off, another OS), the arena is ordinary memory and nothing else changes.
"""
from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # bytes: x86-64's (and most ARM kernels') transparent huge page
MIN_BYTES = HUGE_PAGE  # below one huge page an arena gains nothing


def arena(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of nbytes, starting on a huge-page boundary, its mapping asked for huge pages (an
    ordinary array when smaller than one huge page or where the OS has no such request)."""
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(nbytes, dtype=np.uint8)
    # private (a shared anonymous mapping is shmem, whose huge pages are another setting); a page of slack to align
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: ordinary pages, the same bytes
        pass
    whole = np.frombuffer(mapping, dtype=np.uint8)  # (keeps the mapping alive as its base)
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start:start + nbytes]


def read_into_arena(path, offset: int, nbytes: int) -> np.ndarray:
    """nbytes of the file at path from offset, in an arena (the file read once, not mapped)."""
    data = arena(nbytes)
    view, done = memoryview(data), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError("truncated")
            done += got
    return data


def on_huge_pages(array: np.ndarray) -> np.ndarray:
    """A copy of array in an arena of its own (array itself when smaller than a huge page)."""
    if array.nbytes < MIN_BYTES:
        return array
    data = arena(array.nbytes)
    copy = data.view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy
