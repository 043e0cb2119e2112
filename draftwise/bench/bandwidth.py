"""The machine's memory-bandwidth bound on a plain decoding step: the bytes a step reads over the rate this machine
reads memory at.

Decoding one token on a CPU reads every weight once (the token embedding's one row excepted), so no engine's plain
step can be shorter than bytes read / read rate. The bench prints each engine's plain step beside that bound, so that
a peer far from it (a bad build, a VM's slow memory) shows before any ratio between engines is read.

- bytes a step reads: a GGUF file's tensor bytes from its header (every tensor but the token embedding, of which one
  row; the whole embedding where no output.weight follows, since a tied output layer reads it all), or a loaded
  model's parameter bytes counted the same way; the KV cache's few megabytes at the bench's lengths are left out.
- read rate: a buffer several times the last-level cache summed on the threads the bench runs, by the quant kernel's
  streaming sum (on 2 MiB pages, as the kernel's weights are) and by torch, the best of a few repeats of each, taken
  before the models load and again after the runs: the rate the memory gives a streaming read, not a mean over a
  busy machine's moods. Two readers, since either alone can come out under what an engine then reads at (torch's
  sum read 12 to 20 GB/s on a Xeon where the kernel's read 23 and the quant route's steps streamed 17.5), and a
  bound under an engine's own rate is no bound.
"""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np

from draftwise.errors import DraftwiseError

MIB = 1 << 20
READ_REPEATS = 5
MIN_BUFFER = 256 * MIB
MAX_BUFFER = 4096 * MIB
CACHE_MULTIPLE = 4  # the buffer is this many times the last-level cache, so that no repeat reads from the cache
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"

# GGUF metadata value types -> struct formats (8: string, 9: array, handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        text = self.data[self.at:self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return text

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            inner, count = self.take("I"), self.take("Q")
            if inner in _SCALARS:
                self.at += count * struct.calcsize(_SCALARS[inner])
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            self.at += struct.calcsize(_SCALARS[kind])


