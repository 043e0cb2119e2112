"""Greedy speculative output is token for token the target's own greedy output."""
from __future__ import annotations

import functools

import pytest

from conftest import near_model, tiny_model, tiny_tokenizer, transformers_greedy
from draftwise import Engine
from draftwise.backends import kernels

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"
NEW_TOKENS = 40


@functools.lru_cache(maxsize=None)
def model(arch, seed, layers=2):
    return tiny_model(arch, seed, layers)


@functools.lru_cache(maxsize=None)
def reference(arch):
    """The target's own greedy tokens, from transformers' generate."""
    return transformers_greedy(model(arch, 0), tiny_tokenizer()(PROMPT)["input_ids"], NEW_TOKENS)


def draft_model(arch, draft):
    """same: the target's twin (every guess kept); near: right often, not always (rounds cut short); unrelated."""
    return {"same": lambda: model(arch, 0), "near": lambda: near_model(arch), "unrelated": lambda: model(arch, 1, 1),
            None: lambda: None}[draft]()


def engine(arch, method, draft=None):
    """compact_draft=False keeps a "same" draft an exact twin (int8 would make it only nearly so)."""
    return Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=draft_model(arch, draft), method=method,
                              compact_draft=False)


CASES = [("none", None), ("draft", "same"), ("draft", "near"), ("draft", "unrelated"), ("lookup", None),
         ("lookup-tree", None), ("hybrid", "same"), ("hybrid", "near"), ("hybrid", "unrelated"), ("skip", None),
         ("hybrid-skip", None)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("method,draft", CASES, ids=[f"{m}-{d}" if d else m for m, d in CASES])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_the_targets_own(arch, method, draft, k):
    # Fixed k, so the counts below are known exactly for an exact-twin draft.
    eng = engine(arch, method, draft)
    rounds = []  # per round that drafted: (tokens kept, tokens offered)
    eng.round_observer = lambda seq, offered, verdict, times: rounds.append((verdict.num_accepted, len(offered)))
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(arch)
    assert result.finish_reason == "length"
    stats = result.stats
    assert stats.new_tokens == NEW_TOKENS
    if method == "draft" and draft == "same":  # (the hybrid's lookup rounds may miss; see test_hybrid.py)
        assert stats.acceptance_rate == 1.0  # a draft identical to the target is always right
        assert stats.target_forwards == -(-NEW_TOKENS // (k + 1))  # ceil: k + 1 tokens per pass
    if method == "draft" and draft == "unrelated":
        assert stats.acceptance_rate < 0.3
    if draft == "near":  # rounds that kept some of a draft and rejected the rest: the cache rewinds mid-draft
        assert any(0 < n < offered for n, offered in rounds) if k > 1 else 0 < stats.acceptance_rate < 1
    if method in ("lookup", "lookup-tree", "skip", "hybrid-skip"):  # they did speculate, and some of it was kept
        assert stats.accepted > 0
    if method == "none":
        assert stats.target_forwards == NEW_TOKENS and stats.proposed == 0


def test_a_draft_not_made_compact_keeps_its_own_values_whatever_the_timings_say(monkeypatch):
    # Timings on a loaded machine may favour int8 for a tiny shape: a draft not made compact must not take it (its
    # choice would also be cached for every later load), or a twin draft stops guessing every token right.
    timed = kernels.plan_kernels

    def int8_always_fastest(model, chosen=kernels.EXACT_KERNELS, widths=kernels.TARGET_WIDTHS, cache=True):
        plan = timed(model, chosen, widths, cache=False)
        if kernels.INVARIANT_INT8 not in chosen:
            return plan
        return kernels.KernelPlan(dict.fromkeys(plan.choices, kernels.INVARIANT_INT8), {}, plan.widths)

    monkeypatch.setattr(kernels, "plan_kernels", int8_always_fastest)
    eng = engine("llama", "draft", "same")
    assert set(eng.speed_paths["draft_kernels"]) == {kernels.INVARIANT}
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference("llama") and result.stats.acceptance_rate == 1.0
    # the control: timed among both invariant kernels, as the draft once was, the same timings put it on int8
    timed_both = kernels.on_timed_kernels(model("llama", 0), kernels.INVARIANT_KERNELS, kernels.DRAFT_WIDTHS)
    assert kernels.INVARIANT_INT8 in kernels.kernel_counts(timed_both)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("method,draft", CASES, ids=[f"{m}-{d}" if d else m for m, d in CASES])
@pytest.mark.parametrize("k", [2, 8])
def test_adaptive_k_and_compact_draft_keep_the_targets_output(arch, method, draft, k):
    # What users run by default: k chosen each round from measured costs, an int8 draft over 200 tokens.
    eng = Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=draft_model(arch, draft), method=method,
                             draft_vocab=200)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True)
    assert result.token_ids == reference(arch)
    assert result.stats.new_tokens == NEW_TOKENS


@pytest.mark.parametrize("method,draft", [("draft", "same"), ("lookup", None), ("hybrid", "same"), ("none", None)])
def test_nothing_is_emitted_after_end_of_sequence(method, draft):
    ref = reference("llama")
    eos_token = ref[5]
    cut = ref.index(eos_token) + 1
    eng = engine("llama", method, draft)
    eng.eos = frozenset({eos_token})
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=8)
    assert result.token_ids == ref[:cut]  # the draft proposed past it; none of that is emitted
    assert result.finish_reason == "eos"


def test_stop_string_cuts_the_text_and_the_stream():
    full = engine("llama", "draft", "same").generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    # Random weights make mostly unprintable bytes: stop at the first two printable ASCII characters.
    at = next(i for i in range(5, len(full.text)) if full.text[i : i + 2].isascii() and full.text[i : i + 2].isprintable())
    stop = full.text[at : at + 2]
    first = full.text.find(stop)
    events = list(engine("llama", "draft", "same").stream(PROMPT, max_new_tokens=NEW_TOKENS, stop=[stop], num_draft_tokens=8))
    text = "".join(e.text for e in events)
    assert text == full.text[:first]
    assert events[-1].finish_reason == "stop"
    emitted = [e.token_id for e in events if e.token_id is not None]
    assert emitted == full.token_ids[: len(emitted)]
    # The token that completed the stop string is the last one emitted: decoding one fewer misses it.
    assert stop not in tiny_tokenizer().decode(emitted[:-1])
    assert stop in tiny_tokenizer().decode(emitted)


def test_stream_marks_draft_tokens_and_ends_with_stats():
    events = list(engine("llama", "draft", "same").stream(PROMPT, max_new_tokens=9, num_draft_tokens=4, ignore_eos=True,
                                                          adaptive=False))
    flags = [e.from_draft for e in events[:-1]]
    assert flags == [True] * 4 + [False] + [True] * 3 + [False]  # k drafted, then the target's bonus
    assert events[-1].token_id is None and events[-1].stats.new_tokens == 9


def test_chat_prompt_uses_the_template(tokenizer):
    eng = engine("llama", "lookup")
    result = eng.generate("hello", chat=True, max_new_tokens=3, ignore_eos=True)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert result.stats.prompt_tokens == len(tokenizer(templated, add_special_tokens=False)["input_ids"])
