"""Bad GGUF files (backends/gguf_file.py, gguf_model.py): each refused with one line that names the file and what is
wrong, before a weight is read or a large buffer allocated. The files are tiny valid ones written here, then cut or
patched."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf_files import write_gguf

from draftwise.models.gguf_file import GGUFFile
from draftwise.backends.gguf_model import load_gguf_model
from draftwise.errors import DraftwiseError

TENSOR = "blk.0.attn_q.weight"  # Q4_K [256, 256]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf").read_bytes()


def patched(tmp_path: Path, data: bytes, at: int, fmt: str, value) -> Path:
    raw = bytearray(data)
    struct.pack_into(fmt, raw, at, value)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(raw))
    return path


def info_at(data: bytes, name: str = TENSOR) -> int:
    """Where a tensor's entry continues after its name: n_dims (u32), dims (u64 each), type (u32), offset (u64)."""
    return data.index(name.encode()) + len(name)


def refused(path: Path, match: str) -> str:
    with pytest.raises(DraftwiseError, match=match) as error:
        load_gguf_model(path, progress=False)
    message = str(error.value)
    assert "\n" not in message and path.name in message
    return message


def test_a_good_file_reads(tmp_path, good):
    path = tmp_path / "ok.gguf"
    path.write_bytes(good)
    file = GGUFFile(path)
    assert file.architecture == "qwen2" and file.tensors[TENSOR].shape == (256, 256)
    assert file.tensors[TENSOR].tensor_type.name == "Q4_K"


@pytest.mark.parametrize("keep", [10, 100, 2000])
def test_a_file_cut_in_its_header_is_refused(tmp_path, good, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good[:keep])
    refused(path, "too short|header ends before|truncated")


def test_a_tensor_past_the_end_of_the_file_is_refused_by_name(tmp_path, good):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good[: len(good) - 1000])
    refused(path, r"tensor \S+ .* past the end of the file")


def test_an_unknown_quantization_type_is_refused(tmp_path, good):
    at = info_at(good) + 4 + 2 * 8
    refused(patched(tmp_path, good, at, "<I", 250), f"tensor {TENSOR} has quantization type number 250")


def test_a_huge_claimed_dimension_is_refused_before_anything_is_allocated(tmp_path, good):
    at = info_at(good) + 4 + 8  # the second dimension: the rows
    refused(patched(tmp_path, good, at, "<Q", 1 << 40), f"tensor {TENSOR} claims the shape")
    refused(patched(tmp_path, good, at, "<Q", 1 << 20), f"tensor {TENSOR} .* past the end of the file")


def test_a_row_that_is_not_whole_blocks_is_refused(tmp_path, good):
    at = info_at(good) + 4  # the first dimension: values a row
    refused(patched(tmp_path, good, at, "<Q", 250), "rows of 250 values are not whole blocks of 256")


def test_a_huge_count_of_tensors_is_refused(tmp_path, good):
    refused(patched(tmp_path, good, 8, "<Q", 1 << 40), "claims 1,099,511,627,776 tensors")


def test_a_tensor_that_does_not_fit_the_model_is_refused(tmp_path):
    from gguf_files import raw_blocks
    import numpy as np

    wrong = raw_blocks("Q4_K", 128, 256, np.random.default_rng(0))  # 128 rows where the model has 256
    path = write_gguf(tmp_path / "misfit.gguf", tensors={TENSOR: (wrong, "Q4_K")})
    refused(path, rf"tensor {TENSOR} is \[128, 256\] but the qwen2 model .* \[256, 256\]")


def test_an_architecture_it_does_not_run_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", "gemma2")
    refused(path, "runs the GGUF architectures qwen2 .* not 'gemma2' \\(its attention soft cap.*\\): use --backend llamacpp")


def test_blocks_the_kernel_does_not_read_are_refused_before_loading(tmp_path):
    import numpy as np

    blocks = np.zeros((256, 256 // 256 * 176), dtype=np.uint8)  # Q5_K: 176 bytes a block of 256
    path = write_gguf(tmp_path / "q5k.gguf", tensors={TENSOR: (blocks, "Q5_K")})
    refused(path, "Q5_K blocks, which the quant backend does not read")
