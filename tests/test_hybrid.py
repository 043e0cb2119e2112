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

from conftest import input_batch, time_every_pass_alike, tiny_model, tiny_tokenizer, transformers_greedy
from draftwise import DraftwiseError, Engine
from draftwise.config import GenerationConfig
from draftwise.estimates import StepCosts, TreeSpread
from draftwise.bench.runners import Runners, check_methods
from draftwise.cli import _uses_draft
from draftwise.proposers import HybridProposer, PromptLookupProposer
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.methods import LOOKUP_CHAIN, LOOKUP_TREE
from draftwise.proposers.hybrid import MIN_NGRAM, hybrid_of
from draftwise.proposers.tree_growth import TreeSizing
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
    return transformers_greedy(model(arch, 0), prompt_ids(), NEW_TOKENS)


HYBRIDS = ["hybrid", "hybrid-tree"]  # hybrid-tree: lookup-tree and draft-tree rounds


def engine(arch, draft, method="hybrid"):
    """compact_draft=False keeps a "same" draft an exact twin of the target."""
    draft_model = {"same": model(arch, 0), "unrelated": model(arch, 1, 1)}[draft]
    return Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=draft_model, method=method,
                              compact_draft=False)


@dataclass
class Round:
    who: str  # "lookup" or "draft"
    proposed: int
    depth: int = 0  # positions its draft reaches (its length, for a chain)
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
            rounds.append(Round(who, len(draft), draft.depth, draft_behind=behind))

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
        fresh = draft_model(input_batch(text)).logits[0, -1]  # [vocab]
    assert torch.allclose(live, fresh, atol=1e-4)


@pytest.mark.parametrize("method", HYBRIDS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["same", "unrelated"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_the_targets_own(method, arch, draft, k):
    eng = engine(arch, draft, method)
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(arch)
    assert result.stats.new_tokens == NEW_TOKENS and result.finish_reason == "length"
    text = prompt_ids() + result.token_ids
    assert_caches_hold_the_text(eng, text)
    assert_draft_kv_is_the_texts(eng, arch, draft, text)

    assert eng.proposer.rounds == {w: sum(r.who == w for r in rounds) for w in ("lookup", "draft")}
    if (method, k) == ("hybrid-tree", 2):
        # The prompt's tail occurred twice before: a fixed 2 nodes of lookup-tree are the two continuations' first
        # tokens, a guess of one position, which loses to the draft model's 2. So do the loops' later matches.
        assert rounds[0].who == "draft"
    else:
        kinds = {r.who for r in rounds}
        assert kinds == {"lookup", "draft"}, kinds  # both kinds of round really happened
        assert rounds[0].who == "lookup"  # the prompt's tail occurred earlier in the prompt
        # The draft model fell behind during a lookup round and caught up in the next (checked before each round).
        assert any(a.who == "lookup" and b.who == "draft" and b.draft_behind > 0 for a, b in zip(rounds, rounds[1:]))
    assert all(r.accepted is not None for r in rounds)  # every round was observed
    assert all(r.proposed <= k for r in rounds)
    if draft == "same" and method == "hybrid":
        # A twin of the target, from a cache that caught up correctly, is always right.
        assert all(r.accepted == r.proposed for r in rounds if r.who == "draft")
    if draft == "same" and method == "hybrid-tree":
        # Its likeliest first token is the target's: kept every round (deeper, the tree may follow a sibling).
        assert all(1 <= r.accepted <= r.depth for r in rounds if r.who == "draft")
        assert k == 1 or any(r.proposed > r.depth for r in rounds if r.who == "draft")  # real trees, not chains


@pytest.mark.parametrize("method", HYBRIDS)
@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
def test_adaptive_k_and_compact_draft_keep_the_targets_output(method, arch):
    eng = Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=model(arch, 1, 1), method=method,
                             draft_vocab=200)
    assert eng.proposer.draft.token_ids is not None  # the compact draft applies as for "draft"
    time_every_pass_alike(eng, draft_step=0.02)  # priced as a real pair: on the wall clock a tiny draft may never pay
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=8, ignore_eos=True)
    assert result.token_ids == reference(arch)
    assert_caches_hold_the_text(eng, prompt_ids() + result.token_ids)
    assert {r.who for r in rounds} == {"lookup", "draft"}


