"""The GGUF file as published is the model (backends/gguf_model.py): a weightless skeleton filled from the file.

Its logits are the same bits as the route before it (transformers de-quantizes the file into a float32 model, whose
linears are then swapped onto the same blocks: quant_model.on_gguf_weights), on tiny files written here and on the
store's SmolLM2; and no float copy of the whole model is made."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import HIDDEN, VOCAB, write_gguf

from draftwise.backends.gguf_model import QuantEmbedding, load_gguf_model
from draftwise.backends.qgemm import QuantLinear
from draftwise.backends.quant_model import compact_on_blocks, on_gguf_weights, runs_on_blocks

IDS = [1, 5, 9, 33, 200, 7, 7, 7, 150, 3]


def route_before(path: Path):
    """transformers' float32 model of the file, its linears then put on the file's blocks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return on_gguf_weights(model, path, progress=False)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, vocab]


def greedy(model, ids=IDS, new: int = 8) -> list[int]:
    ids = list(ids)
    for _ in range(new):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return ids[len(IDS):]


@functools.lru_cache(maxsize=None)
def tiny_file(root: str, arch: str, tied: bool, linear: str = "Q4_K", embedding: str = "Q6_K", seed: int = 0) -> Path:
    return write_gguf(Path(root) / f"{arch}-{tied}-{linear}-{embedding}-{seed}.gguf", arch, linear=linear,
                      embedding=embedding, tied=tied, seed=seed)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("arch,tied,linear,embedding", [
    ("qwen2", True, "Q4_K", "Q6_K"),  # the Qwen2.5 files' types, the output layer tied to the embedding
    ("llama", False, "Q4_1", "Q8_0"),  # SmolLM2's: q and k in llama.cpp's rotary order, an output layer of its own
    ("qwen2", False, "Q6_K", "Q4_K"),
])
def test_the_file_as_published_gives_the_bits_of_the_route_before(root, arch, tied, linear, embedding):
    path = tiny_file(root, arch, tied, linear, embedding)
    native, before = load_gguf_model(path, progress=False), route_before(path)
    assert type(native) is type(before) and runs_on_blocks(native)
    assert torch.equal(logits(native), logits(before))
    assert greedy(native) == greedy(before)
    # control: another file's weights give other logits
    other = load_gguf_model(tiny_file(root, arch, tied, linear, embedding, seed=1), progress=False)
    assert not torch.equal(logits(other), logits(before))


def test_the_rotary_frequencies_are_computed_not_left_on_the_meta_device(root):
    from transformers import AutoModelForCausalLM

    native = load_gguf_model(tiny_file(root, "qwen2", True), progress=False)
    fresh = AutoModelForCausalLM.from_config(native.config)  # on the CPU: what the model computes itself
    assert torch.equal(native.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    assert not any(t.is_meta for t in [*native.parameters(), *native.buffers()])
    assert native.dtype == torch.float32 and native.device.type == "cpu"


def test_no_float_copy_of_the_model_is_made(root):
    path = tiny_file(root, "qwen2", True)
    native = load_gguf_model(path, progress=False)
    embedding = native.get_input_embeddings()
    assert isinstance(embedding, QuantEmbedding) and isinstance(native.get_output_embeddings(), QuantLinear)
    floats = sum(t.numel() for t in [*native.parameters(), *native.buffers()] if t.is_floating_point())
    assert floats < VOCAB * HIDDEN / 4  # norms, biases, scales: never a table or a weight in float
    # the rows it looks up are the float model's own, bit for bit, and only those are made
    before = route_before(path).get_input_embeddings().weight
    ids = torch.tensor([[0, 7, VOCAB - 1], [3, 3, 5]])
    assert torch.equal(embedding(ids), before[ids])
    assert torch.equal(embedding.weight, before)
    with pytest.raises(IndexError):
        embedding(torch.tensor([VOCAB]))


@pytest.mark.parametrize("embedding_type", ["Q6_K", "Q8_0", "Q4_K"])
def test_rows_kept_from_earlier_lookups_are_the_rows_looked_up_afresh(root, embedding_type):
    from draftwise.backends import gguf_model

    embedding = load_gguf_model(tiny_file(root, "qwen2", False, embedding=embedding_type),
                                progress=False).get_input_embeddings()
    table = embedding.weight  # [vocab, dim]: every row de-quantized at once, nothing kept
    steps = [[5], [5], [9, 5, 9], [VOCAB - 1], list(range(40)), [0]]  # repeats, a few at once, past the limit
    embedding._kept_limit = 32  # (so that the steps above clear the kept rows too)
    for ids in steps:
        assert torch.equal(embedding(torch.tensor([ids])), table[torch.tensor([ids])]), ids
        assert len(embedding._kept) <= 40
    many = torch.arange(gguf_model.KEPT_LOOKUP + 1)[None]  # a prefill's lookup: de-quantized, not kept
    before = dict(embedding._kept)
    assert torch.equal(embedding(many), table[many]) and embedding._kept.keys() == before.keys()
    # control: a kept row of another id gives another embedding
    embedding._kept[5] = table[6]
    assert not torch.equal(embedding(torch.tensor([[5]])), table[torch.tensor([[5]])])


def test_a_drafts_output_layer_cut_on_its_blocks_keeps_those_rows_bits(root):
    native = load_gguf_model(tiny_file(root, "qwen2", True), progress=False)
    full = logits(native)
    small, token_ids = compact_on_blocks(native, special_ids=[VOCAB - 1], keep_vocab=64)
    assert token_ids.tolist() == [*range(64), VOCAB - 1]
    assert torch.equal(logits(small), full[:, token_ids])
    assert native.get_output_embeddings().out_features == VOCAB  # the model passed in is left as it was
    assert torch.equal(logits(native), full)
    assert compact_on_blocks(native, keep_vocab=VOCAB) == (native, None)  # nothing to cut


@pytest.mark.real_model
def test_the_stores_smollm2_file_gives_the_bits_of_the_route_before():
    from draftwise.models import resolve

    source = resolve("smollm2-135m-instruct", progress=False)
    native = load_gguf_model(source.gguf_path, progress=False)
    before = route_before(source.gguf_path)
    ids = list(np.random.default_rng(0).integers(0, 49152, 24))
    assert torch.equal(logits(native, ids), logits(before, ids))
