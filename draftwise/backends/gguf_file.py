"""A GGUF file opened for the quant backend, checked before anything large is allocated.

The gguf package's reader maps the file and makes numpy views of its tensors; nothing here copies a tensor. What a
truncated, corrupt or hostile file can claim is refused with one line that names the file and the tensor: a type no
reader knows, a dimension no model has, a row that is not whole blocks, bytes past the end of the file. Whether the
tensors fit the model the file's metadata describes is checked later, against the weightless skeleton (gguf_model.py),
still before any weight is read.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from draftwise.errors import DraftwiseError

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM = 1 << 31  # no dimension of any model reaches 2^31 (a 7B's largest is its 152,064-token vocabulary)


class GGUFFile:
    """The reader of a checked GGUF file: reader (gguf.GGUFReader), tensors by name, its architecture."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.reader = open_reader(self.path)
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self.architecture = self.field("general.architecture")
        if not self.architecture:
            raise DraftwiseError(f"{self.path.name}: the GGUF file names no architecture (general.architecture)")

    def field(self, key: str) -> str:
        """A string field of the metadata, or '' when it is absent."""
        field = self.reader.fields.get(key)
        if field is None or not field.data:
            return ""
        try:
            return bytes(field.parts[field.data[0]]).decode()
        except (UnicodeDecodeError, IndexError, TypeError):
            raise DraftwiseError(f"{self.path.name}: the GGUF field {key} is not a readable string") from None


def open_reader(path: Path):
    """gguf.GGUFReader on path, or a one-line DraftwiseError saying why the file cannot be one."""
    if not path.is_file():
        raise DraftwiseError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size < 24:  # magic, version, two counts
        raise DraftwiseError(f"{path.name}: {size} bytes is too short for a GGUF file (truncated?)")
    try:
        return _checked_reader_class()(str(path), "r")
    except DraftwiseError:
        raise
    except Exception as err:  # the reader's own: a bad magic, a version, a field cut short (IndexError, ValueError)
        raise DraftwiseError(f"{path.name}: not a readable GGUF file ({type(err).__name__}: "
                             f"{_one_line(err)}); it may be truncated or corrupt: pull it again") from None


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:200] + ("..." if len(text) > 200 else "")


@functools.lru_cache(maxsize=None)
def _checked_reader_class() -> type:
    """gguf.GGUFReader with _TensorChecks in front (gguf is imported only when a file is opened)."""
    from gguf import GGUFReader

    return type("CheckedGGUFReader", (_TensorChecks, GGUFReader), {})


class _TensorChecks:
    """Mixed in front of gguf.GGUFReader: each tensor's type, dimensions and bytes checked before the reader makes a
    view of it (which for a hostile entry fails with a numpy reshape error, or wraps a size around)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        file = os.path.basename(getattr(self.data, "filename", "") or "") or "the GGUF file"
        known = {int(t) for t in GGMLQuantizationType}
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode(errors="replace")
            type_number = int(raw_dtype[0])
            if type_number not in known:
                raise DraftwiseError(f"{file}: tensor {name} has quantization type number {type_number}, which no "
                                     "GGUF reader knows (a corrupt or newer file)")
            qtype = GGMLQuantizationType(type_number)
            shape = [int(d) for d in dims]
            if not 1 <= len(shape) <= MAX_DIMS or any(not 1 <= d <= MAX_DIM for d in shape):
                raise DraftwiseError(f"{file}: tensor {name} claims the shape {shape}: no model has it (a corrupt or "
                                     "hostile file)")
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if shape[0] % block:
                raise DraftwiseError(f"{file}: tensor {name} [{', '.join(map(str, shape))}] in {qtype.name}: its rows "
                                     f"of {shape[0]} values are not whole blocks of {block} (a corrupt file)")
            count = int(np.prod(np.array(shape, dtype=object)))  # (Python ints: no wrap-around)
            start = int(start_offs) + int(offset_tensor[0])
            end = start + count // block * block_bytes
            if end > len(self.data):
                raise DraftwiseError(f"{file}: tensor {name} [{', '.join(map(str, shape))}] {qtype.name} needs bytes "
                                     f"{start:,} to {end:,}, past the end of the file ({len(self.data):,} bytes): it "
                                     "is truncated or corrupt; pull it again")
        return super()._build_tensors(start_offs, fields)