@pytest.mark.parametrize("method", HYBRIDS)
@pytest.mark.parametrize("seed", range(4))
def test_sampling_rounds_keep_the_caches_a_prefix_of_the_text(method, seed):
    # Exactness in distribution is tested in test_sampling_e2e.py; here, the caches under sampling.
    eng = engine("llama", "unrelated", method)
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


class FakeDraft(Proposer):
    """Stands in for DraftModelProposer: proposes k copies of 7 and records what it is told."""

    capabilities = Capabilities(needs_draft_model=True)

    def __init__(self):
        self.calls = []

    def fork(self):
        raise AssertionError("a fake serves one sequence")

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


class FakeTreeDraft(FakeDraft):
    """A draft-tree stand-in: its sizing carries the measured costs, 0.05 s per draft forward."""

    def __init__(self):
        super().__init__()
        self.sizing = TreeSizing()
        self.sizing.forward_s = 0.05

    def keep_path(self, path):
        self.calls.append(("keep_path", tuple(path)))

    def price_with(self, costs, follow):  # as DraftTreeProposer's
        self.sizing.costs, self.sizing.sized_by_cost = costs, follow


def test_the_tree_hybrid_picks_by_measured_tokens_per_second_once_costs_are_known():
    draft = FakeTreeDraft()
    hybrid = hybrid_of(draft, LOOKUP_TREE)
    assert hybrid.lookup.sizing is draft.sizing and hybrid.min_ngram == MIN_NGRAM
    text = [1, 2, 5, 6, 1, 2]  # the tail (1, 2) occurred before, followed by (5, 6)
    hybrid.begin(text, None, None)
    # Nothing measured: by rule, a 2-token match loses to the draft model.
    assert hybrid.propose(text, 2).token_ids == (7, 7)
    hybrid.keep_path([0, 1]), hybrid.observe(2)  # both kept
    assert draft.calls[-2:] == [("keep_path", (0, 1)), ("observe", 2)]
    costs = StepCosts()
    for width in (1, 3, 5):
        costs.observe(1, width - 1, 0.0, 0.2)  # a flat pass: 0.2 s at any width
    draft.sizing.costs = costs
    # Measured: the draft's 2.35 tokens cost 0.3 s (7.8/s); lookup's 1 after a short match (at its pessimistic
    # prior, 0) cost 0.2 s (5/s).
    assert hybrid.propose(text, 2).token_ids == (7, 7)
    hybrid.observe(0)  # (the draft's acceptance falls to 0.59: 1.94 tokens, 6.5/s)
    short = hybrid.lookup.acceptance_after(2)
    for _ in range(3):
        short.observe(2, 2)  # lookup after a 2-token match turns out right: 0.79 (2.4 tokens, 12/s)
    assert hybrid.propose(text, 2).token_ids == (5, 6)
    hybrid.keep_path([]), hybrid.observe(0)
    assert draft.calls[-1] == ("observe", 0)  # neither call reached the draft model
    draft.sizing.sized_by_cost = False  # a fixed-k sequence: by rule, whatever was measured
    assert hybrid.propose(text, 2).token_ids == (7, 7)
    assert hybrid.rounds == {"lookup": 1, "draft": 3}


def test_the_tree_hybrid_learns_how_lookup_would_have_done_in_every_round():
    draft = FakeTreeDraft()
    hybrid = hybrid_of(draft, LOOKUP_TREE)
    text = [1, 2, 5, 6, 1, 2]
    hybrid.begin(text, None, None)
    assert hybrid.lookup.acceptance_after(2).rate == 0.0  # short matches start pessimistic
    assert hybrid.lookup.acceptance_after(3).rate == 0.5
    assert hybrid.propose(text, 2).token_ids == (7, 7)  # the draft model's round; lookup guessed (5, 6)
    hybrid.observe(0)
    text += [5]  # the target's own token: lookup's first guessed token, kept had it been offered
    hybrid.propose(text, 2)
    assert hybrid.lookup.acceptance_after(2).rate == pytest.approx(1 / (0.9 * 2 + 1))


