"""A GGUF file opened for the quant backend: its header read, each tensor checked, before anything large is allocated.

Only what loading needs is read: the scalar and string metadata (the architecture, the alignment), and the tensor list
(name, type, shape, where its bytes lie), each tensor a numpy view of the mapped file; arrays in the metadata (a
vocabulary's tokens and merges: hundreds of thousands of strings) are stepped over, not parsed (the gguf package's
reader spends most of a load making a view of each). What a truncated, corrupt or hostile file can claim is refused
with one line that names the file and the tensor: a header cut short, a type no reader knows, a dimension no model
has, a row that is not whole blocks, bytes past the end of the file. Whether the tensors fit the model the file's
metadata describes is checked later, against the weightless skeleton (gguf_model.py), still before any weight is read.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftwise.errors import DraftwiseError

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM = 1 << 31  # no dimension of any model reaches 2^31 (a 7B's largest is its 152,064-token vocabulary)
MAX_COUNT = 1 << 24  # tensors or metadata entries a file may claim (a large model has a few thousand)
# metadata value type -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
TYPED = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64}


@dataclass
class Tensor:
    """One tensor of the file: shape innermost first (as GGUF lists it), data a view of the mapped file ([rows, bytes
    a row] uint8 for blocks; the float values, outermost first, for a float type)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cut(Exception):
    """The header ends before a value it announces."""


