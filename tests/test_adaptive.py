"""The draft-length controller (which k pays) and the compact draft (int8, fewer output tokens).

Exactness of both through the engine is covered where every proposer is: test_greedy_identity.py and
test_sampling_e2e.py run with adaptive k on (the default) and a compact draft; here, the decisions and the
compact model's own behaviour.
"""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from conftest import cpu_kernels, time_every_pass_alike, tiny_model, tiny_tokenizer

from draftwise.adaptive import MAX_PROBE_GAP, PROBE_BUDGET, PROBE_EVERY, DraftLengthPolicy, probe_floor
from draftwise.estimates import PRIOR_ACCEPTED, PRIOR_TRIALS, STALE_STEPS, Acceptance, StepCosts, TreeSpread
from draftwise import planner
from draftwise.planner import Offer, chain_tokens
from draftwise.config import GenerationConfig
from draftwise.acceptance_pools import drafting_acceptance as _drafting_acceptance
from draftwise.catch_up import ROUND_FEED
from draftwise.draft_lengths import MAX_DRAFT_LAG
from draftwise.engine import Engine
from draftwise.serve.scheduler import Scheduler
from draftwise.backends.kernels import DYNAMIC_MAX_ROWS, Int8DynamicLinear, Int8Linear
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.proposers.compact import compact_draft
from draftwise.methods import LOOKUP_TREE
from draftwise.proposers.hybrid import MIN_NGRAM, hybrid_of
from draftwise.proposers.prompt_lookup import SHORT_MATCH_PRIOR, lookup_estimate
from draftwise.proposers.tree_growth import TreeSizing


def _feed(policy, acceptance, rounds, k, accepted, draft_s, verify_s, rows=1):
    """rounds steps of `rows` rows drafting k, each row keeping `accepted`, at the given costs."""
    for _ in range(rounds):
        acceptance.observe(k, accepted)
        policy.costs.observe(rows, k, draft_s * k, verify_s)


def test_expected_tokens_is_leviathans():
    assert chain_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert chain_tokens(1.0, 4) == 5


def test_tries_the_full_width_before_anything_is_measured():
    assert DraftLengthPolicy().choose([0.5], k_max=6, rows=1) == 6


def test_always_accepted_with_flat_verification_drafts_the_most():
    policy, acc = DraftLengthPolicy(), Acceptance()
    _feed(policy, acc, 20, 8, 8, draft_s=0.01, verify_s=0.2)
    policy.costs.observe(1, 0, 0.0, 0.2)
    assert acc.rate > 0.95
    assert policy.choose([acc.rate], k_max=8, rows=1) == 8


def _never_paying(policy, acceptance):
    """Lookup in float32: free guesses, but a wide verification costs two plain steps and nothing is kept; a
    probe's 2-wide pass a little dearer than a plain step, so that a probe is priced to lose little."""
    _feed(policy, acceptance, 10, 4, 0, draft_s=0.0, verify_s=0.9)
    policy.costs.observe(1, 0, 0.0, 0.45)
    policy.costs.observe(1, 1, 0.0, 0.48)


def test_never_accepted_backs_off_to_plain_steps_but_probes():
    policy, acc = DraftLengthPolicy(), Acceptance()
    _never_paying(policy, acc)
    choices = [policy.choose([acc.rate], k_max=4, rows=1) for _ in range(2 * PROBE_EVERY)]
    assert choices.count(0) == 2 * PROBE_EVERY - 1 and choices[PROBE_EVERY - 1] == 1


def test_probes_grow_apart_while_drafting_keeps_not_paying_and_close_up_when_it_wins():
    policy, acc = DraftLengthPolicy(), Acceptance()
    _never_paying(policy, acc)
    steps = 8 * MAX_PROBE_GAP
    probes = [i + 1 for i in range(steps) if policy.choose([acc.rate], k_max=4, rows=1) == 1]  # 1-based steps
    gaps = [b - a for a, b in zip([0, *probes], probes)]
    assert gaps[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    assert max(gaps) == MAX_PROBE_GAP and gaps[-1] == MAX_PROBE_GAP
    # A probe that finds the text turned copyable: drafting wins, and once it stops winning, probes start close again.
    _feed(policy, acc, 10, 4, 4, draft_s=0.0, verify_s=0.2)
    assert policy.choose([acc.rate], k_max=4, rows=1) > 0
    _feed(policy, acc, 60, 4, 0, draft_s=0.0, verify_s=0.9)
    policy.costs.observe(1, 0, 0.0, 0.45)
    policy.costs.observe(1, 1, 0.0, 0.48)
    choices = [policy.choose([acc.rate], k_max=4, rows=1) for _ in range(PROBE_EVERY)]
    assert choices == [0] * (PROBE_EVERY - 1) + [1]


def test_probes_priced_dear_come_no_closer_than_their_budget_allows_even_after_a_join():
    """A probe in a batch costs nearly a step of its own (a skip draft's forward at 4 rows, 50 ms beside 58-ms steps):
    probes 8 steps after each join would cost a few percent of the throughput. They come no closer than the steps
    over which the probe's priced loss is PROBE_BUDGET of their time."""
    policy, acc = DraftLengthPolicy(), Acceptance()
    _feed(policy, acc, 10, 4, 0, draft_s=0.0, verify_s=0.9)
    policy.costs.observe(1, 0, 0.0, 0.45)  # a probe's 2-wide pass priced on the chord: 0.56 s, 0.2 steps lost
    rate, plain, probe = acc.rate, policy.rate([acc.rate], 0, 1), policy.rate([acc.rate], 1, 1)
    floor = probe_floor(1 + rate, 1, plain, probe)
    assert floor == math.ceil((1 + rate) * (plain / probe - 1) / PROBE_BUDGET) and PROBE_EVERY < floor < MAX_PROBE_GAP
    for _ in range(3):  # a sequence joins after each probe: the gap is closed again, but only to the floor
        policy.sequence_joined()
        choices = [policy.choose([acc.rate], k_max=4, rows=1) for _ in range(floor)]
        assert choices == [0] * (floor - 1) + [1]


def test_a_probe_floor_is_its_loss_over_the_budget_from_probe_every_to_the_widest_gap():
    assert probe_floor(1.0, 1, 10.0, 10.0) == PROBE_EVERY  # a probe priced to break even
    assert probe_floor(1.5, 1, 10.0, 12.0) == PROBE_EVERY  # or to pay
    # 4 rows, a probe's 4 + 4 * 0.5 tokens at 60 tokens/s against plain steps' 69: 0.225 of a step lost, 1% of 23.
    assert probe_floor(6.0, 4, 69.0, 60.0) == 23 == math.ceil(1.5 * (69 / 60 - 1) / PROBE_BUDGET)
    assert probe_floor(1.0, 1, 10.0, 1.0) == MAX_PROBE_GAP


def test_a_sequence_that_joins_is_probed_soon_though_its_predecessor_backed_probes_off():
    # c = 0.5 and a flat pass: under the prior (a = 0.5) drafting does not pay, at a = 0.68 it does.
    policy, earlier = DraftLengthPolicy(), Acceptance()
    for k in range(5):
        policy.costs.observe(1, k, 0.05 * k, 0.1 + 0.005 * k)
    for _ in range(8 * MAX_PROBE_GAP):  # a text the draft never gets right: probes back off to the widest gap
        if policy.choose([earlier.rate], k_max=4, rows=1):
            earlier.observe(1, 0)
    assert policy._probe_gap == MAX_PROBE_GAP
    joined = Acceptance()
    assert policy.choose([joined.rate], k_max=4, rows=1) == 0
    policy.sequence_joined()
    steps_to_probe = next(i for i in range(1, MAX_PROBE_GAP) if policy.choose([joined.rate], k_max=4, rows=1))
    assert steps_to_probe <= PROBE_EVERY
    joined.observe(1, 1)  # the draft gets this text right: one kept probe is enough to turn drafting on
    assert policy.choose([joined.rate], k_max=4, rows=1) > 0 and policy.wants_drafting


def test_the_engine_tells_the_policy_when_an_adaptive_sequence_joins():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    eng.draft_policy._probe_gap = MAX_PROBE_GAP
    seq = eng.open_sequence(tokenizer.encode("one two"), GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert eng.draft_policy._probe_gap == PROBE_EVERY
    eng.close_sequence(seq)


def test_a_prior_carried_from_earlier_sequences_outlasts_one_bad_first_round_but_not_two():
    """The 0.5B draft's shape on a CPU without BF16: a draft forward 0.17 of a step, a 2-wide pass 1.26 steps.
    Under the default prior one round that keeps nothing turns drafting off; from a carried 0.65 it takes two."""
    policy = DraftLengthPolicy()
    for k, verify_s in enumerate((0.100, 0.126, 0.135, 0.145, 0.155)):
        policy.costs.observe(1, k, 0.017 * k, verify_s)
    fresh, carried = Acceptance(), Acceptance()
    carried.start_from(0.65)
    assert carried.rate == pytest.approx(0.65) and carried.observed_rate is None
    assert policy.choose([fresh.rate], k_max=4, rows=1) > 0 and policy.choose([carried.rate], k_max=4, rows=1) > 0
    for acc in (fresh, carried):
        acc.observe(2, 0)
    assert policy.choose([fresh.rate], k_max=4, rows=1) == 0
    assert policy.choose([carried.rate], k_max=4, rows=1) > 0
    carried.observe(1, 0)
    assert policy.choose([carried.rate], k_max=4, rows=1) == 0
    for rate in (None, 0.3):  # nothing carried, or less than the default: the default prior
        fresh = Acceptance()
        fresh.start_from(rate)
        assert fresh.rate == PRIOR_ACCEPTED / PRIOR_TRIALS and fresh.observed_rate is None
    pessimistic = Acceptance(0.0, 2.0)  # (a hybrid's lookup after a short match): any rate above its own prior
    pessimistic.start_from(0.3)
    assert pessimistic.rate == pytest.approx(0.3)


def test_what_a_sequence_carries_is_its_rate_over_every_round_not_the_decayed_one_it_ended_on():
    acc = Acceptance()
    acc.observe(4, 4)
    for _ in range(3):  # then rounds that keep nothing, as turn drafting off
        acc.observe(2, 0)
    assert acc.observed_rate == pytest.approx(4 / 7) and acc.rate < 0.52


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_sequence_starts_from_the_acceptance_its_kind_ended_on_in_this_engine(method):
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), method=method)
    prompt = "The quick brown fox jumps over the lazy dog."
    seq = eng.open_sequence(tokenizer.encode(prompt), GenerationConfig(max_new_tokens=16, ignore_eos=True))
    assert _drafting_acceptance(seq).rate == PRIOR_ACCEPTED / PRIOR_TRIALS  # the engine's first: the default
    eng.close_sequence(seq)
    assert eng.recent_acceptance(method, True) is None  # it drafted nothing: no evidence to carry
    eng.generate(prompt, max_new_tokens=24, ignore_eos=True)  # the draft is the target: every token is kept
    ended = eng.recent_acceptance(method, True)
    # Every token kept, carried from the default prior as a sequence's own estimate: above it, short of certainty.
    assert PRIOR_ACCEPTED / PRIOR_TRIALS < ended < 1.0
    seq = eng.open_sequence(tokenizer.encode("Another prompt"), GenerationConfig(max_new_tokens=16, ignore_eos=True))
    assert _drafting_acceptance(seq).rate == pytest.approx(ended)
    eng.close_sequence(seq)
    # Sampled sequences keep fewer draft tokens than greedy ones: they carry their own, from the default.
    sampled = GenerationConfig.from_options(max_new_tokens=16, ignore_eos=True, temperature=1.0)
    seq = eng.open_sequence(tokenizer.encode(prompt), sampled)
    assert _drafting_acceptance(seq).rate == PRIOR_ACCEPTED / PRIOR_TRIALS
    eng.close_sequence(seq)
    # A sampled sequence drafting a fixed k has no acceptance to carry; the greedy rate is untouched.
    eng.generate(prompt, max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=3, adaptive=False)
    assert eng.recent_acceptance(method, False) is None and eng.recent_acceptance(method, True) == ended