def test_the_tree_hybrid_offers_lookups_free_guess_in_a_round_the_draft_model_sits_out():
    draft = FakeTreeDraft()
    hybrid = hybrid_of(draft, LOOKUP_TREE)
    text = [1, 2, 3, 5, 6, 1, 2, 3]  # the tail (1, 2, 3) occurred before, followed by (5, 6)
    hybrid.begin(text, None, None)
    assert hybrid.free_round(text, 2) == 0  # nothing measured: the engine's policy drafts the full k then
    costs = StepCosts()
    for width in (1, 3):
        costs.observe(1, width - 1, 0.0, 0.2)  # a flat pass: 0.2 s at any width
    draft.sizing.costs = costs
    for _ in range(10):
        hybrid._draft_acceptance.observe(2, 2)  # the draft model is nearly always right: 2.9 tokens in 0.3 s
    # Lookup's guess after a 3-token match (its prior, 0.5: 1.75 tokens in 0.2 s) beats a plain step (1 in 0.2 s),
    # so the round is lookup's, although the draft model would have won it were its forwards paid for.
    assert hybrid.free_round(text, 2) == 2
    assert hybrid.propose(text, 2).token_ids == (5, 6) and hybrid.drafted_free
    assert draft.calls == ["begin"]
    hybrid.observe(0)
    # Armed for one round only: the next, by measurement, goes to the draft model.
    text += [9, 1, 2, 3]
    assert hybrid.propose(text, 2).token_ids == (7, 7) and not hybrid.drafted_free
    hybrid.observe(2)
    # A guess after a 2-token match (pessimistic prior: one token in a pass) does not beat a plain step.
    text += [7, 7, 8, 4, 1, 2]
    assert hybrid.free_round(text, 2) == 0 and hybrid.propose(text, 2).token_ids == (7, 7)
    chain = hybrid_of(FakeDraft(), LOOKUP_CHAIN)  # picks by rule, and prices its free rounds by the engine's costs
    text = [1, 2, 3, 5, 6, 1, 2, 3]
    chain.begin(text, None, None)
    assert chain.free_round(text, 2) == 0  # nothing measured
    chain.price_with(costs, follow=True)
    assert chain.free_round(text, 2) == 2 and chain.propose(text, 2).token_ids == (5, 6) and chain.drafted_free
    chain.observe(0)
    assert chain.free_round(text + [9, 4, 1, 2], 2) == 0  # no match of three tokens: no guess to offer


def test_the_tree_hybrids_lookup_guesses_as_deep_as_a_free_round_whatever_the_draft_models_k():
    text = [1, 2, 3, 5, 6, 8, 9, 1, 2, 3]  # the tail (1, 2, 3) occurred before, followed by (5, 6, 8, 9)
    costs = StepCosts()
    for width in (1, 2, 5):
        costs.observe(1, width - 1, 0.0, 0.2)  # a flat pass: 0.2 s at any width

    def guess(branches, draft, depth, by_cost=True):
        hybrid = hybrid_of(draft, branches)
        hybrid.begin(text, None, None)
        hybrid.price_with(costs, follow=by_cost)
        hybrid.prepare_round(depth)  # the engine's free-round k
        return hybrid.propose(text, 1).token_ids  # the draft model's k is 1

    # Lookup's guess prices its own width (flat here) and costs no forward: it goes as deep as a free round.
    assert guess(LOOKUP_TREE, FakeTreeDraft(), 4) == (5, 6, 8, 9)
    assert guess(LOOKUP_TREE, FakeTreeDraft(), 0) == (5,)  # (nothing set: the draft model's k)
    assert guess(LOOKUP_TREE, FakeTreeDraft(), 4, by_cost=False) == (5,)  # a fixed k keeps it
    assert guess(LOOKUP_CHAIN, FakeDraft(), 4) == (5,)  # no draft forward timed: the chain picks by rule, its guess k deep
    costs.observe(1, 1, 0.05, 0.2)  # a draft forward timed: the chain's pick is measured, and its guess priced too
    assert guess(LOOKUP_CHAIN, FakeDraft(), 4) == (5, 6, 8, 9)


