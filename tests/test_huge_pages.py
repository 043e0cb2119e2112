"""The weights' memory on huge pages (backends/huge_pages.py): an arena starts on a 2 MiB boundary and is asked for
huge pages, a file read into one is byte for byte the file, and a quant model's packed blocks live in arenas whether
they were packed at load or read from the pack cache."""
from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from draftwise.backends import huge_pages
from draftwise.backends.huge_pages import HUGE_PAGE, arena, on_huge_pages, read_into_arena

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or
                           not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                           reason="madvise(MADV_HUGEPAGE) is Linux's, with transparent huge pages built in")


def advised_huge(array: np.ndarray) -> bool:
    """Whether the mapping holding array's first byte carries the huge-page advice (smaps' VmFlags "hg")."""
    address, flags = array.ctypes.data, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif line.startswith("VmFlags:") and inside:
                flags = line.split()[1:]
    return flags is not None and "hg" in flags


@linux
def test_an_arena_starts_on_a_huge_page_and_is_advised_so():
    data = arena(3 * HUGE_PAGE + 5)
    assert data.ctypes.data % HUGE_PAGE == 0 and data.nbytes == 3 * HUGE_PAGE + 5
    assert not data.any() and data.flags.writeable
    data[:] = 7
    assert advised_huge(data)
    # the control: an anonymous mapping of the same size without the advice is not (not an np.ones: malloc may hand
    # out memory that another library advised, and the check would then test that library)
    plain = mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert not advised_huge(np.frombuffer(plain, dtype=np.uint8))


def test_a_small_arena_is_an_ordinary_array():
    data = arena(HUGE_PAGE - 1)
    assert data.nbytes == HUGE_PAGE - 1 and not data.any()


def test_a_file_read_into_an_arena_is_its_bytes(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, 2 * HUGE_PAGE + 999, dtype=np.uint8)
    path = tmp_path / "blocks"
    path.write_bytes(raw.tobytes())
    assert np.array_equal(read_into_arena(path, 64, raw.nbytes - 64), raw[64:])
    with pytest.raises(ValueError, match="truncated"):
        read_into_arena(path, 64, raw.nbytes)


def test_a_copy_on_huge_pages_is_the_same_array():
    array = np.random.default_rng(1).standard_normal((700, 1024)).astype(np.float32)  # 2.7 MiB
    copy = on_huge_pages(array)
    assert copy is not array and copy.dtype == array.dtype and np.array_equal(copy, array)
    small = np.ones(10, dtype=np.int8)
    assert on_huge_pages(small) is small


@linux
def test_a_quant_models_blocks_are_on_huge_pages_packed_or_read_back(tmp_path, monkeypatch):
    from gguf_files import write_gguf

    from draftwise.backends.gguf_model import load_gguf_model
    from draftwise.backends.qgemm import QuantLinear

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)  # a tiny model's blocks are far under a huge page
    path = write_gguf(tmp_path / "tiny.gguf")
    for load in ("packs", "reads the cache"):
        model = load_gguf_model(path, progress=False)
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert linears and all(advised_huge(m.q.numpy()) for m in linears), load


@linux
def test_a_drafts_compact_readout_is_on_huge_pages_too(tmp_path, monkeypatch):
    from gguf_files import VOCAB, write_gguf

    from draftwise.backends.gguf_model import load_gguf_model
    from draftwise.backends.quant_model import compact_on_blocks

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1024)
    model = load_gguf_model(write_gguf(tmp_path / "tiny.gguf", tied=False), progress=False)
    twin, token_ids = compact_on_blocks(model, keep_vocab=VOCAB // 2)
    head = twin.get_output_embeddings()
    assert head.out_features == len(token_ids) < VOCAB  # (the rows kept, a copy of the file's head)
    assert advised_huge(head.q.numpy()) and advised_huge(model.get_output_embeddings().q.numpy())