@pytest.mark.parametrize("method", ["hybrid", "hybrid-tree"])
def test_a_hybrids_lookup_starts_from_what_lookup_kept_after_each_match_length_in_earlier_sequences(method):
    """Carried for the draft model alone, a hybrid's first rounds went to it where lookup, at its default, would
    have won them: lookup's estimates, one per match length, are carried too."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), method=method)
    time_every_pass_alike(eng, draft_step=0.02)  # priced as a real pair, so that both kinds of round run anywhere
    prompt = "one two three four one two three four one two three four one two three"
    eng.generate(prompt, max_new_tokens=24, ignore_eos=True)
    names = [name for name, estimate in eng.proposer.acceptances().items() if estimate.observed_rate is not None]
    lookup = {int(name.rsplit(" ", 1)[1]): eng.recent_acceptance(method, True, name)
              for name in names if name.startswith("lookup")}
    assert lookup and set(names) == {"draft", *(lookup_estimate(match) for match in lookup)}
    seq = eng.open_sequence(tokenizer.encode("Another prompt"), GenerationConfig(max_new_tokens=8, ignore_eos=True))
    for match, carried in lookup.items():
        made_with = Acceptance(*SHORT_MATCH_PRIOR) if match < MIN_NGRAM else Acceptance()
        assert seq.proposer.lookup.acceptance_after(match).rate == pytest.approx(max(carried, made_with.rate))
    assert _drafting_acceptance(seq).rate == pytest.approx(eng.recent_acceptance(method, True))
    eng.close_sequence(seq)
    # Known pools: each estimate starts from its own, where that is above the prior it is made with.
    pools = eng.pools.carried[(method, True)] = {}
    for name, (kept, rejections) in {"draft": (7, 3), lookup_estimate(3): (9, 1), lookup_estimate(1): (3, 7),
                                     lookup_estimate(2): (0, 1)}.items():
        pools[name] = Acceptance(0.0, 0.0)
        pools[name].fold(kept, rejections)
    seq = eng.open_sequence(tokenizer.encode("Another prompt"), GenerationConfig(max_new_tokens=8, ignore_eos=True))
    starts = {match: seq.proposer.lookup.acceptance_after(match).rate for match in (1, 2, 3, 4)}
    assert _drafting_acceptance(seq).rate == pytest.approx(0.7)
    assert starts == pytest.approx({1: 0.3, 2: 0.0, 3: 0.9, 4: 0.5})  # (2: none above its pessimistic prior)
    eng.close_sequence(seq)
    # A sequence drafting a fixed k starts from nothing carried, and follows no timings.
    seq = eng.open_sequence(tokenizer.encode("Another prompt"),
                            GenerationConfig.from_options(max_new_tokens=8, temperature=1.0, adaptive=False))
    assert seq.proposer.costs is None and seq.proposer.lookup.acceptance_after(3).rate == 0.5
    eng.close_sequence(seq)


def test_a_sequence_drafting_a_fixed_k_fills_its_lagging_draft_whatever_the_policy_last_chose():
    """A hybrid's lookup rounds leave its draft model behind the text; a fixed-k sequence must catch it up on the
    text alone, or its rounds would follow earlier requests' timings."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), method="hybrid")
    for fixed_k in (GenerationConfig(max_new_tokens=8, adaptive=False),
                    GenerationConfig.from_options(max_new_tokens=8, temperature=1.0, adaptive=False)):
        seq = eng.open_sequence(tokenizer.encode("one two three"), fixed_k)
        while not seq.prefill_done:
            eng.prefill(seq)
        seq.context += [5] * (MAX_DRAFT_LAG + 1)  # as lookup rounds that kept every token would leave it
        for wanted in (True, False):  # what the last adaptive sequence's policy chose
            eng.draft_policy.wants_drafting = wanted
            for alone in (True, False):
                seq.fills_before_probes = alone
                assert eng.wants_catch_up(seq)
        eng.catch_up_draft(seq)
        seq.fills_before_probes = True
        assert not eng.wants_catch_up(seq)
        eng.close_sequence(seq)


