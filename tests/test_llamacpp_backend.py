"""The llama.cpp backend: the GGUF file as published (SmolLM2-135M's, from the store), exact on its own route.

The real-model tests skip only where llama-cpp-python is not installed (`pip install 'draftwise[llamacpp]'`)."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from conftest import decode_together

from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.methods import available_methods, check_backend

NAME = "smollm2-135m-instruct"
PROMPT = ("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"
          "    left = [x for x in arr if x < pivot]\n")
OTHER = "The cat sat on the mat and looked at the hat. The cat sat on the"
NEW_TOKENS = 40

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (pip install 'draftwise[llamacpp]')")


# ---- refused before anything loads ---------------------------------------------------------------------


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(DraftwiseError, match="unknown backend 'vllm'; choose one of: hf, quant, llamacpp"):
        Engine.from_pretrained("no-such-model", method="none", backend="vllm")


@pytest.mark.parametrize("method", ["draft-tree", "lookup-tree", "hybrid-tree", "skip", "head"])
def test_methods_the_llamacpp_backend_cannot_serve_are_refused_before_loading(method):
    # (the target does not exist: the refusal comes before any name is resolved)
    with pytest.raises(DraftwiseError, match=f"method {method!r} needs .* the llamacpp backend does not give; it "
                                             "runs on the hf (or quant )?backend"):
        Engine.from_pretrained("no-such-model", draft="no-such-draft", method=method, backend="llamacpp")


def test_an_engine_on_llamacpp_offers_its_sequences_the_chain_methods_only():
    assert available_methods("hybrid", "llamacpp") == ("none", "lookup", "draft", "hybrid")
    assert "draft-tree" in available_methods("hybrid", "hf")
    check_backend("llamacpp", "hybrid")  # served: no error


# ---- the backend on a real file ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def gguf_and_tokenizer():
    from draftwise.backends.hf import load_tokenizer
    from draftwise.models import resolve

    source = resolve(NAME, progress=False)
    if source.gguf_path is None:
        pytest.fail(f"{NAME} was pulled before the store kept its GGUF: draftwise models pull {NAME} --force")
    return str(source.gguf_path), load_tokenizer(str(source.path), source.gguf_file)


def backend(**options):
    from draftwise.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend(gguf_and_tokenizer()[0], slots=6, context=512, **options)


def ids(text: str) -> list[int]:
    return gguf_and_tokenizer()[1](text)["input_ids"]


def positions_by_call_shape(model) -> dict[str, torch.Tensor]:
    """The logits of the same 5 positions (after a 20-token prefix), computed by the call shapes the engine uses:
    one-token steps, one 5-token pass, a row beside a shorter one in a ragged batch, and one-token steps from the
    first token on (the prefix's cache made by steps, not by one prefill)."""
    text = ids(PROMPT)
    prefix, new = text[:20], text[20:25]
    steps, chunk, batched, other, from_start = (model.open_slot() for _ in range(5))
    shapes = {}
    steps.prefill(prefix)
    shapes["one-token steps"] = torch.cat([steps.forward([t]) for t in new])
    chunk.prefill(prefix)
    shapes["one 5-token pass"] = chunk.forward(new)
    batched.prefill(prefix)
    other.prefill(ids(OTHER))
    shapes["a row of a ragged batch"] = model.forward_batch([(batched, new), (other, ids(" the dog")[:2])])[0]
    shapes["steps from the first token"] = torch.cat([from_start.forward([t]) for t in text[:25]])[20:]
    for view in (steps, chunk, batched, other, from_start):
        view.close()
    return shapes


@needs_llama
@pytest.mark.real_model
def test_a_positions_logits_do_not_depend_on_the_call_that_computed_them():
    shapes = positions_by_call_shape(backend())
    first = shapes["one 5-token pass"]
    assert first.shape == (5, backend_vocab()) and first.dtype == torch.float32
    for name, logits in shapes.items():
        assert torch.equal(logits, first), f"{name}: max |diff| {float((logits - first).abs().max())}"


@functools.lru_cache(maxsize=None)
def backend_vocab() -> int:
    return backend().vocab_size


@needs_llama
@pytest.mark.real_model
def test_trim_then_regenerate_equals_a_fresh_run():
    model = backend()
    text = ids(PROMPT)
    fresh = model.open_slot()
    fresh.prefill(text[:30])
    expected = fresh.forward(text[30:34])
    rolled = model.open_slot()
    rolled.prefill(text[:30])
    rolled.forward([1, 2, 3, 4, 5, 6])  # a rejected draft
    rolled.trim(30)
    assert rolled.cache_len == 30
    assert torch.equal(rolled.forward(text[30:34]), expected)


@needs_llama
@pytest.mark.real_model
def test_trees_hidden_states_and_a_full_context_are_refused():
    model = backend()
    with pytest.raises(DraftwiseError, match="no hidden states"):
        model.default.append(ids(PROMPT), hidden=True)
    with pytest.raises(DraftwiseError, match="keeps no token tree"):
        model.default.keep(0, [1])
    with pytest.raises(DraftwiseError, match="exceeds the model's context of 512"):
        model.default.prefill([1] * 513)
    assert model.default.restore(ids(PROMPT)) == 0  # no prompt cache: nothing restored


# ---- greedy identity through the engine ----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def engine(method: str) -> Engine:
    draft = NAME if method in ("draft", "hybrid") else None
    return Engine.from_pretrained(NAME, draft=draft, method=method, backend="llamacpp", progress=False)


def greedy(method: str, k: int = 4) -> GenerationConfig:
    return GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True,
                                         method=method)


@functools.lru_cache(maxsize=None)
def baseline(prompt: str) -> tuple[int, ...]:
    return tuple(engine("none").generate(ids(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids)


def together(eng: Engine, prompts: list[str], method: str) -> list[list[int]]:
    """Both prompts as one batch: each round of both sequences one engine.step."""
    seqs = decode_together(eng, [ids(p) for p in prompts], greedy(method))
    return [seq.context[len(ids(p)):] for seq, p in zip(seqs, prompts)]


@needs_llama
@pytest.mark.real_model
@pytest.mark.parametrize("method", ["lookup", "draft", "hybrid"])
def test_every_method_gives_the_tokens_of_none_alone_and_batched(method):
    eng = engine(method)
    assert eng.speed_paths["backend"] == "llamacpp"
    for prompt, k in ((PROMPT, 1), (PROMPT, 4), (OTHER, 4)):  # (every pass at least MIN_WIDTH wide: k 1 and 4 alike)
        got = eng.generate(ids(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=k,
                           adaptive=False).token_ids  # (a fixed k: every round drafts)
        assert tuple(got) == baseline(prompt), f"{method}, k={k}, alone"
    batched = together(eng, [PROMPT, OTHER], method)
    assert [tuple(row) for row in batched] == [baseline(PROMPT), baseline(OTHER)], f"{method}, batched"
