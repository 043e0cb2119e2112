"""Llama 3.1 files carry their rotary scaling as a rope_freqs tensor (one divisor per frequency, as llama.cpp's
converter writes it), not as metadata: the quant route divides the frequencies by it, as llama.cpp does, and the hf
route, whose GGUF loader would drop it, refuses such a file by name."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from gguf_files import write_gguf

from draftwise.backends import gguf_model
from draftwise.backends.gguf_model import load_gguf_model
from draftwise.backends.hf import load_model
from draftwise.errors import DraftwiseError
from draftwise.models.gguf_file import ROPE_FACTORS

HEAD_DIM, THETA = 64, 10000.0  # the tiny llama file's (tests/gguf_files.py)
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
IDS = torch.tensor([[1, 5, 9, 33, 200, 7, 7, 150, 3, 9, 33, 200, 7, 11]])


def llama31_factors() -> np.ndarray:
    """rope_freqs as llama.cpp's converter computes it from a Llama 3.1 config's rope_scaling."""
    freqs = 1.0 / (THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    old = SCALING["original_max_position_embeddings"]
    low, high, factor = old / SCALING["low_freq_factor"], old / SCALING["high_freq_factor"], SCALING["factor"]
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < high:
            out.append(1.0)
        elif wavelength > low:
            out.append(factor)
        else:
            smooth = (old / wavelength - SCALING["low_freq_factor"]) / (SCALING["high_freq_factor"]
                                                                         - SCALING["low_freq_factor"])
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(tmp_path, name: str, factors: np.ndarray | None):
    tensors = None if factors is None else {ROPE_FACTORS: (factors, None)}
    return write_gguf(tmp_path / f"{name}.gguf", "llama", tensors=tensors, centred=True)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def llama3_frequencies(model) -> torch.Tensor:
    """transformers' own Llama 3.1 frequencies for the model's config with the scaling the factors came from."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": THETA, **SCALING}
    return ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))[0].float()


def test_the_frequencies_are_transformers_llama3_ones(tmp_path):
    factors = llama31_factors()
    assert (factors > 1).any() and (factors == 1).any()  # (the file scales some frequencies, not all)
    model = load_gguf_model(write(tmp_path, "scaled", factors), progress=False, cache=False)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, llama3_frequencies(model), rtol=1e-6, atol=0)


def test_the_scaling_changes_the_logits_and_factors_of_one_change_nothing(tmp_path):
    plain = logits(load_gguf_model(write(tmp_path, "plain", None), progress=False, cache=False))
    ones = logits(load_gguf_model(write(tmp_path, "ones", np.ones(HEAD_DIM // 2, np.float32)), progress=False,
                                  cache=False))
    scaled = logits(load_gguf_model(write(tmp_path, "scaled", llama31_factors()), progress=False, cache=False))
    assert torch.equal(ones, plain)
    assert not torch.allclose(scaled[0, 1:], plain[0, 1:], atol=1e-4)  # position 0 does not rotate


def test_a_loader_that_ignores_the_tensor_would_be_caught(tmp_path, monkeypatch):
    """Control: without the division (as transformers' GGUF loader reads such a file) the frequencies are a Llama
    3's, and the first test's comparison fails."""
    monkeypatch.setattr(gguf_model, "rope_factors", lambda file: None)
    ignored = load_gguf_model(write(tmp_path, "scaled", llama31_factors()), progress=False, cache=False)
    assert not torch.allclose(ignored.model.rotary_emb.inv_freq, llama3_frequencies(ignored), rtol=1e-6, atol=0)


def test_factors_of_the_wrong_length_are_refused(tmp_path):
    path = write(tmp_path, "short", np.ones(HEAD_DIM // 4, np.float32))
    with pytest.raises(DraftwiseError, match="rope_freqs.weight has 16 values but the model rotates 32"):
        load_gguf_model(path, progress=False, cache=False)


def test_the_hf_backend_refuses_a_file_whose_scaling_it_would_drop(tmp_path):
    path = write(tmp_path, "scaled", llama31_factors())
    with pytest.raises(DraftwiseError, match="--backend quant or --backend llamacpp"):
        load_model(str(tmp_path), path.name, "float32")


def test_the_store_makes_no_float_copy_of_such_a_file(tmp_path):
    from draftwise.models.convert import convert_gguf

    path = write(tmp_path, "scaled", llama31_factors())
    with pytest.raises(DraftwiseError, match="rope_freqs"):
        convert_gguf(tmp_path, path.name, tmp_path / "float32", progress=False)
    assert not (tmp_path / "float32").exists()