def test_expensive_draft_with_middling_acceptance_drafts_few():
    # c = 0.5 and a = 0.5: one token pays (1.5 / 1.5 = 1 step per token) no better than none; wider is worse.
    policy, acc = DraftLengthPolicy(), Acceptance()
    for k in range(0, 9):
        acc.observe(k, k // 2)
        policy.costs.observe(1, k, 0.1 * k, 0.2)
    assert policy.choose([acc.rate], k_max=8, rows=1) <= 2


def test_a_width_last_timed_in_a_slow_spell_is_tried_again_once_its_time_is_stale():
    """A width timed while another process shared the cores looks dear; not chosen, it would never be timed again."""
    policy = DraftLengthPolicy()
    policy.costs.observe(1, 0, 0.0, 0.25)  # a plain step
    for _ in range(5):  # a slow spell: passes 2 and 9 wide both cost twice their time
        policy.costs.observe(1, 8, 0.08, 0.8), policy.costs.observe(1, 1, 0.01, 0.6)
    for _ in range(STALE_STEPS // 2):  # the spell is over; only narrow passes run
        policy.costs.observe(1, 1, 0.01, 0.3)
    # k = 8 as priced in the spell: 4.33 tokens in 0.88 s (4.9/s), less than narrower ks (k = 1: 1.8 in 0.31 s).
    assert policy.choose([0.8], k_max=8, rows=1) < 8 and policy.costs.verify(1, 9) == pytest.approx(0.8)
    for _ in range(STALE_STEPS // 2):
        policy.costs.observe(1, 1, 0.01, 0.3)
    assert policy.choose([0.8], k_max=8, rows=1) == 0  # (the plain step's time is stale too: timed again first)
    policy.costs.observe(1, 0, 0.0, 0.25)
    # Width 9's time is stale now: priced at most as the fresh widths imply (past the widest, on their chord: 0.65 s,
    # not the spell's 0.8), so deeper drafts are tried again; each timed at its true cost (0.3 s at width 2 to 0.4 at
    # width 9), the fresh line follows them, and width 9's price with it.
    assert policy.costs.verify(1, 9) == pytest.approx(0.25 + 8 * 0.05, rel=0.01)

    def true_pass(width):
        return 0.3 + (width - 2) * 0.1 / 7

    chosen = []
    for _ in range(3):
        chosen.append(policy.choose([0.8], k_max=8, rows=1))
        policy.costs.observe(1, chosen[-1], 0.01 * chosen[-1], true_pass(chosen[-1] + 1))
    assert min(chosen) >= 3 and policy.costs.verify(1, 9) == pytest.approx(true_pass(9), rel=0.1)


def test_a_width_whose_stale_time_is_confirmed_stays_fresh_longer():
    """A wide pass that costs what it did when its time went stale is not run again every STALE_STEPS steps (priced
    as the fresh plain steps imply, it looks cheap once stale): each retry costs what it was known to."""
    costs = StepCosts()

    def plain_steps(n):
        for _ in range(n):
            costs.observe(4, 0, 0.0, 0.06)

    costs.observe(4, 4, 0.0, 0.185)  # 4 rows, 5 wide
    plain_steps(STALE_STEPS)
    assert not costs.fresh(4, 5)
    costs.observe(4, 4, 0.0, 0.18)  # retried: as dear as it was
    plain_steps(STALE_STEPS)
    assert costs.fresh(4, 5)  # confirmed: fresh twice as long
    plain_steps(STALE_STEPS)
    assert not costs.fresh(4, 5)
    costs.observe(4, 4, 0.0, 0.09)  # retried: half what it was (the old time was a slow spell's)
    assert costs.verify(4, 5) == pytest.approx(0.09)  # (replaced, not averaged)
    plain_steps(STALE_STEPS)
    assert not costs.fresh(4, 5)  # not confirmed: stale again after STALE_STEPS


def test_a_plain_step_timed_in_a_slow_spell_is_timed_again_once_stale_though_drafting_wins():
    """While drafting wins no plain step runs: a plain step first timed dear would keep drafting chosen where it
    loses, since no fresher, wider pass bounds its price from above."""
    policy = DraftLengthPolicy()
    policy.costs.observe(4, 0, 0.0, 0.071)  # the plain step, timed beside a newcomer's prefill
    for k, verify_s in enumerate((0.085, 0.115, 0.145, 0.185), start=1):
        policy.costs.observe(4, k, 0.025 * k, verify_s)
    rates = [0.85] * 4
    assert policy.choose(rates, 4, 4) == 1  # 7.4 tokens in 0.11 s against 4 in 0.071 s
    passes = (0.085, 0.115, 0.145, 0.185)
    while policy.costs.fresh(4, 1):  # drafting goes on winning; the plain step is not run again
        assert policy.choose(rates, 4, 4) == 1
        for k, verify_s in enumerate(passes, start=1):
            policy.costs.observe(4, k, 0.025 * k, verify_s)
    assert policy.costs.steps >= STALE_STEPS
    assert policy.choose(rates, 4, 4) == 0  # stale: timed again
    policy.costs.observe(4, 0, 0.0, 0.055)  # its true time replaces the spell's
    assert policy.costs.verify(4, 1) == pytest.approx(0.055) and policy.choose(rates, 4, 4) == 0  # plain wins now
    assert policy.wants_drafting is False


class FakeTreeDraft(Proposer):
    """Stands in for a draft-tree proposer: its sizing is all the hybrid's pick reads of it."""

    capabilities = Capabilities(needs_draft_model=True, drafts_trees=True)

    def __init__(self, sizing):
        self.sizing = sizing

    def begin(self, prompt_ids, sampling, generator):
        raise AssertionError("never drafts")

    propose = observe = fork = begin


def test_a_draft_forward_timed_in_a_slow_spell_is_not_trusted_once_stale():
    """A tree proposer's forward and expansion times, and the engine's draft step, go stale as pass widths do: a
    hybrid whose draft model looked slow would give every round to lookup and never time that model again."""
    costs, sizing = StepCosts(), TreeSizing()
    sizing.costs = costs
    costs.observe(1, 2, 0.6, 0.8)  # a slow spell: a draft forward of 0.3 s, a pass of 0.8 s
    sizing.time_forwards(0.6, 2), sizing.time_expansion(1, 0.3), sizing.time_expansion(4, 0.4)
    hybrid = hybrid_of(FakeTreeDraft(sizing), LOOKUP_TREE)
    assert sizing.forward_s == pytest.approx(0.3) and hybrid._measured() is not None
    for _ in range(STALE_STEPS - 1):  # plain steps (lookup's rounds), no draft forward
        costs.observe(1, 0, 0.0, 0.2)
    assert sizing.forward_s == pytest.approx(0.3) and sizing.expansion_cost(4) == pytest.approx(0.4)
    costs.observe(1, 0, 0.0, 0.2)
    # Stale: the hybrid picks by rule, so its draft model gets rounds again; the draft step is still what was
    # timed, until it is timed again.
    assert sizing.forward_s is None and hybrid._measured() is None and costs.draft(1) == pytest.approx(0.3)
    sizing.time_expansion(1, 0.05)  # replaces the spell's 0.3; a 4-node expansion, left from the spell, is priced
    assert sizing.expansion_cost(4) == pytest.approx(0.05)  # at most as the fresh 1-node one
    sizing.time_forwards(0.1, 2), costs.observe(1, 2, 0.1, 0.25)
    # Timed again, replaced rather than averaged with the spell's times.
    assert sizing.forward_s == pytest.approx(0.05) and costs.draft(1) == pytest.approx(0.05)


def test_a_stale_round_of_draft_forwards_is_priced_in_proportion_to_the_fresh_one_not_as_it():
    """While drafting does not pay, only probes draft, one forward each: a round of 4 forwards goes stale, and priced
    as the fresh 1-forward round it was chosen at a quarter of its cost (`hybrid-skip`, 2 to 4 rows)."""
    costs = StepCosts()
    costs.observe(2, 4, 0.2, 0.12)  # 4 forwards of a skipping target: 0.05 s each
    for step in range(STALE_STEPS):
        costs.observe(2, 1, 0.05, 0.08) if step % 8 == 0 else costs.observe(2, 0, 0.0, 0.07)
    assert costs.draft_round(2, 4) == pytest.approx(0.2)
    assert costs.draft_round(2, 3) == pytest.approx(0.15)  # (never timed: on the line, as before)
    costs.observe(2, 4, 0.08, 0.12)  # a round of 4 timed again, cheaper: it replaces the old price
    assert costs.draft_round(2, 4) == pytest.approx(0.08)


def test_stop_confidence_is_the_cost_ratio_capped():
    policy, acc = DraftLengthPolicy(), Acceptance()
    assert policy.stop_confidence(rows=1) == 0.0
    _feed(policy, acc, 5, 1, 1, draft_s=0.05, verify_s=0.2)
    assert policy.stop_confidence(rows=1) == pytest.approx(0.25, rel=0.05)
    _feed(policy, acc, 50, 1, 1, draft_s=0.5, verify_s=0.2)
    assert policy.stop_confidence(rows=1) == 0.5


def _memory_then_compute_bound(policy):
    """Injected costs of this CPU's shape: a pass costs 0.25 s plus 0.04 s per token past the first (so one
    row is nearly free to add and a wide pass of many rows is dear); a draft forward 0.08 s plus 0.02 per row."""
    for rows in (1, 4, 8):
        for k in range(5):
            policy.costs.observe(rows, k, (0.08 + 0.02 * rows) * k, 0.25 + 0.04 * (rows * (k + 1) - 1))


def test_a_full_batch_turns_speculation_off_and_it_comes_back_as_load_falls():
    policy = DraftLengthPolicy()
    _memory_then_compute_bound(policy)
    # Alone, a 0.7 draft pays: k = 1 gives 1.7 tokens per 0.39 s against 1 per 0.25 s.
    assert policy.choose([0.7], k_max=4, rows=1) == 1
    # Eight at once: a plain step gives 8 tokens per 0.53 s; any drafting costs more than it brings.
    assert policy.choose([0.7] * 8, k_max=4, rows=8) == 0
    # Load falls again: speculation is back.
    assert policy.choose([0.7], k_max=4, rows=1) == 1


def test_rows_of_unmeasured_batch_sizes_use_the_nearest_measured():
    policy = DraftLengthPolicy()
    _memory_then_compute_bound(policy)
    assert policy.costs.verify(6, 1) == policy.costs.verify(4, 1)
    assert policy.costs.verify(7, 1) == policy.costs.verify(8, 1)
    assert policy.choose([0.7] * 7, k_max=4, rows=7) == 0


def test_a_new_batch_size_prices_wide_passes_as_its_neighbours_do():
    # Four and eight rows were measured at every width (a wide pass is dear there); seven rows only at a plain step,
    # as when a request leaves a full batch. Seven rows' wide passes cost its plain step times their neighbours'
    # ratio, interpolated by rows, not its plain step alone (which would make every width look free and fill every
    # draft to try one). (Its plain step a slow one's, so that the price is the ratio's, not a bound by positions.)
    policy = DraftLengthPolicy()
    _memory_then_compute_bound(policy)
    policy.costs.observe(7, 0, 0.0, 0.6)
    ratio = {rows: policy.costs.verify(rows, 5) / policy.costs.verify(rows, 1) for rows in (4, 8)}
    assert ratio[4] < ratio[8]
    assert policy.costs.verify(7, 5) == pytest.approx(0.6 * (ratio[4] / 4 + ratio[8] * 3 / 4))
    assert policy.costs.verify(9, 5) == pytest.approx(policy.costs.verify(9, 1) * ratio[8])  # past the last: its own
    assert policy.choose([0.7] * 7, k_max=4, rows=7) == 0 and not policy.wants_drafting


def test_a_pass_wider_than_any_measured_is_priced_on_the_chord_and_a_tree_does_not_outgrow_its_cost():
    # Two rows on the quant backend (an Intel Xeon): passes 1 to 5 wide measured; a 25-node tree priced as the 5-wide
    # pass looked nearly free to widen, was offered, and ran 521 ms for 2 tokens.
    costs = StepCosts()
    for _ in range(4):
        for width, seconds in enumerate((0.058, 0.0698, 0.0829, 0.0946, 0.1317), start=1):
            costs.observe(2, width - 1, 0.0, seconds)
    slope = (0.1317 - 0.058) / 4
    assert costs.verify(2, 4) == pytest.approx(0.0946)  # (measured)
    assert costs.verify(2, 25) == pytest.approx(0.1317 + 20 * slope)
    sizing = TreeSizing(costs)
    sizing.rows, sizing.forward_s = 2, 0.016
    chances = [0.9, 0.8, 0.7, 0.6] + [0.3] * 8 + [0.15] * 12  # a tree's 24 nodes, likeliest first
    assert sizing.how_many(chances, k=4, forwards=4) < 8


def test_wants_drafting_ignores_the_probe():
    policy, acc = DraftLengthPolicy(), Acceptance()
    _never_paying(policy, acc)
    for _ in range(PROBE_EVERY):
        k = policy.choose([acc.rate], k_max=4, rows=1)
        assert not policy.wants_drafting
    assert k == 1  # the probe drafts one token, though drafting does not pay


def test_a_plain_step_is_timed_at_a_new_batch_size_before_speculation_is_chosen_over_it():
    # Only wide passes of 8 rows were timed (say, while another workload drafted): a plain step of 8 rows would
    # be costed as a wide one, and k = 0 would never win. It is tried once, and then it wins on its measured cost.
    policy = DraftLengthPolicy()
    for k in (1, 4):
        policy.costs.observe(8, k, 0.24 * k, 0.25 + 0.04 * (8 * (k + 1) - 1))
    policy.costs.observe(1, 4, 0.1 * 4, 0.41)
    assert policy.choose([0.7] * 8, k_max=4, rows=8) == 0
    policy.costs.observe(8, 0, 0.0, 0.53)
    assert policy.choose([0.7] * 8, k_max=4, rows=8) == 0
    assert policy.choose([0.95] * 8, k_max=4, rows=8) == 0  # 8 tokens per 0.53 s still beats any draft here
    policy.costs.observe(1, 0, 0.0, 0.25)
    assert policy.choose([0.95], k_max=4, rows=1) == 4  # alone, speculation pays again


def test_with_fixed_rows_the_narrowest_pass_is_the_one_timed_first():
    # Rows drafting their own k = 2 make every pass at least 3 wide: a width-1 pass can never be timed, and
    # waiting for one would keep the adaptive rows at k = 0 for good.
    policy = DraftLengthPolicy()
    policy.costs.observe(4, 2, 0.1 * 2, 0.3)
    assert policy.choose([0.9], k_max=4, rows=4, fixed=[2, 2, 2]) > 0


def test_sequences_with_their_own_k_widen_the_pass():
    policy = DraftLengthPolicy()
    _memory_then_compute_bound(policy)
    # A row that drafts 4 regardless makes the pass width 5 anyway: the adaptive rows may as well use it.
    assert policy.choose([0.9], k_max=4, rows=4, fixed=[4, 4, 4]) == 4


def test_the_engine_measures_step_costs_by_batch_size():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    cfg = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    seqs = [eng.open_sequence(tokenizer.encode(p), cfg) for p in ("one two", "three four five")]
    for seq in seqs:
        while not seq.prefill_done:
            eng.prefill(seq)
    eng.step(seqs)
    assert 2 in eng.draft_policy.costs._verify_s and eng.draft_policy.costs.verify(2, 5) > 0
    for seq in seqs:
        eng.close_sequence(seq)


def test_int8_linear_is_close_to_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 300, bias=True)
    x = torch.randn(3, 5, 64)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q(x).shape == (3, 5, 300)
    assert torch.allclose(q(x), linear(x), atol=0.05 * linear(x).abs().max().item())


@cpu_kernels
def test_int8_dynamic_linear_is_close_for_a_draft_step_and_the_float_layer_for_a_prefill():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 300, bias=True)
    q = Int8DynamicLinear(linear)
    assert q.weight.data_ptr() == linear.weight.data_ptr()  # the float path reads the model's own tensor, no copy
    few = torch.randn(1, DYNAMIC_MAX_ROWS, 64)
    with torch.inference_mode():
        assert q(few).shape == (1, DYNAMIC_MAX_ROWS, 300) and not torch.equal(q(few), linear(few))  # quantized
        assert torch.allclose(q(few), linear(few), atol=0.05 * linear(few).abs().max().item())
        many = torch.randn(1, DYNAMIC_MAX_ROWS + 1, 64)
        assert torch.equal(q(many), linear(many))


@cpu_kernels
def test_an_int8_dynamic_copy_without_the_float_weight_runs_wide_calls_a_few_rows_at_a_time():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 300, bias=True)
    q = Int8DynamicLinear(linear, keep_float=False)  # the skip draft's copies: the target keeps no plain weight
    assert q.weight is None
    many = torch.randn(1, 2 * DYNAMIC_MAX_ROWS + 3, 64)
    with torch.inference_mode():
        rows = torch.cat([q(part) for part in many.split(DYNAMIC_MAX_ROWS, dim=1)], dim=1)
        assert torch.equal(q(many), rows) and not torch.equal(q(many), linear(many))
        assert torch.allclose(q(many), linear(many), atol=0.05 * linear(many).abs().max().item())