def gguf_tensor_bytes(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], int]]:
    """{tensor name: (shape, bytes)} from a GGUF file's header alone (no tensor data is read)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size, chunk = path.stat().st_size, 1 << 24
    with open(path, "rb") as f:
        data = f.read(min(size, chunk))
        while True:  # the header (vocabularies included) is a few MB; read more while it runs past what is read
            try:
                return _tensors(_Reader(data), GGML_QUANT_SIZES, GGMLQuantizationType)
            except struct.error:
                if len(data) >= size:
                    raise ValueError(f"{path.name}: truncated GGUF header") from None
                data += f.read(chunk)


def _tensors(reader: _Reader, sizes, types) -> dict[str, tuple[tuple[int, ...], int]]:
    if reader.take("4s") != b"GGUF":
        raise ValueError("not a GGUF file")
    version = reader.take("I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not read here")
    n_tensors, n_kv = reader.take("Q"), reader.take("Q")
    for _ in range(n_kv):
        reader.string()
        reader.skip_value(reader.take("I"))
    tensors = {}
    for _ in range(n_tensors):
        name = reader.string()
        dims = tuple(reader.take("Q") for _ in range(reader.take("I")))
        kind = reader.take("I")
        reader.take("Q")  # offset
        block, block_bytes = sizes[types(kind)]
        elements = 1
        for d in dims:
            elements *= d
        tensors[name] = (dims, elements // block * block_bytes)
    return tensors


def gguf_bytes_per_token(path: str | os.PathLike) -> int:
    """The bytes of a GGUF file's tensors that one decoding step reads: all but the token embedding's other rows."""
    tensors = gguf_tensor_bytes(path)
    total = sum(n for _, n in tensors.values())
    if EMBEDDING in tensors and OUTPUT in tensors:
        dims, n = tensors[EMBEDDING]
        rows = dims[-1]  # GGUF lists dimensions innermost first: [hidden, vocabulary]
        total -= n - n // rows
    return total


def model_bytes_per_token(model) -> int:
    """The same count for a loaded torch model: its parameters' bytes (each tensor once; buffers such as rotary
    tables are not weights), and on a model on GGUF blocks its QuantLinears' blocks (buffers, but what a pass reads);
    the input embedding counts one row unless the output layer shares its weight."""
    from draftwise.backends.qgemm import QuantLinear

    seen, total = set(), 0
    blocks = (b for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers(recurse=False))
    for tensor in (*model.parameters(), *blocks):
        if tensor.data_ptr() in seen:
            continue  # tied weights, and Q6_K's scale doubling as its minimum, once
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    embedding = model.get_input_embeddings()
    raw = getattr(embedding, "raw", None)  # a QuantEmbedding's rows [vocab, bytes a row] (its weight would make all)
    if raw is not None:
        return total + int(raw.shape[1])
    weight = embedding.weight
    output = getattr(model.get_output_embeddings(), "weight", None)  # (a QuantLinear has blocks, no weight)
    if output is None or output.data_ptr() != weight.data_ptr():
        total -= (weight.shape[0] - 1) * weight.shape[1] * weight.element_size()
    return total


def last_level_cache_bytes() -> int | None:
    """The largest cache this CPU reports (Linux sysfs), or None where it says nothing."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def buffer_bytes() -> int:
    """CACHE_MULTIPLE x the last-level cache, at least MIN_BUFFER, at most MAX_BUFFER and a quarter of the memory
    free now."""
    cache = last_level_cache_bytes() or 64 * MIB
    size = max(MIN_BUFFER, CACHE_MULTIPLE * cache)
    available = _available_bytes()
    if available is not None:
        size = min(size, available // 4)
    return max(MIB, min(size, MAX_BUFFER)) // MIB * MIB


def measure_read_rate(threads: int | None = None, size: int | None = None, repeats: int = READ_REPEATS) -> dict:
    """The machine's streaming read rate: the best of repeats timed sums of a buffer of size bytes (default
    buffer_bytes()) on threads threads (default: torch's own), by each reader this machine has (_readers), the
    readers taking turns. Returns {bytes_per_s, rates: {reader: bytes/s}, buffer_bytes, cache_bytes, threads,
    repeats, how}."""
    import torch

    size = size or buffer_bytes()
    threads = threads or torch.get_num_threads()
    readers = _readers(size, threads)
    best = {name: float("inf") for name in readers}
    for _ in range(repeats + 1):  # the first warms up the threads
        for name, read in readers.items():
            started = time.perf_counter()
            read()
            best[name] = min(best[name], time.perf_counter() - started)
    del readers
    rates = {name: size / seconds for name, seconds in best.items()}
    return {"bytes_per_s": max(rates.values()), "rates": rates, "buffer_bytes": size,
            "cache_bytes": last_level_cache_bytes(), "threads": threads, "repeats": repeats,
            "how": _how(rates, size, threads, repeats)}


def _readers(size: int, threads: int) -> dict:
    """{name: a call that reads the whole buffer once}: torch's sum of float32 on threads threads, and the quant
    kernel's streaming sum of a huge-page arena where the kernel builds here."""
    import torch

    readers = {}
    try:
        from draftwise.backends.huge_pages import arena
        from draftwise.backends.qgemm import library

        kernel, words = library(), arena(size).view(np.int64)
        words.fill(1)  # written once: every page is there before timing

        def kernel_sum():  # (holds words: the arena lives as long as its reader)
            if kernel.dw_stream_sum(words.ctypes.data, words.size, threads) != words.size:
                raise AssertionError("the kernel's streaming sum missed words")

        readers["kernel"] = kernel_sum
    except (DraftwiseError, OSError):  # no compiler, or a CPU the kernel does not build for: torch alone
        pass
    buffer = torch.ones(size // 4, dtype=torch.float32)

    def torch_sum():
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            float(buffer.sum())
        finally:
            torch.set_num_threads(previous)

    readers["torch"] = torch_sum
    return readers


def _how(rates: dict, size: int, threads: int, repeats: int) -> str:
    """How the rate was read, for the report: the winning reader first, the others' rates beside it."""
    words = {"kernel": "the quant kernel sums", "torch": "torch sums"}
    best = max(rates, key=rates.get)
    others = ", ".join(f"{name}'s {rate / 1e9:.1f}" for name, rate in rates.items() if name != best)
    return (f"{words.get(best, best)} a {size / MIB:.0f} MiB buffer on {threads} thread{'s' * (threads != 1)}, "
            f"best of {repeats}" + (f"; {others} GB/s" if others else ""))


def best_read(*reads: dict | None) -> dict | None:
    """The fastest of several readings of the rate (the bench's before its runs and after them): the machine's
    rate is what it gives at its best, and a slow spell at one reading should not put the bound under the steps."""
    reads = [r for r in reads if r and r.get("bytes_per_s")]
    if not reads:
        return None
    best = max(reads, key=lambda r: r["bytes_per_s"])
    return {**best, "readings": [r["bytes_per_s"] for r in reads]}


def bound_ms(bytes_per_token: int | None, read: dict | None) -> float | None:
    """The shortest a plain step can be on this machine: its bytes over the read rate, in ms."""
    if not bytes_per_token or not read or not read.get("bytes_per_s"):
        return None
    return 1000 * bytes_per_token / read["bytes_per_s"]
