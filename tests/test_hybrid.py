"""The hybrid proposer: lookup rounds and draft-model rounds in one generation, and still the target's output.

The prompt repeats spans, and the tiny models' greedy text falls into loops, so both kinds of round happen;
a watcher checks after every round that the draft model's cache is a prefix of the text (it falls behind
during lookup rounds and catches up on its next propose) and that observe() reached only the proposer that
made the round's draft.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from draftwise import DraftwiseError, Engine
from draftwise.bench.runners import Runners, check_methods
from draftwise.cli import _uses_draft
from draftwise.proposers import HybridProposer, PromptLookupProposer
from draftwise.proposers.hybrid import MIN_NGRAM
from draftwise.types import Draft

PROMPT = ("The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away. "
          "The quick brown fox")  # ends with a span seen before: the first round is a lookup round
NEW_TOKENS = 40
ARCHS = ["llama", "qwen2", "mistral-sliding"]


@functools.lru_cache(maxsize=None)
def model(arch, seed, layers=2):
    return tiny_model(arch, seed, layers)


def prompt_ids() -> list[int]:
    return tiny_tokenizer()(PROMPT)["input_ids"]


@functools.lru_cache(maxsize=None)
def reference(arch):
    """The target's own greedy tokens, from transformers' generate: an independent implementation."""
    out = model(arch, 0).generate(torch.tensor([prompt_ids()]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids()):].tolist()


def engine(arch, draft):
    """compact_draft=False keeps a "same" draft an exact twin of the target."""
    draft_model = {"same": model(arch, 0), "unrelated": model(arch, 1, 1)}[draft]
    return Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=draft_model, method="hybrid",
                              compact_draft=False)


@dataclass
class Round:
    who: str  # "lookup" or "draft"
    proposed: int
    accepted: int | None = None  # set by observe()
    draft_behind: int = 0  # context tokens the draft model had not cached when the round began


def watch(eng) -> list[Round]:
    """Record every round, and before each one check both caches against the text it is given."""
    hybrid = eng.proposer
    rounds: list[Round] = []
    real_propose = hybrid.propose

    def propose(context, k, stop_confidence=0.0):
        assert_caches_hold_the_text(eng, context)
        before, behind = dict(hybrid.rounds), len(context) - 1 - len(hybrid.draft._cached)
        draft = Draft(token_ids=())
        try:
            draft = real_propose(context, k, stop_confidence)
            return draft
        finally:  # a propose that raised is still a round, and still observed
            (who,) = [w for w in hybrid.rounds if hybrid.rounds[w] != before[w]]
            rounds.append(Round(who, len(draft), draft_behind=behind))

    def observer(who, real_observe):
        def observe(num_accepted):
            # Only the proposer that made the round's draft is told, once.
            assert rounds and rounds[-1].who == who and rounds[-1].accepted is None
            rounds[-1].accepted = num_accepted
            real_observe(num_accepted)
        return observe

    hybrid.propose = propose
    hybrid.lookup.observe = observer("lookup", hybrid.lookup.observe)
    hybrid.draft.observe = observer("draft", hybrid.draft.observe)
    return rounds


def assert_caches_hold_the_text(eng, text: list[int], failed: bool = False) -> None:
    draft = eng.proposer.draft
    assert eng.target.cache_len == len(text) - 1  # all but the last token, as between rounds
    # Between rounds the draft misses at least the last token, which its next propose feeds; a failed round
    # cuts it to the round's context, which is then the whole text.
    assert draft.backend.cache_len == len(draft._cached) <= len(text) - (0 if failed else 1)
    assert draft._cached == text[: len(draft._cached)]  # a prefix of the text, nothing else


def assert_draft_kv_is_the_texts(eng, arch, draft, text: list[int]) -> None:
    """Not just the right length: the draft's cached keys and values are those of the text itself."""
    proposer = eng.proposer.draft
    live = proposer.backend.forward(text[len(proposer._cached):])[-1]  # [vocab]
    draft_model = {"same": model(arch, 0), "unrelated": model(arch, 1, 1)}[draft]
    with torch.no_grad():
        fresh = draft_model(torch.tensor([text])).logits[0, -1]  # [vocab]
    assert torch.allclose(live, fresh, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["same", "unrelated"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_the_targets_own(arch, draft, k):
    eng = engine(arch, draft)
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(arch)
    assert result.stats.new_tokens == NEW_TOKENS and result.finish_reason == "length"
    text = prompt_ids() + result.token_ids
    assert_caches_hold_the_text(eng, text)
    assert_draft_kv_is_the_texts(eng, arch, draft, text)

    kinds = {r.who for r in rounds}
    assert kinds == {"lookup", "draft"}, kinds  # both kinds of round really happened
    assert rounds[0].who == "lookup"  # the prompt's tail occurred earlier in the prompt
    assert eng.proposer.rounds == {w: sum(r.who == w for r in rounds) for w in ("lookup", "draft")}
    assert all(r.accepted is not None for r in rounds)  # every round was observed
    assert all(r.proposed <= k for r in rounds)
    # The draft model fell behind during a lookup round and caught up in the next (checked before each round).
    assert any(a.who == "lookup" and b.who == "draft" and b.draft_behind > 0 for a, b in zip(rounds, rounds[1:]))
    if draft == "same":
        # A twin of the target, from a cache that caught up correctly, is always right.
        assert all(r.accepted == r.proposed for r in rounds if r.who == "draft")


@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
def test_adaptive_k_and_compact_draft_keep_the_targets_output(arch):
    eng = Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=model(arch, 1, 1), method="hybrid",
                             draft_vocab=200)
    assert eng.proposer.draft.token_ids is not None  # the compact draft applies as for "draft"
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=8, ignore_eos=True)
    assert result.token_ids == reference(arch)
    assert_caches_hold_the_text(eng, prompt_ids() + result.token_ids)
    assert {r.who for r in rounds} == {"lookup", "draft"}