@cpu_kernels
@pytest.mark.parametrize("kernel", ["int8", "int8-dynamic"])
@pytest.mark.parametrize("k", [1, 4])
def test_a_draft_on_an_inexact_kernel_still_gives_the_targets_greedy_output(kernel, k):
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    plain = Engine.from_models(target, tokenizer, method="none").generate("The quick brown fox", max_new_tokens=24,
                                                                          ignore_eos=True)
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), draft_kernels=(kernel,))
    assert eng.speed_paths["draft_kernels"] == {kernel: 15}  # every linear, whatever this machine's timings say
    result = eng.generate("The quick brown fox", max_new_tokens=24, ignore_eos=True, num_draft_tokens=k,
                          adaptive=False)
    assert result.token_ids == plain.token_ids
    assert result.stats.acceptance_rate > 0.5  # a twin, even quantized, agrees with its target on most tokens


@cpu_kernels
def test_compact_draft_keeps_the_common_tokens_and_leaves_the_original_alone():
    model = tiny_model("llama", seed=0)
    before = model.lm_head.weight.clone()
    small, token_ids, plan = compact_draft(model, special_ids=[290, 5000], keep_vocab=100, kernels=("int8",))
    assert token_ids.tolist() == list(range(100)) + [290]  # 5000 is past the vocabulary
    assert small.get_output_embeddings().out_features == 101
    assert isinstance(small.lm_head, Int8Linear) and set(plan.choices.values()) == {"int8"}
    assert torch.equal(model.lm_head.weight, before) and type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("draft_vocab", [200, 100_000])
def test_compact_draft_gives_the_targets_greedy_output(draft_vocab):
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    plain = Engine.from_models(target, tokenizer, method="none").generate("The quick brown fox", max_new_tokens=24,
                                                                          ignore_eos=True)
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), draft_vocab=draft_vocab)
    # Fixed k: how much an adaptive k drafts depends on timings, and the acceptance asserted below must not.
    result = eng.generate("The quick brown fox", max_new_tokens=24, ignore_eos=True, num_draft_tokens=4,
                          adaptive=False)
    assert result.token_ids == plain.token_ids
    assert all(t < 200 or t in tokenizer.all_special_ids for t in eng.proposer.token_ids.tolist()) \
        if draft_vocab == 200 else eng.proposer.token_ids is None
    # A twin draft, even in int8, agrees with its target on most tokens.
    assert result.stats.acceptance_rate > (0.2 if draft_vocab == 200 else 0.7)


def _opened(eng, tokenizer, prompts, cfg):
    seqs = [eng.open_sequence(tokenizer.encode(p), cfg) for p in prompts]
    for seq in seqs:
        while not seq.prefill_done:
            eng.prefill(seq)
    return seqs


def test_an_adaptive_draft_is_filled_only_once_speculation_pays():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    plain = Engine.from_models(target, tokenizer, method="none")
    prompts = ("The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i * i)")
    cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    expected = [plain.generate(p, max_new_tokens=32, ignore_eos=True).token_ids for p in prompts]
    # Injected costs: at two rows a plain step gives 2 tokens per 0.1 s and no draft can beat it.
    for k in range(5):
        eng.draft_policy.costs.observe(2, k, 1.0 * k, 0.1 + 0.5 * k)
    seqs = _opened(eng, tokenizer, prompts, cfg)
    assert all(seq.draft_behind == len(seq.prompt_ids) - 1 for seq in seqs)  # the target alone was prefilled
    for _ in range(10):
        eng.step(seqs)
    assert not eng.draft_policy.wants_drafting and not any(eng.wants_catch_up(seq) for seq in seqs)
    assert all(seq.stats.proposed == 0 and seq.draft_behind > MAX_DRAFT_LAG for seq in seqs)
    # Drafting pays now (as when the load fell): the drafts catch up in chunks, then draft. (Every width timed in
    # turn, as steps would time them: none of these timings is stale by the time the next real step is timed.)
    for _ in range(40):
        for k in range(5):
            eng.draft_policy.costs.observe(2, k, 0.001 * k, 0.1)
    eng.step(seqs)
    assert eng.draft_policy.wants_drafting and all(eng.wants_catch_up(seq) for seq in seqs)
    for seq in seqs:
        while eng.wants_catch_up(seq):
            eng.catch_up_draft(seq, max_tokens=4)
        assert seq.draft_behind <= MAX_DRAFT_LAG
    while any(seq.finish is None for seq in seqs):
        eng.step([seq for seq in seqs if seq.finish is None])
    assert all(seq.stats.proposed > 0 for seq in seqs)
    assert [seq.context[len(seq.prompt_ids):] for seq in seqs] == expected
    for seq in seqs:
        eng.close_sequence(seq)


class _Priced:
    """costs, with verify priced by another rule."""

    def __init__(self, costs: StepCosts, verify):
        self.costs, self.verify = costs, verify

    def __getattr__(self, name):
        return getattr(self.costs, name)