def test_the_chain_hybrid_picks_by_measured_tokens_per_second_once_a_draft_forward_is_timed():
    chain = hybrid_of(FakeDraft(), LOOKUP_CHAIN)
    text = [1, 2, 3, 5, 6, 1, 2, 3]  # the tail (1, 2, 3) occurred before, followed by (5, 6)
    chain.begin(text, None, None)
    costs = StepCosts()
    for width in (1, 3):
        costs.observe(1, width - 1, 0.0, 0.2)  # a flat pass: 0.2 s at any width
    chain.price_with(costs, follow=True)
    for _ in range(10):
        chain._draft_acceptance.observe(2, 2)  # the draft model is nearly always right
    # No draft forward timed yet: by rule, a three-token match is lookup's.
    assert chain.propose(text, 2).token_ids == (5, 6)
    chain.observe(0)
    costs.observe(1, 2, 0.02, 0.2)  # 0.01 s per draft forward: the draft's 2.9 tokens in 0.22 s (13/s)
    text += [9, 1, 2, 3]  # (lookup's last guess lost: after a 3-token match it is at 0.31, 1.4 tokens in 0.2 s)
    assert chain.propose(text, 2).token_ids == (7, 7)  # measured, the draft model's, although the match is long
    chain.observe(2)
    chain.price_with(costs, follow=False)  # a fixed-k sequence: by rule, whatever was measured
    assert chain.propose(text + [8, 8, 1, 2, 3], 2).token_ids == (8, 8)


def test_the_engine_lets_the_tree_hybrids_lookup_guess_deeper_than_the_draft_models_k(monkeypatch):
    eng = engine("qwen2", "unrelated", "hybrid-tree")
    monkeypatch.setattr(eng.draft_policy, "choose", lambda *args, **kw: 1)  # the draft model drafts one token a round
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert result.token_ids == reference("qwen2")
    assert max(r.depth for r in rounds if r.who == "lookup") > 1
    assert {r.depth for r in rounds if r.who == "draft"} <= {0, 1}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", HYBRIDS)