@pytest.mark.parametrize("seed", range(4))
def test_sampling_rounds_keep_the_caches_a_prefix_of_the_text(seed):
    # Exactness in distribution is tested in test_sampling_e2e.py; here, the caches under sampling.
    eng = engine("llama", "unrelated")
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, temperature=1.0, seed=seed,
                          ignore_eos=True)
    assert_caches_hold_the_text(eng, prompt_ids() + result.token_ids)
    assert all(r.accepted is not None for r in rounds)


class Boom(RuntimeError):
    pass


def fail_when(monkeypatch, backend, condition):
    """Make the backend's model raise when condition() holds, after its cache already grew."""
    real_forward = backend.model.forward

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)  # the cache grows first, as a mid-pass failure would leave it
        if condition():
            raise Boom("injected")
        return out

    monkeypatch.setattr(backend.model, "forward", forward)


@pytest.mark.parametrize("where", ["verify-of-a-lookup-round", "verify-of-a-draft-round", "draft-catching-up"])
def test_an_exception_mid_round_leaves_the_caches_consistent(where, monkeypatch):
    eng = engine("llama", "unrelated")  # two model objects, so one can fail alone
    rounds = watch(eng)

    def second_round_of(who):  # the target's verify pass of that round (its propose is logged by then)
        return lambda: sum(r.who == who for r in rounds) == 2 and rounds[-1].who == who and rounds[-1].accepted is None

    if where == "verify-of-a-lookup-round":
        fail_when(monkeypatch, eng.target, second_round_of("lookup"))
    elif where == "verify-of-a-draft-round":
        fail_when(monkeypatch, eng.target, second_round_of("draft"))
    else:  # the draft's first forward after a lookup round: the one that catches up on the skipped text
        fail_when(monkeypatch, eng.proposer.draft.backend, lambda: bool(rounds) and rounds[-1].who == "lookup")
    emitted = []
    with pytest.raises(Boom):
        for event in eng.stream(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                                adaptive=False):
            emitted.append(event.token_id)
    assert emitted == reference("llama")[: len(emitted)]
    assert len(emitted) > 0  # a few rounds in
    failed = rounds[-1]
    assert failed.who == ("lookup" if where == "verify-of-a-lookup-round" else "draft")
    assert failed.accepted == 0  # observed with 0, by the proposer that made the round
    if where == "draft-catching-up":
        assert rounds[-2].who == "lookup" and failed.draft_behind > 0
    assert_caches_hold_the_text(eng, prompt_ids() + emitted, failed=True)
    monkeypatch.undo()
    # And the engine goes on from there: a new generation is unaffected.
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert result.token_ids == reference("llama")


class FakeDraft:
    """Stands in for DraftModelProposer: proposes k copies of 7 and records what it is told."""

    def __init__(self):
        self.calls = []

    def begin(self, prompt_ids, sampling, generator):
        self.calls.append("begin")

    def propose(self, context, k, stop_confidence=0.0):
        self.calls.append(("propose", k))
        return Draft(token_ids=(7,) * k)

    def observe(self, num_accepted):
        self.calls.append(("observe", num_accepted))


def test_lookup_wins_only_on_a_long_enough_match_and_observe_goes_to_who_proposed():
    draft = FakeDraft()
    hybrid = HybridProposer(draft, PromptLookupProposer(max_ngram=3, min_ngram=MIN_NGRAM))
    text = [1, 2, 3, 4, 2, 3]
    hybrid.begin(text, None, None)
    # The tail (2, 3) occurred before, but only a 3-token match counts: the draft model proposes.
    assert hybrid.propose(text, 4).token_ids == (7, 7, 7, 7)
    hybrid.observe(2)
    # The tail (4, 2, 3) occurred before: lookup proposes what followed it, up to k tokens.
    text += [5, 6, 4, 2, 3]
    assert hybrid.propose(text, 3).token_ids == (5, 6, 4)
    hybrid.observe(1)
    # A lookup guess of one token (a loop of period 1) loses to the draft model's k tokens, unless k is 1.
    text += [9, 9, 9, 9]
    assert hybrid.propose(text, 4).token_ids == (7, 7, 7, 7)
    hybrid.observe(0)
    text += [9]
    assert hybrid.propose(text, 1).token_ids == (9,)
    hybrid.observe(1)
    assert draft.calls == ["begin", ("propose", 4), ("observe", 2), ("propose", 4), ("observe", 0)]
    assert hybrid.rounds == {"lookup": 2, "draft": 2}


def test_the_hybrid_needs_a_draft_model_and_is_wired_in():
    with pytest.raises(DraftwiseError, match="method 'hybrid' needs a draft model"):
        Engine.from_models(model("llama", 0), tiny_tokenizer(), method="hybrid")
    with pytest.raises(DraftwiseError, match="method 'hybrid' needs a draft model"):
        check_methods(["hybrid"], has_draft=False)
    eng = Engine.from_models(model("llama", 0), tiny_tokenizer(), draft_model=model("llama", 1, 1), method="hybrid",
                             lookup_max_ngram=2)
    assert eng.method == "hybrid" and eng.proposer.lookup.min_ngram == 2  # at most the longest n-gram
    runners = Runners(model("llama", 0), tiny_tokenizer(), draft_model=model("llama", 1, 1))
    record, token_ids = runners.run("hybrid", prompt_ids(), 8)
    assert token_ids == reference("llama")[:8] and record["proposed"] is not None
    assert _uses_draft(argparse.Namespace(draft="d", method="hybrid"))