def test_lagging_drafts_are_judged_as_if_all_were_filled_not_by_the_one_that_is():
    """A batch whose drafts lag: priced by the one row already filled, drafting is a wide pass for one row's guesses,
    which never pays, so no other draft would be filled and the filled one's reading is wasted. Whether to fill them
    is judged as if all were."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    prompts = ("The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i * i)",
               "def add(a, b):\n    return a + b  # the sum of a and b")
    seqs = _opened(eng, tokenizer, prompts, GenerationConfig(max_new_tokens=32, ignore_eos=True))
    assert all(seq.draft_behind > MAX_DRAFT_LAG for seq in seqs)
    eng.step(seqs)  # (the plain step at three rows, timed)
    # Drafting pays when every row drafts, not when one does beside two plain rows.
    eng.draft_policy.rate = lambda rates, k, rows, fixed=(), spreads=(), free=(): 2.0 if k and len(rates) == 3 else 1.0
    eng.catch_up_draft(seqs[0])
    assert seqs[0].draft_behind <= MAX_DRAFT_LAG
    eng.step(seqs)
    assert seqs[0].stats.proposed == 0  # this step: plain (one row's draft is not worth the wide pass)
    # yet the others are filled: then drafting pays
    assert eng.draft_policy.wants_drafting and eng.wants_catch_up(seqs[1])
    # The control: judged by the filled row alone, drafting would not be wanted.
    assert eng.draft_policy.judge([0.8], 4, 3, free=[0, 0]) == 0 and not eng.draft_policy.wants_drafting
    for seq in seqs:
        eng.close_sequence(seq)


def test_a_wide_pass_never_timed_at_a_batch_size_costs_no_less_than_as_many_positions_in_fewer_rows():
    """Plain steps of 1 to 8 rows on the quant backend (35 to 82 ms) and one row's passes nearly flat in width: a
    width's ratio at one row says nothing of 8 rows, where the pass is compute-bound (2 wide: 136-146 ms run)."""
    costs = StepCosts()
    for rows, seconds in ((1, 0.035), (2, 0.040), (4, 0.051), (8, 0.082)):
        costs.observe(rows, 0, 0.0, seconds)
    for k in range(1, 5):
        costs.observe(1, k, 0.0, 0.036)
    slope = (0.082 - 0.035) / 7  # a position's cost, on the plain steps' line
    assert costs.verify(8, 2) == pytest.approx(0.082 + 8 * slope)  # 16 positions: 8 past the 8-row plain step
    assert costs.verify(8, 5) == pytest.approx(0.082 + 32 * slope)
    assert costs.verify(1, 5) == pytest.approx(0.036)  # timed: as timed
    assert costs.verify(2, 2) == pytest.approx(0.040 * 0.036 / 0.035)  # 1 row's ratio: above 4 positions' 36 ms
    policy = DraftLengthPolicy(costs=costs)
    for rows, forward in ((1, 0.012), (8, 0.025)):  # a round's draft forward (8 rows: 25-48 ms run)
        costs.observe(rows, 1, forward, costs.verify(rows, 2))
    assert policy.choose([0.87] * 8, 4, rows=8) == 0  # drafting loses at 8 rows
    assert policy.choose([0.87], 4, rows=1) > 0  # and wins at one
    # The control: priced by the 1-row ratio alone, 8 rows 5 wide would cost about their plain step, and win.
    by_ratio = lambda rows, n: costs.verify(rows, 1) * costs.verify(1, min(n, 5)) / costs.verify(1, 1)
    assert by_ratio(8, 5) < 0.09 and planner.rate(_Priced(costs, by_ratio), 8, [Offer.of_chain(0.87, 4)] * 8) > \
        planner.rate(costs, 8, [Offer.of_chain(0.87, 0)] * 8)


def test_a_lagging_draft_is_filled_only_where_the_answer_still_to_come_repays_the_reading():
    """In a batch, a draft model's reading of a long prompt can cost more than drafting a short answer saves; such a
    sequence goes on with the target alone (exact either way), one with a long answer to come catches up."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    plain = Engine.from_models(target, tokenizer, method="none")
    prompts = ("The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i * i)")
    for k in range(5):  # at two rows drafting pays a little: 0.1 s a pass, 0.01 s a draft forward
        eng.draft_policy.costs.observe(2, k, 0.01 * k, 0.1)
    short, long = GenerationConfig(max_new_tokens=8, ignore_eos=True), GenerationConfig(max_new_tokens=200)
    seqs = _opened(eng, tokenizer, prompts, short)
    eng.step(seqs)  # (priced: drafting wins, and what it saves a token is known)
    assert eng.draft_policy.wants_drafting and eng.draft_policy.saving_per_token(2) > 0 and eng.open_sequences == 2
    behind = seqs[0].draft_behind
    assert behind > MAX_DRAFT_LAG and eng.wants_catch_up(seqs[0])  # reading's cost not measured yet: read
    eng.draft_policy.costs.catch_up_s = 1.0  # now measured, and dear: a second a token
    tokens_to_come = eng.catch_up.tokens_to_come(seqs[0])
    assert tokens_to_come == seqs[0].remaining < behind
    assert not any(eng.wants_catch_up(seq) for seq in seqs)
    # The same reading is repaid by a long answer to come (the control: the rule is not "never").
    saving = eng.draft_policy.saving_per_token(3)  # (three open: priced as the nearest, two rows)
    eng.draft_policy.costs.catch_up_s = saving * 100 / behind  # reading it costs what 100 tokens save
    longer = eng.open_sequence(tokenizer.encode(prompts[0]), long)
    assert longer.draft_behind > MAX_DRAFT_LAG and eng.wants_catch_up(longer) and not eng.wants_catch_up(seqs[0])
    eng.close_sequence(longer)
    while any(seq.finish is None for seq in seqs):
        eng.step([seq for seq in seqs if seq.finish is None])
    assert all(seq.stats.proposed == 0 for seq in seqs)  # the target alone, and its own text
    assert [seq.context[len(seq.prompt_ids):] for seq in seqs] == [
        plain.generate(p, max_new_tokens=8, ignore_eos=True).token_ids for p in prompts]


def test_a_lagging_draft_is_priced_in_the_batch_of_the_recent_steps_not_a_gap_between_requests():
    """At 2 requests, one has ended and the next not yet arrived: 1 open, where drafting saves far more a token than in
    the 2-row steps that follow. Filling is priced at the recent steps' rows until steps alone show the load fell."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    priced_at = []
    eng.draft_policy.catch_up_pays = lambda behind, to_come, rows: priced_at.append(rows) or True
    cfg = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    seqs = _opened(eng, tokenizer, ("The quick brown fox jumps over the lazy dog.", "for i in range(10):"), cfg)
    for _ in range(10):
        eng.step(seqs)
    eng.close_sequence(seqs[1])  # (the next request not here yet)
    eng.draft_policy.wants_drafting = True  # (as when drafting paid at the last step)
    assert eng.open_sequences == 1 and eng.wants_catch_up(seqs[0]) and priced_at[-1] > 1.5  # priced as 2 rows
    for _ in range(10):
        eng.step(seqs[:1])
    eng.draft_policy.wants_drafting = True  # (whatever tiny models' timings made of it)
    assert eng.wants_catch_up(seqs[0]) and priced_at[-1] < 1.5  # the load fell: priced as 1 row
    eng.close_sequence(seqs[0])


def test_the_tokens_to_come_are_bounded_by_how_long_finished_answers_ran():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=1, layers=1))
    cfg = GenerationConfig(max_new_tokens=400)
    seq = eng.open_sequence(tokenizer.encode("The quick brown fox"), cfg)
    assert eng.catch_up.tokens_to_come(seq) == 400  # nothing finished yet: its limit
    for _ in range(3):
        eng.generate("The quick brown fox", max_new_tokens=6, ignore_eos=True)
    assert eng.catch_up.tokens_to_come(seq) == pytest.approx(6.0)  # answers ran 6 tokens
    seq.stats.new_tokens = 40
    assert eng.catch_up.tokens_to_come(seq) == 40  # it has outlived them: as long again, at most its limit
    eng.close_sequence(seq)


