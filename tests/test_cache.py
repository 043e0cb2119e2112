"""Caches: trim and regenerate gives the same tokens and logits; an exception leaves no cache ahead of the text."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import input_batch, tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.backends.hf import HFBackend

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_trim_then_forward_again_gives_the_same_logits(arch):
    backend = HFBackend(tiny_model(arch, 0))
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    backend.prefill(ids[:5])
    first = backend.forward(ids[5:])  # [n, vocab]
    assert backend.cache_len == len(ids)
    backend.trim(7)
    assert backend.cache_len == 7
    again = backend.forward(ids[7:])
    assert torch.allclose(first[2:], again, atol=1e-5)
    assert torch.equal(first[2:].argmax(-1), again.argmax(-1))


def test_closing_a_slot_keeps_the_others_when_the_last_never_ran_a_forward():
    # A lazily filled draft's slot may be opened after the buffers last grew, and closed without ever running:
    # freeing an earlier slot moves it down, and the slots that did run keep their keys and values.
    backend = HFBackend(tiny_model("llama", 0))
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    used = backend.open_slot()
    used.prefill(ids[:6])
    expected = used.forward(ids[6:8])
    used.trim(6)
    idle = [backend.open_slot() for _ in range(3)]  # rows past the buffers' rows
    backend.default.close()
    idle[0].close()
    assert [s.row for s in backend.cache.slots] == list(range(len(backend.cache.slots)))
    assert torch.allclose(used.forward(ids[6:8]), expected, atol=1e-5)
    idle[2].prefill(ids[:3])  # a moved, never-run slot works once it runs
    assert idle[2].cache_len == 3


def test_cached_logits_match_a_full_forward():
    model = tiny_model("llama", 0)
    backend = HFBackend(model)
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    backend.prefill(ids[:4])
    stepped = torch.cat([backend.forward(ids[4:8]), backend.forward(ids[8:])])  # [n - 4, vocab]
    with torch.no_grad():
        full = model(input_batch(ids)).logits[0, 4:]
    assert torch.allclose(stepped, full, atol=1e-4)


def test_generate_twice_is_identical():
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 2, 1))
    first = eng.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    second = eng.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
    assert first.token_ids == second.token_ids


class Boom(RuntimeError):
    pass


def failing_after(backend, calls: int):
    """Make the backend's model raise on the calls-th forward, after the cache was already extended."""
    real_forward = backend.model.forward
    count = {"n": 0}

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)  # the cache grows first, as a mid-pass failure would leave it
        count["n"] += 1
        if count["n"] == calls:
            raise Boom("injected")
        return out

    backend.model.forward = forward


@pytest.mark.parametrize("who", ["target", "draft"])
def test_an_exception_mid_round_leaves_no_cache_ahead_of_the_text(who):
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 0))
    backend = eng.target if who == "target" else eng.proposer.backend
    # adaptive=False: the draft drafts every round, whatever the measured prices say (a draft as big as its target
    # may not pay, and a planner that turns it off would never reach the failing forward).
    stream = eng.stream(PROMPT, max_new_tokens=30, num_draft_tokens=4, ignore_eos=True, adaptive=False)
    emitted = []
    failing_after(backend, calls=3 if who == "target" else 6)  # a few rounds in
    with pytest.raises(Boom):
        for event in stream:
            emitted.append(event.token_id)
    text_len = len(tiny_tokenizer()(PROMPT)["input_ids"]) + len(emitted)
    assert eng.target.cache_len == text_len - 1  # all but the last token, as between rounds
    assert eng.proposer.backend.cache_len == len(eng.proposer._cached) <= text_len
    text = tiny_tokenizer()(PROMPT)["input_ids"] + emitted
    assert eng.proposer._cached == text[: len(eng.proposer._cached)]  # a prefix of the text, nothing else
    # And the engine goes on from there: a new generation is unaffected.
    backend.model.forward = type(backend.model).forward.__get__(backend.model)
    assert eng.generate(PROMPT, max_new_tokens=10).token_ids == fresh_tokens(PROMPT, 10)


def fresh_tokens(prompt, n):
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="none")
    return eng.generate(prompt, max_new_tokens=n).token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
def test_a_forward_passes_the_cache_by_the_name_the_model_takes_without_a_deprecation_warning(arch):
    """transformers renamed `past_key_values` to `cache` and warns on the old name (a user saw it mid-stream)."""
    backend = HFBackend(tiny_model(arch))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.prefill([1, 2, 3])
        backend.forward([4, 5])
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert backend.cache_len == 5