class GGUFFile:
    """A checked GGUF file: fields (scalar and string metadata), tensors by name, its architecture."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise DraftwiseError(f"{self.path}: no such GGUF file")
        self.size = self.path.stat().st_size
        if self.size < 24:  # magic, version, two counts
            raise DraftwiseError(f"{self.path.name}: {self.size} bytes is too short for a GGUF file (truncated?)")
        with open(self.path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.map = np.frombuffer(self.mm, dtype=np.uint8)  # the tensors' views (the mapping lives while they do)
        self.fields: dict[str, object] = {}
        self.tensors: dict[str, Tensor] = {}
        try:
            self._read()
        except _Cut:
            raise DraftwiseError(f"{self.path.name}: the GGUF header ends before the values it announces: the file is "
                                 "truncated or corrupt; pull it again") from None
        self.architecture = self.fields.get("general.architecture")
        if not isinstance(self.architecture, str) or not self.architecture:
            raise DraftwiseError(f"{self.path.name}: the GGUF file names no architecture (general.architecture)")

    def field(self, key: str) -> str:
        """A string field of the metadata, or '' when it is absent."""
        value = self.fields.get(key, "")
        return value if isinstance(value, str) else ""

    # -- the header ----------------------------------------------------------------------------------------------
    def _read(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.mm[:4] != MAGIC:
            raise DraftwiseError(f"{self.path.name}: not a GGUF file (it does not begin with the bytes GGUF)")
        self.at = 4
        version, tensors, entries = self._scalar("<I"), self._scalar("<Q"), self._scalar("<Q")
        if version not in (2, 3):
            raise DraftwiseError(f"{self.path.name}: GGUF version {version}; draftwise reads versions 2 and 3")
        for what, count in (("tensors", tensors), ("metadata entries", entries)):
            if count > MAX_COUNT:
                raise DraftwiseError(f"{self.path.name}: the header claims {count:,} {what}: no model has that many "
                                     "(a corrupt or hostile file)")
        for _ in range(entries):
            key = self._string()
            kind = self._scalar("<I")
            value = self._value(kind, key)
            if value is not None:
                self.fields[key] = value
        infos = []
        for _ in range(tensors):
            name = self._string()
            dims = self._scalar("<I")
            if not 1 <= dims <= MAX_DIMS:
                raise DraftwiseError(f"{self.path.name}: tensor {name} claims {dims} dimensions (a corrupt file)")
            shape = tuple(self._scalar("<Q") for _ in range(dims))
            infos.append((name, shape, self._scalar("<I"), self._scalar("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise DraftwiseError(f"{self.path.name}: general.alignment {alignment!r} is not a power of two")
        start = -(-self.at // alignment) * alignment
        known = {int(t) for t in GGMLQuantizationType}
        for name, shape, type_number, offset in infos:
            if type_number not in known:
                raise DraftwiseError(f"{self.path.name}: tensor {name} has quantization type number {type_number}, "
                                     "which no GGUF reader knows (a corrupt or newer file)")
            qtype = GGMLQuantizationType(type_number)
            if any(not 1 <= d <= MAX_DIM for d in shape):
                raise DraftwiseError(f"{self.path.name}: tensor {name} claims the shape {list(shape)}: no model has "
                                     "it (a corrupt or hostile file)")
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if shape[0] % block:
                raise DraftwiseError(f"{self.path.name}: tensor {name} {list(shape)} in {qtype.name}: its rows of "
                                     f"{shape[0]} values are not whole blocks of {block} (a corrupt file)")
            count = 1
            for d in shape:
                count *= d  # (Python ints: no wrap-around)
            begin, n_bytes = start + offset, count // block * block_bytes
            if begin + n_bytes > self.size:
                raise DraftwiseError(f"{self.path.name}: tensor {name} {list(shape)} {qtype.name} needs bytes "
                                     f"{begin:,} to {begin + n_bytes:,}, past the end of the file ({self.size:,} "
                                     "bytes): it is truncated or corrupt; pull it again")
            if name in self.tensors:
                raise DraftwiseError(f"{self.path.name}: tensor {name} is listed twice (a corrupt file)")
            self.tensors[name] = Tensor(name, qtype, shape, count, n_bytes, begin,
                                        self._view(qtype, shape, begin, n_bytes))

    def _view(self, qtype, shape: tuple[int, ...], begin: int, n_bytes: int) -> np.ndarray:
        raw = self.map[begin:begin + n_bytes]
        outer = tuple(reversed(shape))  # outermost first, as numpy and torch list them
        if qtype.name in TYPED:
            return raw.view(TYPED[qtype.name]).reshape(outer)
        rows = int(np.prod(outer[:-1], dtype=np.int64)) if len(outer) > 1 else 1
        return raw.reshape(rows, n_bytes // rows)  # [rows, bytes a row]

    def _take(self, n: int) -> bytes:
        if n < 0 or self.at + n > self.size:
            raise _Cut
        chunk = self.mm[self.at:self.at + n]
        self.at += n
        return chunk

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > self.size:
            raise _Cut
        value = struct.unpack_from(fmt, self.mm, self.at)[0]
        self.at += size
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        if length > self.size:
            raise _Cut
        return self._take(length).decode("utf-8", errors="replace")

    def _value(self, kind: int, key: str):
        """The value of one metadata entry (None for an array: stepped over)."""
        if kind in SCALARS:
            return self._scalar(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._scalar("<I"), self._scalar("<Q")
            if item in SCALARS:
                step = struct.calcsize(SCALARS[item]) * count
                if self.at + step > self.size:
                    raise _Cut
                self.at += step
            elif item == STRING:
                self._skip_strings(count)
            else:
                raise DraftwiseError(f"{self.path.name}: metadata {key} is an array of type {item}, which GGUF does not "
                                     "define (a corrupt file)")
            return None
        raise DraftwiseError(f"{self.path.name}: metadata {key} has value type {kind}, which GGUF does not define "
                             "(a corrupt file)")

    def _skip_strings(self, count: int) -> None:
        """Step over count strings (each a u64 length, then its bytes) without making them."""
        if count > self.size // 8:
            raise _Cut
        at, size, mm, length = self.at, self.size, self.mm, struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > size:
                raise _Cut
            at += 8 + length(mm, at)[0]
        if at > size:
            raise _Cut
        self.at = at


# Llama 3.1's rotary scaling as llama.cpp's converter writes it: a tensor of one divisor per rotary frequency, not
# metadata, so a config read from the file (transformers') leaves the frequencies unscaled.
ROPE_FACTORS = "rope_freqs.weight"


def rope_factors(file: GGUFFile) -> np.ndarray | None:
    """The file's rotary frequency divisors [head_dim / 2] float32, or None where it has none."""
    tensor = file.tensors.get(ROPE_FACTORS)
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32":
        raise DraftwiseError(f"{file.path.name}: {ROPE_FACTORS} is {tensor.tensor_type.name}; llama.cpp writes it "
                             "as F32 (a corrupt file?)")
    return np.array(tensor.data, dtype=np.float32).reshape(-1)  # (a copy: torch wants writable memory)


def refuse_rope_factors(path: str | os.PathLike[str]) -> None:
    """transformers' GGUF loader drops a Llama 3.1 file's rotary scaling (its rope_freqs tensor), so a float model it
    makes would rotate every position as a Llama 3's and say other things than the file: refused before it is made,
    naming the backends that apply it."""
    path = Path(path)
    if ROPE_FACTORS in GGUFFile(path).tensors:
        raise DraftwiseError(f"{path.name} scales its rotary frequencies with a {ROPE_FACTORS} tensor (as Llama 3.1 "
                             "files do), which transformers' GGUF loader ignores; run it with --backend quant or "
                             "--backend llamacpp, which apply it")