def _never_paying_draft():
    """An engine whose drafting never pays, whatever is measured: every step is plain but for the first (nothing
    measured) and probes, each priced to lose little (so they come as often as the gap allows); the target alone
    beside it. Records the context length at each drafting round, and how far behind each found the draft."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=1, layers=1))
    eng.draft_policy.rate = lambda rates, k, rows, fixed=(), spreads=(), free=(): 1.0 if k == 0 else 0.99
    drafted, behind = [], []
    eng.round_observer = lambda seq, draft, verdict, times: drafted.append(len(seq.context))
    start = eng.proposer.start

    def starting(context, k, stop_confidence=0.0):
        behind.append(eng.proposer.behind(context)) if k > 0 else None
        start(context, k, stop_confidence)

    eng.proposer.start = starting
    return eng, Engine.from_models(target, tokenizer, method="none"), drafted, behind


LONE_PROMPT, LONE_TOKENS = "The quick brown fox jumps over the lazy dog.", 3 * PROBE_EVERY + 4 * PROBE_EVERY + 10


def _assert_every_probe_drafted_from_a_filled_draft(drafted: list[int], behind: list[int], first_round=True) -> None:
    """The first round (first_round: generate fills the draft's prompt at once; a server only once drafting has paid or
    is probed), then probes PROBE_EVERY, 2 * PROBE_EVERY and 4 * PROBE_EVERY steps apart, each drafted ..."""
    assert len(drafted) == 3 + first_round
    # ... each with its draft filled first, even the one within MAX_DRAFT_LAG: a probe's first forward, timed as
    # drafting, does not carry a catch-up.
    assert len(behind) == len(drafted) and max(behind) <= ROUND_FEED
    gaps = [b - a for a, b in zip(drafted[-3:], drafted[-2:])]  # tokens between probes: at least their steps
    assert gaps[0] >= 2 * PROBE_EVERY and gaps[1] >= 4 * PROBE_EVERY


def test_a_sequence_alone_fills_its_lagging_draft_before_each_probe():
    """Without the fill, a draft more than MAX_DRAFT_LAG tokens behind sits the probe out: once the gap between
    probes has doubled past that, no later probe of the request drafts (here the third would not)."""
    eng, plain, drafted, behind = _never_paying_draft()
    result = eng.generate(LONE_PROMPT, max_new_tokens=LONE_TOKENS, ignore_eos=True)
    assert result.token_ids == plain.generate(LONE_PROMPT, max_new_tokens=LONE_TOKENS, ignore_eos=True).token_ids
    _assert_every_probe_drafted_from_a_filled_draft(drafted, behind)


def _serve(eng: Engine, prompts: list[str], mark_alone: bool = True) -> list[list[int]]:
    """Each prompt's token ids, all submitted at once to a scheduler on eng (its _mark_alone a no-op if not
    mark_alone: the control)."""
    scheduler = Scheduler(eng, max_batch=4)
    if not mark_alone:
        scheduler._mark_alone = lambda: None
    done, tokens = threading.Semaphore(0), {prompt: [] for prompt in prompts}

    def sink_for(prompt):
        def sink(event):
            if event.token_id is not None:
                tokens[prompt].append(event.token_id)
            if event.finish_reason is not None:
                done.release()
        return sink

    cfg = GenerationConfig(max_new_tokens=LONE_TOKENS, ignore_eos=True)
    for prompt in prompts:
        scheduler.submit(eng.tokenizer.encode(prompt), cfg, sink_for(prompt))
    scheduler.start()
    try:
        for _ in prompts:
            assert done.acquire(timeout=120)
    finally:
        scheduler.drain(10)
    return [tokens[prompt] for prompt in prompts]


def test_a_servers_lone_request_fills_its_lagging_draft_before_each_probe_as_generate_does():
    """One request in flight decodes alone: without the fill (the control), the probes after its draft fell more
    than MAX_DRAFT_LAG behind would be sat out."""
    eng, plain, drafted, behind = _never_paying_draft()
    [served] = _serve(eng, [LONE_PROMPT])
    assert served == plain.generate(LONE_PROMPT, max_new_tokens=LONE_TOKENS, ignore_eos=True).token_ids
    _assert_every_probe_drafted_from_a_filled_draft(drafted, behind, first_round=False)
    control, _, drafted, behind = _never_paying_draft()
    [served] = _serve(control, [LONE_PROMPT], mark_alone=False)
    assert served == plain.generate(LONE_PROMPT, max_new_tokens=LONE_TOKENS, ignore_eos=True).token_ids
    assert len(drafted) < 3, drafted


def test_requests_served_together_are_not_filled_before_probes_nor_priced_as_refilled():
    eng, _, _, _ = _never_paying_draft()
    flags = []
    step = eng.step

    def stepping(seqs):
        flags.append((len(seqs), {seq.fills_before_probes for seq in seqs}))
        return step(seqs)

    eng.step = stepping
    _serve(eng, [LONE_PROMPT, LONE_PROMPT[::-1]])
    # (A step of one row may come while both are open, or once one has finished and the other decodes alone.)
    assert (2, {False}) in flags and all(marks == {False} for rows, marks in flags if rows == 2)


def _long_context_costs() -> DraftLengthPolicy:
    """The prices a lone sequence saw at 1,451 tokens of context on the quant route (long-context-spr): a plain step
    46.8 ms, a 2-token pass 53.3, a draft forward 17.2, a lagging draft reading a token 4.5."""
    policy = DraftLengthPolicy()
    for _ in range(3):
        policy.costs.observe(1, 0, 0.0, 0.0468)
        policy.costs.observe(1, 1, 0.0172, 0.0533)
    policy.costs.observe_catch_up(10, 0.045)
    return policy


def test_a_lone_sequence_whose_draft_is_refilled_before_probes_prices_the_refilling_into_plain_steps():
    """At 0.45 a plain step beats drafting one token (21.4 against 20.6 tokens/s), but each plain token is one the
    draft reads before the next probe: 19.5 tokens/s priced with it, so drafting on wins and keeps its estimate fed.
    Far below break-even (0.1), plain steps still win, refilling and all."""
    assert _long_context_costs().choose([0.45], k_max=1, rows=1) == 0
    assert _long_context_costs().choose([0.45], k_max=1, rows=1, refills=1) == 1
    assert _long_context_costs().choose([0.1], k_max=1, rows=1, refills=1) == 0
    unmeasured = _long_context_costs()
    unmeasured.costs.catch_up_s = None  # no reading timed yet: nothing to price
    assert unmeasured.choose([0.45], k_max=1, rows=1, refills=1) == 0


def test_the_refilling_priced_into_plain_steps_leaves_the_saving_a_filling_is_weighed_against():
    policy, bare = _long_context_costs(), _long_context_costs()
    policy.judge([0.45], k_max=1, rows=1, refills=1)
    bare.judge([0.45], k_max=1, rows=1)
    assert policy.wants_drafting and not bare.wants_drafting
    assert policy._priced[1][0] == pytest.approx(bare._priced[1][0])  # the plain rate, without the refilling
    assert policy._probe_floor == bare._probe_floor


def test_only_a_sequence_decoding_alone_with_a_draft_model_is_priced_as_refilled():
    """generate fills a lagging draft before each probe; a scheduler's steps (Engine.step) do not, nor does prompt
    lookup keep a draft to fill."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    draft = tiny_model("llama", seed=1, layers=1)
    prompt = "The quick brown fox jumps over the lazy dog."
    for method, alone_refills in (("draft", {1}), ("lookup", set())):  # (lookup judges its own rounds: no k chosen)
        eng = Engine.from_models(target, tokenizer, draft_model=draft, method=method)
        policy, seen = eng.draft_policy, []
        choose = policy.choose

        def spy(*args, refills=0, **kwargs):
            seen.append(refills)
            return choose(*args, refills=refills, **kwargs)
        policy.choose = spy
        eng.generate(prompt, max_new_tokens=6, ignore_eos=True)
        assert set(seen) == alone_refills, method
        seen.clear()
        seq = eng.open_sequence(tokenizer.encode(prompt), GenerationConfig(max_new_tokens=6, ignore_eos=True))
        while not seq.prefill_done:
            eng.prefill(seq)
        while seq.finish is None:
            eng.step([seq])
        eng.close_sequence(seq)
        assert not seq.fills_before_probes and set(seen) <= {0}, method


def test_a_fixed_k_sequence_prefills_its_draft_before_its_first_round():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    cfg = GenerationConfig(max_new_tokens=4, ignore_eos=True, adaptive=False)
    seq = eng.open_sequence(tokenizer.encode("The quick brown fox jumps over the lazy dog."), cfg)
    eng.prefill(seq, 3)
    assert not seq.prefill_done
    while not seq.prefill_done:
        eng.prefill(seq, 3)
    assert seq.draft_behind == 0
    eng.close_sequence(seq)


