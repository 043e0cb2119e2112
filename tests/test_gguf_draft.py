"""A draft on the quant route (gguf_model.load_gguf_model(draft=True)): its linears on blocks wider than 4 bits are
re-quantized to 4 (a forward reads fewer bytes), kept in a pack cache of their own and read from it on the next
load; the target's linears stay the file's own blocks, and a target drafting for itself is shared, never changed.
Every method that drafts with it gives `none`'s tokens, on tiny GGUF files written here (tests/gguf_files.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import decode_together, tiny_tokenizer
from gguf_files import write_gguf

from draftwise import Engine
from draftwise.backends import gguf_model
from draftwise.backends.gguf_model import DRAFT_BLOCKS, draft_blocks, load_gguf_model
from draftwise.backends.qgemm import QuantLinear
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.models.packed import cache_path

IDS = [1, 5, 9, 33, 200, 7, 7, 150, 3]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def tiny(path: Path, linear: str, embedding: str, tied: bool, seed: int = 0) -> Path:
    # weights that average zero over the tiny tokenizer's vocabulary: tokens that depend on the text
    return write_gguf(path, linear=linear, embedding=embedding, tied=tied, seed=seed, vocab=len(tiny_tokenizer()),
                      centred=True)


def linears(model) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def packed_bytes(model) -> int:
    return sum(m.packed().nbytes for m in linears(model).values())


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]  # [T, vocab]


def refuse(*args, **kwargs):
    raise AssertionError("packed again: the cache was not read")


def test_a_drafts_wider_blocks_load_on_4_bits_and_the_targets_stay_the_files(home, tmp_path):
    path = tiny(tmp_path / "m.gguf", "Q6_K", "Q8_0", tied=False)
    target = load_gguf_model(path, progress=False)
    draft = load_gguf_model(path, progress=False, draft=True)
    assert {m.bits for m in linears(target).values()} == {6}  # the file's own Q6_K blocks
    assert {m.bits for m in linears(draft).values()} == {4} and linears(draft).keys() == linears(target).keys()
    assert packed_bytes(draft) < 0.75 * packed_bytes(target)
    # the draft's values are near the target's (a re-rounding of them), not another model's
    other = load_gguf_model(tiny(tmp_path / "o.gguf", "Q6_K", "Q8_0", tied=False, seed=1), progress=False)
    near, far = (logits(draft) - logits(target)).abs().mean(), (logits(other) - logits(target)).abs().mean()
    assert near < far / 2
    # a file already on 4-bit blocks loads the same as a draft: nothing re-quantized
    four = tiny(tmp_path / "q4.gguf", "Q4_K", "Q4_K", tied=False)
    assert torch.equal(logits(load_gguf_model(four, progress=False, draft=True)),
                       logits(load_gguf_model(four, progress=False)))


def test_a_second_draft_load_maps_its_own_cache_and_leaves_the_targets(home, tmp_path, monkeypatch):
    path = tiny(tmp_path / "m.gguf", "Q6_K", "Q8_0", tied=True)
    first = logits(load_gguf_model(path, progress=False, draft=True))
    own, targets = cache_path(path, DRAFT_BLOCKS), cache_path(path)
    assert own.is_file() and own != targets and not targets.exists()  # the target's cache is not the draft's
    target = logits(load_gguf_model(path, progress=False))  # writes the target's, beside the draft's
    written = own.stat().st_mtime_ns
    monkeypatch.setattr(gguf_model, "requantize_draft", refuse)
    monkeypatch.setattr(gguf_model, "pack_raw", refuse)
    assert torch.equal(logits(load_gguf_model(path, progress=False, draft=True)), first)
    assert torch.equal(logits(load_gguf_model(path, progress=False)), target)
    assert own.stat().st_mtime_ns == written and not torch.equal(first, target)


def test_the_targets_own_file_as_its_draft_shares_its_linears_and_leaves_it_as_it_was(home, tmp_path):
    path = tiny(tmp_path / "m.gguf", "Q4_K", "Q6_K", tied=True)  # the Qwen2.5 files' types
    target = load_gguf_model(path, progress=False)
    before, modules = logits(target), linears(target)
    draft = load_gguf_model(path, progress=False, draft=True, sharing=target)
    ours = linears(draft)
    # the decoder's Q4_K linears are the target's own modules; the output layer (the Q6_K embedding's) is 4-bit
    assert all(ours[name] is modules[name] for name in ours if name != "lm_head")
    assert ours["lm_head"] is not modules["lm_head"] and ours["lm_head"].bits == 4
    assert modules["lm_head"].bits == 6 and target.get_output_embeddings() is modules["lm_head"]
    assert linears(target) == modules and torch.equal(logits(target), before)
    assert not torch.equal(logits(draft), before)  # control: the draft's output layer is another's


def test_a_2bit_drafts_layers_load_on_2_bits_in_a_cache_of_their_own(home, tmp_path, monkeypatch):
    path = tiny(tmp_path / "m.gguf", "Q4_K", "Q6_K", tied=True)  # a decoder already on 4 bits goes to 2 too
    four = load_gguf_model(path, progress=False, draft=True)
    two = load_gguf_model(path, progress=False, draft=True, draft_bits=2)
    bits = {name: m.bits for name, m in linears(two).items()}
    assert bits.pop("lm_head") == 4 and set(bits.values()) == {2}  # the output layer as a 4-bit draft's
    assert packed_bytes(two) < 0.8 * packed_bytes(four)
    own = cache_path(path, draft_blocks(2))
    assert own.is_file() and own != cache_path(path, DRAFT_BLOCKS)
    first = logits(two)
    monkeypatch.setattr(gguf_model, "requantize_draft", refuse)
    assert torch.equal(logits(load_gguf_model(path, progress=False, draft=True, draft_bits=2)), first)
    target = load_gguf_model(path, progress=False)
    other = load_gguf_model(tiny(tmp_path / "o.gguf", "Q4_K", "Q6_K", tied=True, seed=1), progress=False)
    near, far = (first - logits(target)).abs().mean(), (logits(other) - logits(target)).abs().mean()
    assert 0 < near < far  # a coarser rounding of the same model, not another one
    with pytest.raises(DraftwiseError, match="take 4 or 2 bits, not 3"):
        load_gguf_model(path, progress=False, draft=True, draft_bits=3)


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_2bit_draft_gives_the_tokens_of_none(home, tmp_path, method):
    from draftwise.loading import QUANT_ASSEMBLY

    path = tiny(tmp_path / "target.gguf", "Q4_K", "Q6_K", tied=True)
    target = load_gguf_model(path, progress=False)
    draft = load_gguf_model(path, progress=False, draft=True, draft_bits=2)
    none = Engine.from_models(target, tiny_tokenizer(), method="none", **QUANT_ASSEMBLY)
    eng = Engine.from_models(target, tiny_tokenizer(), draft_model=draft, method=method, **QUANT_ASSEMBLY)
    looping = list(IDS) + list(none.generate(IDS, max_new_tokens=12, ignore_eos=True).token_ids)
    accepted = 0
    for prompt in (looping, IDS[:6]):
        want = none.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
        for k in (1, 4):
            result = eng.generate(prompt, max_new_tokens=20, ignore_eos=True, num_draft_tokens=k, adaptive=False)
            assert result.token_ids == want, f"{method}, k={k}"
            accepted += result.stats.accepted
    assert accepted > 0  # its guesses were checked, some kept


@pytest.fixture
def gguf_tokenizer(monkeypatch):
    """The tiny GGUF files hold token names, not a tokenizer: every load gets the tiny one (their vocabulary)."""
    import draftwise.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda *args: tiny_tokenizer())


@pytest.mark.parametrize("pair", ["own file", "other file"])
@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_4bit_draft_on_a_gguf_pair_gives_the_tokens_of_none_alone_and_batched(home, tmp_path, gguf_tokenizer,
                                                                                pair, method):
    target = tiny(tmp_path / "target.gguf", "Q4_K", "Q6_K", tied=True)
    draft = target if pair == "own file" else tiny(tmp_path / "draft.gguf", "Q6_K", "Q8_0", tied=False)
    none = Engine.from_pretrained(str(target), method="none", backend="quant", progress=False)
    eng = Engine.from_pretrained(str(target), draft=str(draft), method=method, backend="quant", progress=False)
    assert eng.speed_paths["backend"] == "quant" and set(eng.speed_paths["draft_kernels"]) == {"q4"}
    baseline = {}
    looping = tuple(IDS) + tuple(none.generate(IDS, max_new_tokens=12, ignore_eos=True).token_ids)
    prompts = (looping, tuple(IDS[:6]))
    accepted = 0
    for prompt in prompts:
        baseline[prompt] = tuple(none.generate(list(prompt), max_new_tokens=20, ignore_eos=True).token_ids)
        for k in (1, 4):
            result = eng.generate(list(prompt), max_new_tokens=20, ignore_eos=True, num_draft_tokens=k,
                                  adaptive=False)
            assert tuple(result.token_ids) == baseline[prompt], f"{pair} {method}, k={k}, alone"
            accepted += result.stats.accepted
    if pair == "own file":
        assert accepted > 0  # its 4-bit re-rounding still guesses the target's tokens
    cfg = GenerationConfig.from_options(max_new_tokens=20, num_draft_tokens=4, ignore_eos=True, method=method)
    seqs = decode_together(eng, [list(p) for p in prompts], cfg)
    assert [tuple(seq.context[len(p):]) for seq, p in zip(seqs, prompts)] == [baseline[p] for p in prompts]


def test_the_quant_backends_draft_reads_out_over_its_own_row_count(home, tmp_path):
    """QUANT_ASSEMBLY's readout reaches the draft: its output layer keeps the lowest QUANT_DRAFT_VOCAB ids (the
    tiny tokenizer's special ones among them) where the file has more, and its guesses leave `none`'s tokens."""
    from draftwise.loading import QUANT_ASSEMBLY, QUANT_DRAFT_VOCAB
    from draftwise.proposers.compact import KEEP_VOCAB

    path = write_gguf(tmp_path / "wide.gguf", vocab=QUANT_DRAFT_VOCAB + 512, centred=True)
    draft = load_gguf_model(path, progress=False, draft=True)  # (a file of 66,048 tokens reads slowly: one load)
    target = draft  # its own draft through a second backend: the readout is cut on the draft's copy alone
    none = Engine.from_models(target, tiny_tokenizer(), method="none", **QUANT_ASSEMBLY)
    eng = Engine.from_models(target, tiny_tokenizer(), draft_model=draft, method="draft", **QUANT_ASSEMBLY)
    assert QUANT_DRAFT_VOCAB > KEEP_VOCAB  # (4-bit rows: a wider readout than the float drafts')
    assert eng.proposer.token_ids.tolist() == list(range(QUANT_DRAFT_VOCAB))
    assert eng.speed_paths["draft_vocab"] == QUANT_DRAFT_VOCAB
    want = none.generate(IDS, max_new_tokens=16, ignore_eos=True).token_ids
    assert eng.generate(IDS, max_new_tokens=16, ignore_eos=True, num_draft_tokens=4, adaptive=False).token_ids == want
