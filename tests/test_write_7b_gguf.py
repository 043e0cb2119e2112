"""scripts/write_7b_gguf.py: a GGUF of Qwen2.5-7B's shapes with random valid blocks, checked on small shapes (the
same code writes the 4.7 GB file): it loads on the quant route, its tensor types are a Q4_K_M file's, its tokenizer
is the source file's padded to the embedding's rows, and its activations stay finite."""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf

from draftwise.backends.gguf_model import load_gguf_model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "write_7b_gguf.py"


@functools.lru_cache(maxsize=None)
def script():
    spec = importlib.util.spec_from_file_location("write_7b_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def test_the_7b_shaped_file_on_small_shapes_loads_and_runs(tmp_path):
    import gguf

    writer = script()
    source = write_gguf(tmp_path / "source.gguf", "qwen2", vocab=300)  # a tokenizer of 300 tokens
    shape = writer.Shape(layers=8, hidden=256, ffn=512, heads=2, kv_heads=1, vocab=320, context=512)
    path = writer.write(tmp_path / "out", shape, tokenizer=source, progress=False)
    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[:300] == [f"t{i}" for i in range(300)] and tokens[300:] == [f"[PAD{i}]" for i in range(300, 320)]
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # the source has another depth: Q4_K_M by llama.cpp's use_more_bits, Q6_K for the output layer, and for attn_v
    # and ffn_down in layers 0, 3, 6 and 7 of 8
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert [i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 7]
    assert {types[f"blk.{i}.ffn_up.weight"] for i in range(8)} == {"Q4_K"}
    model = load_gguf_model(path, progress=False)
    assert model.config.num_hidden_layers == 8 and model.config.vocab_size == 320
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits[0]  # [5, 320]
    assert torch.isfinite(logits).all() and float(logits.std()) > 0
    assert len(set(logits.argmax(-1).tolist())) > 1  # not one token whatever the input


def test_it_refuses_to_write_into_the_repository():
    with pytest.raises(SystemExit):
        script().main([str(SCRIPT.parent / "scratch")])


def test_the_full_shape_is_qwen25_7bs_and_about_47_gb():
    writer = script()
    plan = writer.tensors(writer.QWEN25_7B)
    size = sum(writer.nbytes(dims, t) for _, dims, t in plan)
    assert 4.4e9 < size < 4.8e9
    params = sum(int(np.prod(dims)) for _, dims, _ in plan)
    assert 7.5e9 < params < 7.7e9  # Qwen2.5-7B: 7.6 billion parameters


def test_a_source_of_the_same_depth_gives_its_tensor_types(tmp_path):
    import gguf

    writer = script()
    source = write_gguf(tmp_path / "source.gguf", "qwen2", vocab=300, linear="Q6_K", embedding="Q6_K", layers=8)
    shape = writer.Shape(layers=8, hidden=256, ffn=512, heads=2, kv_heads=1, vocab=320, context=512)
    path = writer.write(tmp_path / "out", shape, tokenizer=source, progress=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {types[f"blk.{i}.ffn_up.weight"] for i in range(8)} == {"Q6_K"}  # the source's, not the rule's Q4_K
    assert types["token_embd.weight"] == "Q6_K"


@pytest.mark.real_model
def test_the_stores_qwen25_file_gives_the_7b_file_its_mix():
    writer = script()
    types = writer.source_types(writer.default_tokenizer(), 28)
    assert types["output.weight"] == "Q6_K"
    assert sum(types[f"blk.{i}.ffn_down.weight"] == "Q6_K" for i in range(28)) == 14