def test_the_drafts_prompt_prefill_counts_as_prefill_time(monkeypatch):
    """Decoding alone, the draft takes the prompt before the first round; that time is prefill, not nowhere."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=1))
    fed = []
    real_catch_up = eng.catch_up.fill

    def slow_catch_up(seq, max_tokens=None):
        if seq.draft_behind:  # a catch-up that does work takes at least this long
            fed.append(seq.draft_behind)
            time.sleep(0.2)
        real_catch_up(seq, max_tokens)

    monkeypatch.setattr(eng.catch_up, "fill", slow_catch_up)
    stats = eng.generate("The quick brown fox jumps over the lazy dog.", max_new_tokens=1, ignore_eos=True).stats
    assert fed and fed[0] > 5  # the whole prompt, before any round
    assert stats.prefill_s >= 0.2


def test_lookup_rounds_are_not_timed_as_draft_forwards():
    """Lookup runs no forward: timed as one, its near-zero time would make a draft model in the same batch (and a
    chain hybrid's pick, priced by the seconds per draft forward) look free."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, method="lookup")
    result = eng.generate("one two three one two three one two three one two", max_new_tokens=16, ignore_eos=True)
    assert result.stats.proposed > 0 and eng.draft_policy.costs.measured
    assert eng.draft_policy.costs.draft(1) == 0.0  # nothing recorded as a draft forward


def test_a_tree_is_priced_by_the_width_of_its_pass_not_its_depth():
    # A flat-ish pass: 2 positions cost 0.26 s, 4 cost 0.30, against 0.25 for a plain step; drafting is nearly free.
    policy = DraftLengthPolicy()
    for k, seconds in ((0, 0.25), (1, 0.26), (2, 0.28), (3, 0.30), (4, 0.32)):
        policy.costs.observe(1, k, 0.001 * k, seconds)
    # a = 0.2: one guess gives 1.2 tokens; a chain's 2-position pass pays for it (4.6 against 4.0 tokens a second).
    assert policy.choose([0.2], k_max=4, rows=1) == 1
    # A tree with 2 nodes beside its path is verified over 4 positions at depth 1: 1.2 tokens for 0.30 s does not pay.
    spread = TreeSpread()
    for _ in range(5):
        spread.observe(nodes=3, depth=1)
    assert spread.side_nodes == 2.0
    assert policy.choose([0.2], k_max=4, rows=1, spreads=[spread.side_nodes]) == 0
    assert policy.choose([0.9], k_max=4, rows=1, spreads=[spread.side_nodes]) > 0  # where it keeps 90%, it does pay


def test_tree_spread_starts_as_a_chain_and_follows_the_rounds():
    spread = TreeSpread()
    assert spread.side_nodes == 0.0
    spread.observe(nodes=6, depth=2)
    assert spread.side_nodes == 4.0  # the first round replaces the chain's 0
    spread.observe(nodes=0, depth=0)  # a round that drafted nothing says nothing
    assert spread.side_nodes == 4.0
    spread.observe(nodes=2, depth=2)
    assert spread.side_nodes == pytest.approx(0.9 * 4.0)


def test_lookup_judges_every_round_by_its_own_guess_whatever_the_shared_draft_length():
    """A lookup method's round is decided after its free guess, by lookup's acceptance after a match of that length
    (learnt in hindsight, every round), not by the shared k: that k, learnt on drafted rounds alone, cut a copying
    span to its depth, and turned drafting off after a few misses (but for probes) where the text later copied."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, method="lookup")
    ids = tokenizer.encode("one two three four five one two three four five one two three")
    seq = eng.open_sequence(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    for width in (1, 5):
        eng.draft_policy.costs.observe(1, width - 1, 0.0, 0.15 + 0.05 * width)  # 0.05 s more per token of width
    seq.acceptance = Acceptance(3.0, 10.0)  # the sequence's drafted rounds kept 30%
    assert eng.draft_policy.choose([seq.acceptance.rate], 4, 1) == 1  # the shared k: one token
    seq.proposer.begin(ids, None, None)
    seq.proposer.propose(seq.context, 4)
    match = seq.proposer.last_match
    assert match >= 3
    for _ in range(10):
        seq.proposer.acceptance_after(match).observe(4, 4)  # lookup after such a match has been right
    assert eng.lengths.choose([seq]) == [4]  # its whole guess: 4.5 tokens in 0.4 s
    assert seq.proposer.propose(seq.context, 4).depth == 4  # the guess free_round priced, handed over
    for _ in range(30):
        seq.proposer.acceptance_after(match).observe(4, 0)  # then turns out wrong
    assert eng.lengths.choose([seq]) == [0]  # a plain step
    eng.close_sequence(seq)


def test_a_free_guess_already_in_the_pass_makes_drafting_to_its_width_cheap():
    """A lookup row's nodes widen the batch's pass whatever the draft rows do: up to that width, their draft
    tokens add only draft forwards."""
    policy = DraftLengthPolicy()
    policy.costs.observe(2, 0, 0.0, 0.2)  # a plain step of two rows
    policy.costs.observe(2, 4, 0.04, 0.4, draft_steps=4)  # a 5-wide pass; 0.01 s a draft forward
    assert policy.choose([0.3], 4, 2) == 0  # alone in a narrow pass, 30% acceptance does not pay
    assert policy.choose([0.3], 4, 2, free=[4]) == 2  # beside a lookup row's 4 nodes it does


def test_a_lookup_rows_guess_is_made_before_the_shared_k_and_widens_its_pass():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=1), method="draft",
                             compact_draft=False)
    ids = tokenizer.encode("one two three four five one two three four five one two three")
    lookup = eng.open_sequence(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True, method="lookup"))
    draft = eng.open_sequence(tokenizer.encode("a quiet morning"), GenerationConfig(max_new_tokens=8, ignore_eos=True))
    for seq in (lookup, draft):
        while not seq.prefill_done:
            eng.prefill(seq)
    eng.draft_policy.costs.observe(2, 0, 0.0, 0.2)
    eng.draft_policy.costs.observe(2, 4, 0.04, 0.4, draft_steps=4)
    for _ in range(10):
        lookup.proposer.acceptance_after(3).observe(4, 4)  # lookup after a 3-token match: right so far
    draft.acceptance = Acceptance(3.0, 10.0)
    seen = []
    choose = eng.draft_policy.choose
    eng.draft_policy.choose = lambda *args, **kw: seen.append(args[-1]) or choose(*args, **kw)
    k_lookup, k_draft = eng.lengths.choose([lookup, draft])
    assert k_lookup == 4 and seen == [[4]] and k_draft == 2  # the draft row drafts up to the pass's width
    eng.step([lookup, draft])  # (chooses again: the same guess, armed for the round that runs)
    assert lookup.stats.nodes == 4 and draft.stats.proposed > 0
    for seq in (lookup, draft):
        eng.close_sequence(seq)


def test_a_row_whose_draft_lags_is_priced_as_the_plain_row_it_runs_as():
    """A draft far behind its text sits the round out: priced among the drafting rows, it would count tokens its
    row cannot emit, and the caught-up row would draft where, beside a plain row, drafting does not pay."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    prompts = ("The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i * i)")
    cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    # At two rows: plain 2 tokens in 0.1 s (20/s); both drafting one token at a = 0.5, 3 in 0.13 s (23/s); one
    # drafting beside a plain row, 2.5 in 0.13 s (19/s).
    for _ in range(3):
        for k, verify_s in enumerate((0.1, 0.12, 0.2, 0.3, 0.4)):
            eng.draft_policy.costs.observe(2, k, 0.01 * k, verify_s)

    def lengths(lagging: bool) -> list[int]:
        seqs = _opened(eng, tokenizer, prompts, cfg)
        for seq in seqs[: 1 if lagging else 2]:
            eng.catch_up_draft(seq)
        for seq in seqs:
            seq.acceptance = Acceptance(1.0, 2.0)  # a = 0.5
        ks = eng.lengths.choose(seqs)
        for seq in seqs:
            eng.close_sequence(seq)
        return ks

    assert lengths(lagging=False) == [1, 1]
    assert lengths(lagging=True) == [0, 0]  # (priced as two drafting rows: [1, 0])


def test_a_rounds_forwards_are_priced_as_timed_by_count_not_at_the_short_rounds_mean():
    """A round's first draft forward reads what the last round kept (up to k + 1 positions), the later ones one
    each: measured on the quant backend at 1 row, 14 ms for rounds of 1, 50 for rounds of 4. Priced per forward
    from the short rounds, 3 forwards cost 42 ms; by count they cost 38, and k = 3 is chosen over 2."""
    policy = DraftLengthPolicy()
    for width, ms in zip(range(1, 6), (32.8, 38.1, 43.4, 47.7, 58.9)):  # the same pass widths, as measured
        policy.costs.observe(1, width - 1, 0.0 if width == 1 else 0.014 if width == 2 else 0.050, ms / 1000,
                             draft_steps=0 if width == 1 else 1 if width == 2 else 4)
    costs = policy.costs
    assert costs.draft_round(1, 1) == pytest.approx(0.014) and costs.draft_round(1, 4) == pytest.approx(0.050)
    assert costs.draft_round(1, 3) == pytest.approx(0.038) and costs.draft_round(1, 6) == pytest.approx(0.074)
    assert costs.draft(1) == pytest.approx(0.012)  # one more forward: the slope
    assert policy.choose([0.85], k_max=4, rows=1) == 3
    per_forward = DraftLengthPolicy()  # the control: priced at the short rounds' 14 ms a forward
    for width, ms in zip(range(1, 6), (32.8, 38.1, 43.4, 47.7, 58.9)):
        per_forward.costs.observe(1, width - 1, 0.014 * (width - 1), ms / 1000)
    assert per_forward.choose([0.85], k_max=4, rows=1) == 2


def test_a_steps_overhead_is_priced_so_fewer_longer_rounds_win_where_it_is_large():
    """Every step pays its choosing, committing and accepting whatever it drafts: with none priced, a round of 1
    and a round of 3 that make tokens equally fast per second of drafting and passes tie; with 20 ms a step, the
    round of 3, which pays it once for more tokens, wins."""
    costs = StepCosts()
    for width in range(1, 5):
        costs.observe(1, width - 1, 0.010 * (width - 1), 0.030 + 0.015 * (width - 1))
    from draftwise import planner

    one, three = planner.Offer.of_chain(0.9, 1), planner.Offer.of_chain(0.9, 3)
    assert planner.rate(costs, 1, [three]) < planner.rate(costs, 1, [one])  # no overhead: the short round wins
    costs.observe_overhead(1, True, 0.020)
    costs.observe_overhead(1, False, 0.004)
    assert planner.rate(costs, 1, [three]) > planner.rate(costs, 1, [one])
    assert costs.overhead(2, True) == pytest.approx(0.020)  # the nearest rows measured


def test_the_engine_times_a_steps_overhead_apart_from_drafting_and_the_pass():
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                             method="draft")
    eng.generate("The quick brown fox", max_new_tokens=12, ignore_eos=True)
    costs = eng.draft_policy.costs
    assert costs.overhead(1, True) > 0 or costs.overhead(1, False) > 0
    assert costs.overhead(1, True) < 0.5  # (seconds: a step's bookkeeping, not its forwards)


def test_a_batch_fills_a_lagging_draft_where_it_repays_twice_a_sequence_alone_where_it_repays_once():
    """Alone, a filled draft drafts at once; in a batch only once its batch-mates' are filled too, on a predicted
    saving (the margin, planner.CATCH_UP_MARGIN)."""
    policy = DraftLengthPolicy()
    policy.costs.catch_up_s = 0.0025  # 300 tokens behind: 0.75 s of reading
    policy._priced = {1: (30.0, 33.0), 2: (30.0, 33.0)}  # a saving of 3 ms a token
    assert policy.catch_up_pays(300, 300, rows=1)  # 0.91 s saved
    assert not policy.catch_up_pays(300, 300, rows=2)
    assert policy.catch_up_pays(300, 600, rows=2)  # 1.82 s saved


def test_a_lagging_drafts_reading_is_priced_as_a_draft_forward_and_the_rest_by_the_token():
    """The 0.5B on the quant route: a filling of 3 tokens took 13.5 ms (4.5 a token), one of 43 tokens 57.3 ms, a
    draft forward 10 ms. Priced per token alone (the control), 43 tokens cost more than drafting would save."""
    policy = DraftLengthPolicy()
    policy.costs.observe_catch_up(3, 0.0135)
    assert policy.costs.catch_up(43) == pytest.approx(43 * 0.0045)  # no forward timed yet: all by the token
    policy.costs.observe(1, 1, 0.010, 0.040)  # a round of one draft forward
    assert policy.costs.catch_up(43) == pytest.approx(0.010 + 43 * 0.0035 / 3)  # 60 ms
    policy._priced = {1: (21.4, 27.6)}  # 10.5 ms a token saved
    assert policy.catch_up_pays(43, 10, rows=1)
    assert not planner.catch_up_pays(policy.saving_per_token(1), 10, 43 * 0.0045)
    # Every filling pays the forward once; the rest is weighted by the tokens read.
    policy.costs.observe_catch_up(43, 0.0573)
    spent, read, fillings = 0.9 * 0.0135 + 0.0573, 0.9 * 3 + 43, 0.9 + 1
    assert policy.costs.catch_up_s == pytest.approx((spent - fillings * 0.010) / read)
    assert policy.costs.catch_up(43) == pytest.approx(0.010 + 43 * policy.costs.catch_up_s)
    # A forward dearer than a filling's mean (timed at a longer context) is no more than that mean.
    policy.costs.observe(1, 1, 0.5, 0.6)
    assert policy.costs.catch_up(0) == pytest.approx(spent / fillings) and policy.costs.catch_up_s >= 0