def test_the_hybrids_lookup_rounds_go_on_where_draft_forwards_do_not_pay(arch, method):
    """The engine's policy choosing no draft forwards leaves lookup's free rounds, and the output the target's."""
    eng = engine(arch, "unrelated", method)
    eng.draft_policy.choose = lambda *args, **kw: 0
    time_every_pass_alike(eng)  # lookup's width is priced by these; the wall clock would make its guesses flaky
    rounds = watch(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert result.token_ids == reference(arch)
    assert rounds and {r.who for r in rounds} == {"lookup"} and eng.proposer.rounds["draft"] == 0
    # (The chain's lookup guesses after three-token matches only, which the tiny mistral's text rarely repeats:
    # one guess there, lost, and its acceptance then prices lookup out.)
    assert result.stats.accepted > 0 or (method, arch) == ("hybrid", "mistral-sliding")
    assert_caches_hold_the_text(eng, prompt_ids() + result.token_ids)


def test_the_tree_hybrids_draft_length_follows_the_draft_models_rounds_alone():
    draft = FakeTreeDraft()
    hybrid = hybrid_of(draft, LOOKUP_TREE)
    text = [1, 2, 3, 5, 6, 1, 2, 3]  # the tail (1, 2, 3) occurred before: lookup wins by rule
    hybrid.begin(text, None, None)
    assert hybrid.propose(text, 2).token_ids == (5, 6) and hybrid.drafted_free
    hybrid.observe(0)  # a lost lookup round does not move the draft model's acceptance
    assert hybrid.drafting_acceptance.rate == 0.5
    text += [9, 9]
    assert hybrid.propose(text, 2).token_ids == (7, 7) and not hybrid.drafted_free
    hybrid.observe(2)
    assert hybrid.drafting_acceptance.rate == pytest.approx((0.9 + 2) / (1.8 + 2))
    chain = hybrid_of(FakeDraft(), LOOKUP_CHAIN)  # picks by rule; its k follows its draft-model rounds too
    chain.begin(text[:8], None, None)
    assert chain.propose(text[:8], 2).token_ids == (5, 6) and chain.drafted_free  # no draft forward
    chain.observe(0)
    assert chain.drafting_acceptance.rate == 0.5
    assert chain.propose([8, 9, 10], 2).token_ids == (7, 7) and not chain.drafted_free
    chain.observe(2)
    assert chain.drafting_acceptance.rate == pytest.approx((0.9 + 2) / (1.8 + 2))


@pytest.mark.parametrize("method", HYBRIDS)
def test_the_engine_prices_draft_forwards_by_the_hybrids_draft_model_rounds_alone(method):
    eng = engine("llama", "unrelated", method)
    time_every_pass_alike(eng, draft_step=0.02)  # on the wall clock lookup may win every round on a busy machine
    hybrid, costs, seen = eng.proposer, eng.draft_policy.costs, []
    real_observe = costs.observe

    def observe(rows, k, draft_s, verify_s, draft_steps=None):
        seen.append((hybrid.lookup_round, draft_steps))
        real_observe(rows, k, draft_s, verify_s, draft_steps)

    costs.observe = observe
    rates = []
    real_choose = eng.draft_policy.choose
    eng.draft_policy.choose = lambda r, *args, **kw: rates.append(r) or real_choose(r, *args, **kw)
    eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert {lookup for lookup, _ in seen} == {True, False}  # both kinds of round ran
    assert all(steps == 0 for lookup, steps in seen if lookup)  # a lookup round ran no draft forward
    assert any(steps > 0 for lookup, steps in seen if not lookup)
    assert rates[-1] == [hybrid.drafting_acceptance.rate]  # the policy reads the draft model's acceptance


@pytest.mark.parametrize("method", HYBRIDS)
def test_the_hybrids_tree_spread_follows_its_draft_model_rounds_alone(method, monkeypatch):
    """The draft length prices the draft model's rounds: lookup's trees (whole continuations side by side) must not
    widen the pass it is priced by."""
    eng = engine("llama", "unrelated", method)
    time_every_pass_alike(eng, draft_step=0.02)  # on the wall clock lookup may win every round on a busy machine
    hybrid, spread_rounds, rounds = eng.proposer, [], []
    real_spread, real_costs = TreeSpread.observe, eng.draft_policy.costs.observe

    def observe(self, nodes, depth):
        spread_rounds.append(hybrid.lookup_round)
        real_spread(self, nodes, depth)

    monkeypatch.setattr(TreeSpread, "observe", observe)
    eng.draft_policy.costs.observe = lambda *args, **kw: rounds.append(hybrid.lookup_round) or real_costs(*args, **kw)
    eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert True in rounds and False in rounds  # both kinds of round ran
    assert spread_rounds and not any(spread_rounds)  # only the draft model's were measured


@pytest.mark.parametrize("method", HYBRIDS)
def test_the_hybrid_needs_a_draft_model_and_is_wired_in(method):
    with pytest.raises(DraftwiseError, match=f"method '{method}' needs a draft model"):
        Engine.from_models(model("llama", 0), tiny_tokenizer(), method=method)
    with pytest.raises(DraftwiseError, match=f"method '{method}' needs a draft model"):
        check_methods([method], has_draft=False)
    eng = Engine.from_models(model("llama", 0), tiny_tokenizer(), draft_model=model("llama", 1, 1), method=method,
                             lookup_max_ngram=2)
    assert eng.method == method and eng.proposer.min_ngram == 2  # at most the longest n-gram
    tree = method == "hybrid-tree"
    assert eng.proposer.lookup.branches == (3 if tree else 1)
    assert (eng.proposer.sizing is not None) == tree and eng.proposer.capabilities.takes_rows == tree
    if tree:  # one sizing, so the engine's costs reach the lookup rounds too
        assert eng.proposer.lookup.sizing is eng.proposer.sizing is eng.proposer.draft.sizing
    runners = Runners(model("llama", 0), tiny_tokenizer(), draft_model=model("llama", 1, 1))
    record, token_ids = runners.run(method, prompt_ids(), 8)
    assert token_ids == reference("llama")[:8] and record["proposed"] is not None
    assert _uses_draft(argparse.Namespace(draft="d", method=method))
    # A sequence of the other hybrid on this engine gets that hybrid's parts, on the same draft model.
    other = eng.sequences._new_proposer(HYBRIDS[1 - HYBRIDS.index(method)])
    assert other.lookup.branches == (1 if tree else 3) and (other.sizing is not None) == (not tree)
    other.release()


def test_a_new_sequence_inherits_no_round_the_last_one_left_unfinished():
    costs = StepCosts()
    for width in (1, 3):
        costs.observe(1, width - 1, 0.0, 0.2)  # a flat pass: lookup's guess after a 3-token match beats a plain step
    chain = hybrid_of(FakeDraft(), LOOKUP_CHAIN)
    text = [1, 2, 3, 5, 6, 1, 2, 3]
    chain.begin(text, None, None)
    chain.price_with(costs, follow=True)
    assert chain.free_round(text, 2) == 2  # armed for the next propose, which never comes: the step raised
    chain.begin([8, 9, 10], None, None)  # the engine's proposer, reused for the next sequence
    assert chain.propose([8, 9, 10], 2).token_ids == (7, 7) and not chain.drafted_free


def test_the_chain_hybrids_lookup_sizes_its_guess_by_the_engines_costs():
    """Offered as deep as it pays, lookup's guess is judged against the draft model at its best depth's rate."""
    tokenizer = tiny_tokenizer()
    eng = Engine.from_models(tiny_model("llama", 0), tokenizer, draft_model=tiny_model("llama", 0), method="hybrid")
    ids = tokenizer.encode("one two three four five one two three four five one two three")
    seq = eng.open_sequence(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert seq.proposer.lookup.costs is eng.draft_policy.costs
    for width in (1, 5):
        eng.draft_policy.costs.observe(1, width - 1, 0.0, 0.15 + 0.05 * width)  # 0.05 s more per token of width
    # After a 3-token match, at its prior (0.5): one token pays best (1.5 tokens in 0.25 s; two: 1.75 in 0.3 s).
    assert seq.proposer.lookup.propose(seq.context, 4).depth == 1
    eng.close_sequence(seq)
    fixed = eng.open_sequence(ids, GenerationConfig.from_options(max_new_tokens=8, temperature=1.0, adaptive=False))
    assert fixed.proposer.lookup.costs is None  # a fixed k: its full k, whatever was timed
    assert fixed.proposer.lookup.propose(fixed.context, 4).depth == 4
    eng.close_sequence(fixed)


def test_the_chain_hybrids_pick_is_priced_in_the_rows_of_its_step():
    """A lookup guess that wins a round alone can lose in a batch, whose every row's pass it widens: the pick and the
    guess are priced in the step's rows (prepare_round), as the engine's free rounds are."""
    text = [1, 2, 3, 5, 6, 1, 2, 3]  # the tail (1, 2, 3) occurred before, followed by (5, 6)
    costs = StepCosts()
    for _ in range(3):
        for width, four_rows_s in ((1, 0.2), (2, 0.3), (3, 0.6)):
            costs.observe(1, width - 1, 0.02 * (width - 1), 0.2)  # one row: a flat pass, 0.02 s a draft forward
            costs.observe(4, width - 1, 0.02 * (width - 1), four_rows_s)  # four: each position of width dearer

    def pick(rows):
        chain = hybrid_of(FakeDraft(), LOOKUP_CHAIN)
        chain.begin(text, None, None)
        chain.price_with(costs, follow=True)
        chain.prepare_round(2, rows)
        return chain.propose(text, 2).token_ids

    assert pick(1) == (5, 6)  # alone, lookup's free guess beats the draft model's forwards
    assert pick(4) == (7, 7)  # beside three rows, its two nodes' width costs more than the draft's two forwards
