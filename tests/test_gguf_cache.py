"""Packing a GGUF file's blocks for the kernel (gguf_weights.pack_raw) and keeping them packed (gguf_cache.py).

pack_raw makes pack(decode(...))'s bytes straight from the file's; a load from the pack cache gives the same logits,
bit for bit, as a load that packs; a cache that does not match its file (replaced, damaged) is never read."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import raw_blocks, write_gguf

from draftwise.backends import gguf_cache, gguf_model, gguf_weights
from draftwise.backends.gguf_model import load_gguf_model
from draftwise.models import packed

IDS = torch.tensor([[1, 5, 9, 33, 200, 7, 7, 150, 3]])
FILES = [("qwen2", True, "Q4_K", "Q6_K"), ("llama", False, "Q4_1", "Q8_0"), ("qwen2", False, "Q6_K", "Q4_K"),
         ("qwen2", True, "Q5_0", "Q4_0")]


@pytest.mark.parametrize("type_name", list(gguf_weights.DECODERS))
@pytest.mark.parametrize("n,k", [(37, 512), (16, 256), (1, 256), (300, 1024)])
@pytest.mark.parametrize("chunk", [64, gguf_weights.CHUNK_BYTES])
def test_pack_raw_gives_packs_bytes(monkeypatch, type_name, n, k, chunk):
    rng = np.random.default_rng(n + k)
    raw = raw_blocks(type_name, n, k, rng)
    monkeypatch.setattr(gguf_weights, "CHUNK_BYTES", chunk)  # slices of one tile and of many
    for order in (None, rng.permutation(n)):
        blocks = gguf_weights.decode(type_name, raw, n, k)
        want = gguf_weights.pack(blocks if order is None else blocks.rows(order))
        got = gguf_weights.pack_raw(type_name, raw, n, k, order)
        for field in ("q", "sc", "mn", "d", "dmin"):
            mine, theirs = getattr(got, field), getattr(want, field)
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), field
        assert (got.mn is got.sc) == (want.mn is want.sc)  # a shared minimum stays one buffer
        assert (got.n, got.k, got.group, got.supers, got.bits) == (want.n, want.k, want.group, want.supers, want.bits)


@pytest.mark.parametrize("type_name,bits", [("Q6_K", 4), ("Q8_0", 4), ("Q5_0", 4), ("Q6_K", 2), ("Q4_K", 2)])
@pytest.mark.parametrize("chunk", [64, gguf_weights.CHUNK_BYTES])
def test_requantize_draft_gives_the_low_bit_form_of_the_whole_weight(monkeypatch, type_name, bits, chunk):
    n, k = 37, 1024
    rng = np.random.default_rng(k)
    raw = raw_blocks(type_name, n, k, rng)
    monkeypatch.setattr(gguf_weights, "CHUNK_BYTES", chunk)  # slices of one tile and of many
    for order in (None, rng.permutation(n)):
        blocks = gguf_weights.decode(type_name, raw, n, k)
        weight = (blocks if order is None else blocks.rows(order)).dequantize()  # [n, k] float32
        want = gguf_weights.pack(gguf_weights.quantize_draft(weight, bits))
        got = gguf_weights.requantize_draft(type_name, raw, n, k, order, bits)
        assert (got.bits, got.group, got.supers) == (bits, want.group, want.supers)
        for field in ("q", "sc", "mn", "d", "dmin"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
        # the values stay close to the wide blocks' (a draft's: only acceptance moves)
        error = np.abs(gguf_weights.unpack(got).dequantize() - weight).mean() / np.abs(weight).mean()
        assert error < {4: 0.15, 2: 0.6}[bits]
        assert got.nbytes < {4: 0.8, 2: 0.6}[bits] * gguf_weights.pack_raw(type_name, raw, n, k).nbytes


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits[0]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def no_packing(*args, **kwargs):
    raise AssertionError("packed again: the cache was not read")


@pytest.mark.parametrize("arch,tied,linear,embedding", FILES)
def test_a_load_from_the_cache_gives_the_bits_of_a_load_that_packs(home, tmp_path, monkeypatch, arch, tied, linear,
                                                                   embedding):
    path = write_gguf(tmp_path / "m.gguf", arch, linear=linear, embedding=embedding, tied=tied)
    plain = logits(load_gguf_model(path, progress=False, cache=False))
    assert not gguf_cache.cache_path(path).exists()  # cache=False neither reads nor writes one
    first = logits(load_gguf_model(path, progress=False))  # packs, then writes the cache
    cache = gguf_cache.cache_path(path)
    assert cache.is_file() and cache.parent == home / "kernels" / "packed"
    monkeypatch.setattr(gguf_model, "pack_raw", no_packing)
    cached = load_gguf_model(path, progress=False)
    assert torch.equal(first, plain) and torch.equal(logits(cached), plain)
    # control: another file's weights give other logits
    other = write_gguf(tmp_path / "other.gguf", arch, linear=linear, embedding=embedding, tied=tied, seed=1)
    monkeypatch.undo()
    assert not torch.equal(logits(load_gguf_model(other, progress=False)), plain)


def test_a_replaced_file_is_packed_again(home, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    load_gguf_model(path, progress=False)
    write_gguf(path, seed=1, layers=3)  # the same path, other weights (and size)
    fresh = logits(load_gguf_model(path, progress=False, cache=False))
    assert torch.equal(logits(load_gguf_model(path, progress=False)), fresh)
    monkeypatch.setattr(gguf_model, "pack_raw", no_packing)  # and the cache now holds the new file's blocks
    assert torch.equal(logits(load_gguf_model(path, progress=False)), fresh)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "index"])
def test_a_damaged_cache_is_a_miss_not_an_error(home, tmp_path, damage):
    path = write_gguf(tmp_path / "m.gguf")
    want = logits(load_gguf_model(path, progress=False))
    cache = gguf_cache.cache_path(path)
    data = cache.read_bytes()
    cache.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07" * len(data), "empty": b"",
                       "index": data.replace(b'"order"', b'"ordeR"', 1)}[damage])
    assert torch.equal(logits(load_gguf_model(path, progress=False)), want)
    assert cache.read_bytes() == data  # written again, whole


def test_an_unwritable_cache_leaves_the_load_as_it_is(home, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    want = logits(load_gguf_model(path, progress=False, cache=False))
    monkeypatch.setattr(packed, "cache_dir", lambda: Path("/proc/no-such-folder"))
    assert torch.equal(logits(load_gguf_model(path, progress=False)), want)