def test_a_filling_is_weighed_against_the_saving_drafting_realised_not_only_the_one_priced():
    """Prices that promise drafting more than its steps run (a tree's extra nodes, a busy spell) would fill drafts for
    a saving that does not come: the saving is taken at the share of the priced rate that drafting's steps ran."""
    policy = DraftLengthPolicy()
    for k in range(5):  # at two rows drafting pays: 0.1 s a pass, 0.01 s a draft forward
        policy.costs.observe(2, k, 0.01 * k, 0.1)
    rates = [0.9, 0.9]
    k = policy.choose(rates, k_max=4, rows=2)
    plain, priced = policy._priced[2]
    assert k > 0 and policy.saving_per_token(2) == pytest.approx(planner.saving_per_token(plain, priced))
    # Reading 100 tokens costs 0.8 of what 90 tokens to come save as priced: repaid 2.5 times over, against 2.
    policy.costs.catch_up_s = 0.8 * policy.saving_per_token(2) * 90 / (planner.CATCH_UP_MARGIN * 100)
    assert policy.catch_up_pays(100, 90, rows=2)
    for _ in range(20):  # drafting's steps run at 60% of their price
        policy.observe_outcome(round(0.6 * priced * 0.2), 0.2)
        policy.choose(rates, k_max=4, rows=2)
    assert policy.realised(2) == pytest.approx(0.6, abs=0.02)
    assert policy.saving_per_token(2) == pytest.approx(planner.saving_per_token(plain, priced * policy.realised(2)))
    assert not policy.catch_up_pays(100, 90, rows=2)
    # The control: steps that run faster than priced do not make the prices more optimistic than they are.
    faster = DraftLengthPolicy(costs=policy.costs)
    faster.choose(rates, k_max=4, rows=2)
    faster.observe_outcome(round(2 * priced), 1.0)
    assert faster.realised(2) == 1.0 and faster.catch_up_pays(100, 90, rows=2)


def test_a_share_realised_that_no_step_renews_goes_stale_and_the_next_outcome_replaces_it():
    """While the share realised keeps a lagging draft unfilled, no drafting step runs to renew it: a server's lone
    request after a short first one never drafted. Stale after STALE_STEPS steps, as a timing."""
    policy = DraftLengthPolicy()
    for k in range(5):  # drafting pays as priced: 0.1 s a pass, 0.01 s a draft forward
        policy.costs.observe(1, k, 0.01 * k, 0.1)
    policy.choose([0.9], k_max=4, rows=1)
    plain, priced = policy._priced[1]
    for _ in range(20):  # drafting's steps run at 60% of their price
        policy.observe_outcome(round(0.6 * priced * 2), 2.0)
        policy.choose([0.9], k_max=4, rows=1)
    # Reading 100 tokens costs 0.9 of what 90 tokens to come would save as priced: repaid as priced, not as run.
    policy.costs.catch_up_s = 0.9 * planner.saving_per_token(plain, priced) * 90 / 100
    assert policy.realised(1) == pytest.approx(0.6, abs=0.02) and not policy.catch_up_pays(100, 90, rows=1)
    for _ in range(STALE_STEPS - 1):  # plain steps: the draft lags, no drafting step runs (the control: not yet)
        policy.costs.observe(1, 0, 0.0, 0.1)
    assert policy.realised(1) == pytest.approx(0.6, abs=0.02)
    policy.costs.observe(1, 0, 0.0, 0.1)
    assert policy.realised(1) == 1.0 and policy.catch_up_pays(100, 90, rows=1)
    for k in range(1, 5):  # (the wide passes' timings went stale too: drafting's steps time them again)
        policy.costs.observe(1, k, 0.01 * k, 0.1)
    assert policy.choose([0.9], k_max=4, rows=1) > 0
    policy.observe_outcome(round(0.8 * policy._priced[1][1] * 2), 2.0)  # filled, it drafts: 80% of the price
    assert policy.realised(1) == pytest.approx(0.8, abs=0.03)  # (not averaged with the stale 60%)


def test_only_steps_that_drafted_by_choice_say_how_far_drafting_is_borne_out():
    """A plain step or a probe was not drafting's promise: what it ran is not set against drafting's price."""
    policy = DraftLengthPolicy()
    for k in range(5):  # a pass 0.1 s plus 0.1 s a token of width: drafting never pays
        policy.costs.observe(1, k, 0.0, 0.1 + 0.1 * k)
    for _ in range(3 * PROBE_EVERY):  # plain steps, and the probes among them
        policy.choose([0.5], k_max=4, rows=1)
        policy.observe_outcome(1, 0.5)
    assert policy.realised(1) == 1.0 and not policy._outcomes
    # Nor an exploration: a width never timed, priced as an optimist so that it gets tried.
    explorer = DraftLengthPolicy()
    for k in range(2):  # widths 1 and 2 timed; drafting pays, and wider passes are priced on their chord
        explorer.costs.observe(1, k, 0.01 * k, 0.1)
    assert explorer.choose([0.95], k_max=4, rows=1) == 4 and not explorer.costs.fresh(1, 5)
    explorer.observe_outcome(1, 0.5)
    assert not explorer._outcomes
    assert explorer.choose([0.95], k_max=1, rows=1) == 1  # (k = 1: width 2 was timed)
    explorer.observe_outcome(1, 0.5)
    assert explorer.realised(1) < 1.0


def test_the_engine_tells_the_policy_what_each_step_emitted():
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0))
    told = []
    eng.draft_policy.observe_outcome = lambda tokens, seconds: told.append((tokens, seconds))
    eng.generate("The quick brown fox", max_new_tokens=12, ignore_eos=True)
    assert sum(tokens for tokens, _ in told) == 12 and all(seconds > 0 for _, seconds in told)


def test_each_drafter_prices_its_own_draft_forwards_over_one_table_of_passes():
    """A tree's level of nodes, a chain's one token and a skipping target's layers cost different forwards; the target
    pass they are verified in costs the same whoever drafted it."""
    chain = StepCosts()
    tree = chain.sharing_passes()
    tree.observe(1, 4, 0.4, 0.1, draft_steps=2)  # a tree 2 deep: 0.2 s a forward
    assert tree.draft_round(1, 2) == pytest.approx(0.4)  # control: the drafter that timed it prices by it
    assert chain.draft_round(1, 2) == 0.0 and chain.draft(1) == 0.0  # nothing of the chain's own timed yet
    assert chain.measured and chain.verify(1, 5) == pytest.approx(0.1)  # the pass is the one table's
    assert chain.steps == tree.steps == 1  # one clock: staleness counts every step of either
    chain.observe(1, 2, 0.02, 0.08)
    assert tree.steps == 2 and tree.verify(1, 3) == pytest.approx(0.08) and tree.draft_round(1, 2) == pytest.approx(0.4)


def test_a_method_served_after_another_prices_drafting_by_its_own_forwards_not_the_others():
    """One server serves several methods: the draft tree's wide forwards must not price `hybrid`'s chain forwards,
    or a hybrid that then picks lookup never runs a draft forward to correct them."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), method="hybrid")
    prompt = "The quick brown fox jumps over the lazy dog."
    eng.generate(prompt, max_new_tokens=24, ignore_eos=True, method="draft-tree")
    seq = eng.open_sequence(tokenizer.encode("Another prompt"), GenerationConfig(max_new_tokens=16, ignore_eos=True))
    costs = seq.proposer.costs
    assert costs is not None and costs.measured  # the tree's passes price the hybrid's
    assert costs.draft(1) == 0.0  # but none of the tree's forwards
    eng.close_sequence(seq)
    tree = eng.open_sequence(tokenizer.encode(prompt), GenerationConfig(max_new_tokens=16, ignore_eos=True,
                                                                       method="draft-tree"))
    assert tree.proposer.sizing.costs.draft(1) > 0.0  # control: the tree's own are there
    eng.close_sequence(tree)


def test_one_methods_verdict_on_drafting_does_not_steer_anothers_filling():
    """Where drafting lost for one method's rows (a tree at this batch size), another method's lagging draft is still
    filled by its own policy's verdict; its own verdict does stop it (the control)."""
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), method="hybrid")

    def stepped(method: str):
        seq = eng.open_sequence(tokenizer.encode("one two three"), GenerationConfig(max_new_tokens=8, method=method))
        while not seq.prefill_done:
            eng.prefill(seq)
        eng.step([seq])  # the step's policy is now the engine's draft_policy
        return seq

    chain = stepped("draft")
    chain_policy = eng.draft_policy
    tree = stepped("draft-tree")
    assert eng.draft_policy is not chain_policy
    eng.draft_policy.wants_drafting = False  # drafting lost for the tree's rows
    chain.context += [5] * (MAX_DRAFT_LAG + 1)  # the chain's draft lags far behind its text
    assert eng.wants_catch_up(chain)
    chain_policy.wants_drafting = False  # control: its own verdict
    assert not eng.wants_catch_up(chain)
    for seq in (chain, tree):
        eng.close_sequence(seq)
