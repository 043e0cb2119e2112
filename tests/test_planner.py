"""The round planner: its expected tokens and a round's cost against hand-computed values, and every choice of how
much to draft (the draft length, lookup's depth, a hybrid's pick, a tree's size, the skip calibration, the
predicted speedup) asking it, seen by a spy whose answer the choice must follow."""
from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from draftwise import Engine, metrics, planner
from draftwise.adaptive import DraftLengthPolicy
from draftwise.backends.hf import HFBackend
from draftwise.estimates import StepCosts
from draftwise.planner import FlatPrices, Offer
from draftwise.proposers.prompt_lookup import PromptLookupProposer
from draftwise.proposers.skip_calibration import measure_skip
from draftwise.proposers.tree_growth import GrownTree, TreeSizing


def _costs(plain_s: float = 0.2, per_token_s: float = 0.0, forward_s: float = 0.1) -> StepCosts:
    """One row's passes measured at widths 1 to 9: plain_s, plus per_token_s per token past the first; a draft
    forward of forward_s."""
    costs = StepCosts()
    for width in range(1, 10):
        costs.observe(1, width - 1, forward_s * (width - 1), plain_s + per_token_s * (width - 1))
    return costs


class RecordingPrices:
    """Flat prices that record the shapes asked for."""

    def __init__(self, draft_s: float, pass_s: float):
        self.draft_s, self.pass_s, self.asked = draft_s, pass_s, []

    def draft(self, rows):
        self.asked.append(("draft", rows))
        return self.draft_s

    def draft_round(self, rows, forwards):
        self.asked.append(("draft", rows))
        return self.draft_s * forwards

    def overhead(self, rows, drafted):
        return 0.0

    def verify(self, rows, n):
        self.asked.append(("verify", rows, n))
        return self.pass_s


def spy(monkeypatch, name: str, answer=None) -> list[tuple]:
    """Replace planner.<name> with a recorder of (the calling module, args, kwargs); it answers `answer(*args,
    **kwargs)` if given, else what the real function does."""
    real, calls = getattr(planner, name), []

    def recorded(*args, **kwargs):
        calls.append((sys._getframe(1).f_globals["__name__"], args, kwargs))
        return (answer or real)(*args, **kwargs)

    monkeypatch.setattr(planner, name, recorded)
    return calls


# -- the formulas ----------------------------------------------------------------------------------------------


def test_a_chains_expected_tokens_by_hand():
    assert planner.chain(0.5, 3) == [0.5, 0.25, 0.125]
    assert planner.expected_tokens(planner.chain(0.5, 3)) == 1.875  # 1 + .5 + .25 + .125
    assert planner.chain_tokens(0.5, 3) == pytest.approx(1.875)  # the closed form agrees
    assert planner.chain_tokens(1.0, 3) == 4.0 and planner.chain_tokens(0.0, 3) == 1.0
    # Per-position rates: the second token is kept half the time once the first was, and so on.
    assert planner.chain([0.9, 0.5, 0.2], 3) == pytest.approx([0.9, 0.45, 0.09])
    assert planner.expected_tokens(planner.chain([0.9, 0.5, 0.2], 3)) == pytest.approx(2.44)


def test_a_small_trees_expected_tokens_and_rate_by_hand():
    # Two children of the root (0.6, 0.3) and a child of the first kept half the time it is reached (0.3).
    chances = [0.6, 0.3, 0.6 * 0.5]
    assert planner.expected_tokens(chances) == pytest.approx(2.2)
    costs = StepCosts()
    costs.observe(1, 0, 0.0, 0.2)
    costs.observe(1, 3, 0.3, 0.5, draft_steps=2)  # a 4-wide pass of 0.5 s; two forwards of 0.15 s
    tree = Offer.of_nodes(chances, forwards=2)
    assert (tree.tokens, tree.width, tree.forwards) == (pytest.approx(2.2), 3, 2)
    assert planner.round_seconds(costs, 1, 3, 2) == pytest.approx(2 * 0.15 + 0.5)
    assert planner.rate(costs, 1, [tree]) == pytest.approx(2.2 / 0.8)


def test_a_free_guess_pays_where_the_same_guess_drafted_does_not():
    costs = _costs(plain_s=0.2, per_token_s=0.1, forward_s=0.1)  # a pass of 4 tokens: 0.5 s
    tokens = 1 + 0.8 + 0.64 + 0.512
    free = Offer(tokens, width=3)  # lookup's: the guess is made, no forward
    drafted = Offer.of_chain(0.8, 3)
    assert drafted.tokens == pytest.approx(tokens) and (drafted.width, drafted.forwards) == (3, 3)
    assert planner.rate(costs, 1, [free]) == pytest.approx(tokens / 0.5)
    assert planner.rate(costs, 1, [drafted]) == pytest.approx(tokens / (3 * 0.1 + 0.5))
    plain = planner.rate(costs, 1)
    assert plain == pytest.approx(1 / 0.2)
    assert planner.rate(costs, 1, [free]) > plain > planner.rate(costs, 1, [drafted])
    # A proposer that timed its own forwards is priced by them instead.
    assert planner.rate(costs, 1, [drafted], forward_s=0.01) == pytest.approx(tokens / 0.53)


def test_a_batch_pass_is_padded_to_its_widest_row_after_its_deepest_rows_forwards():
    prices = RecordingPrices(draft_s=0.1, pass_s=0.5)
    # Three rows: a chain of 2 at 0.5, a free guess of 4 nodes, and a plain row.
    offers = [Offer.of_chain(0.5, 2), Offer(width=4)]
    assert planner.rate(prices, 3, offers) == pytest.approx((1.75 + 1 + 1) / (2 * 0.1 + 0.5))
    assert prices.asked == [("draft", 3), ("verify", 3, 5)]  # 4 nodes + the text's last token; forwards by 3 rows
    prices.asked.clear()
    # A tree 2 deep with 1.5 nodes beside its path is the widest: 3.5 nodes.
    planner.rate(prices, 3, [Offer.of_chain(0.5, 2, spread=1.5), Offer(width=3)])
    assert prices.asked[-1] == ("verify", 3, 4.5)
    prices.asked.clear()
    assert planner.rate(prices, 3) == pytest.approx(3 / 0.5) and prices.asked == [("verify", 3, 1)]  # no forward


def test_the_best_prefix_and_a_plain_step_by_hand():
    costs = _costs(plain_s=0.2, per_token_s=0.1)
    # 1 node: 1.9 tokens / 0.3 s; 2 nodes: 2.0 / 0.4 s; nothing: 1 / 0.2 s.
    assert planner.best_prefix(costs, [0.9, 0.1]) == (1, pytest.approx(1.9 / 0.3))
    assert planner.best_prefix(costs, [0.1], plain_step=True) == (0, pytest.approx(1 / 0.2))
    assert planner.best_prefix(costs, [0.1]) == (1, pytest.approx(1.1 / 0.3))  # a tree offers at least one node
    assert planner.best_prefix(_costs(), [0.9, 0.1, 0.05], max_nodes=2)[0] == 2  # a flat pass: all it may


def test_leviathans_speedup_is_the_planners_rate_in_target_steps():
    a, k, c = 0.7, 4, 0.1
    assert planner.leviathan_speedup(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))
    assert planner.leviathan_speedup(a, k, c) == planner.rate(FlatPrices(draft_s=c), 1, [Offer.of_chain(a, k)])
    assert planner.break_even_chance(FlatPrices(draft_s=0.05, pass_s=0.2), 1) == pytest.approx(0.25)


def test_filling_a_lagging_draft_pays_only_for_enough_tokens_to_come_by_hand():
    # 30 tok/s plain, 33 drafting: a token 3 ms cheaper (1/30 - 1/33 = 0.00303 s).
    saving = planner.saving_per_token(30.0, 33.0)
    assert saving == pytest.approx(1 / 30 - 1 / 33)
    assert planner.saving_per_token(30.0, 25.0) == 0.0 and planner.saving_per_token(0.0, 10.0) == 0.0
    # A 300-token prompt read at 2.5 ms a token (0.75 s): 96 tokens to come save 0.29 s, 512 save 1.55 s.
    assert not planner.catch_up_pays(saving, 96, 300 * 0.0025)
    assert planner.catch_up_pays(saving, 512, 300 * 0.0025)
    # 300 tokens to come would save 0.91 s, 1.2 times the reading: enough alone, not the margin a batch must clear.
    assert planner.catch_up_pays(saving, 300, 300 * 0.0025)
    assert not planner.catch_up_pays(saving, 300, 300 * 0.0025, margin=planner.CATCH_UP_MARGIN)
    assert planner.CATCH_UP_MARGIN * 0.75 > 300 * saving > 0.75
    assert not planner.catch_up_pays(0.0, 10_000, 0.0025)  # drafting saves nothing: never worth reading


# -- every choice asks it ----------------------------------------------------------------------------------------


def test_the_draft_length_is_the_k_the_planner_prices_highest(monkeypatch):
    policy = DraftLengthPolicy(costs=_costs())
    calls = spy(monkeypatch, "rate", lambda prices, rows, offers=(), forward_s=None:
                1.0 if offers[0].forwards == 2 else 0.5)
    assert policy.choose([0.7], k_max=4, rows=1) == 2  # whatever the real prices would say (a flat pass: 4)
    assert [offers[0].forwards for _, (_, _, offers), _ in calls] == [0, 1, 2, 3, 4]
    assert {module for module, _, _ in calls} == {"draftwise.adaptive"}
    # The rows beside it: one drafting its own 3 (as wide, as deep), one with a free guess of 5 nodes.
    calls.clear()
    policy.costs.observe(3, 3, 0.3, 0.5)  # (a shape of 3 rows measured: the policy prices it)
    policy.choose([0.7], k_max=1, rows=3, fixed=[3], free=[5])
    assert calls[0][1][2][1:] == [Offer(width=3, forwards=3), Offer(width=5)]
    stops = spy(monkeypatch, "break_even_chance", lambda prices, rows: 0.125)
    assert policy.stop_confidence(1) == 0.125 and stops


def test_lookups_depth_is_the_prefix_the_planner_prices_highest(monkeypatch):
    context = [1, 2, 3, 4, 5, 6, 7, 1, 2]  # (1, 2) was followed by 3, 4, 5, 6
    lookup = PromptLookupProposer(max_ngram=2)
    lookup.begin(context, None, torch.Generator())
    lookup.costs = _costs()  # a flat pass: every node pays
    assert lookup.free_round(context, 4) == 4
    calls = spy(monkeypatch, "best_prefix", lambda *args, **kwargs: (1, 1.0))
    assert lookup.free_round(context, 4) == 1
    assert lookup.propose(context, 4).token_ids == (3,)
    (module, args, kwargs), = calls
    assert module == "draftwise.proposers.prompt_lookup" and kwargs["plain_step"]
    assert args[1] == pytest.approx([0.5, 0.25, 0.125, 0.0625])  # a^d at lookup's prior 0.5


def test_a_trees_size_and_depth_are_what_the_planner_prices(monkeypatch):
    tree = GrownTree()
    nodes = tree.add_children(-1, torch.tensor([0.5, 0.3, 0.1, 0.05]).log(), torch.arange(4))
    sizing = TreeSizing(costs=_costs())
    sizing.forward_s = 0.01
    assert len(sizing.choose(tree, k=4, forwards=1)) == 4  # a flat pass: every node
    assert sizing.to_expand(tree, nodes[:1], forwards=1) == nodes[:1]
    calls = spy(monkeypatch, "best_prefix", lambda *args, **kwargs: (2, 1.0))
    assert len(sizing.choose(tree, k=4, forwards=1)) == 2
    assert calls[-1][0] == "draftwise.proposers.tree_growth" and calls[-1][2]["forward_s"] == 0.01
    spy(monkeypatch, "surplus", lambda tokens, seconds, at_rate: -1.0)
    assert sizing.to_expand(tree, nodes[:1], forwards=1) == []


def test_the_skip_plan_is_the_count_the_planner_prices_highest(monkeypatch):
    ids = tiny_tokenizer()("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    calls = spy(monkeypatch, "rate", lambda prices, rows, offers=(), forward_s=None: float(len(calls)))
    plan = measure_skip(HFBackend(tiny_model("llama", 0, 4)), ids, k=4)
    assert len(calls) == len(plan.candidates) >= 2
    assert list(plan.skip) == plan.candidates[-1]["skip"]  # the spy priced the last count highest
    for (module, (prices, rows, offers), _), candidate in zip(calls, plan.candidates):
        assert module == "draftwise.proposers.skip_calibration" and rows == 1 and offers[0].forwards == 4
        assert offers[0].tokens == pytest.approx(planner.chain_tokens(candidate["agreement"], 4), abs=1e-3)
        assert prices.draft(1) == pytest.approx(candidate["cost"], abs=1e-4)


def test_the_predicted_speedup_is_the_planners(monkeypatch):
    spy(monkeypatch, "leviathan_speedup", lambda a, k, c: 1.25)
    assert metrics.leviathan_speedup(0.5, 4, 0.1) == 1.25
    # Over rounds of mixed k: each round priced by the planner (rounds of 4 and plain steps, by hand).
    seconds = spy(monkeypatch, "round_seconds")
    assert metrics.leviathan_over_rounds(0.6, 0.2, 10, [5] * 4) == pytest.approx((2 + .6 + .36 + .216 + .1296) / 2.8)
    assert seconds


PROMPT = ("The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away. "
          "The quick brown fox")  # repeats itself: lookup finds matches


def _hybrid(monkeypatch, k: int) -> Engine:
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                             method="hybrid", compact_draft=False)
    monkeypatch.setattr(eng.draft_policy, "choose", lambda *args, **kw: k)
    return eng


def test_the_hybrids_pick_between_lookup_and_its_draft_asks_the_planner(monkeypatch):
    eng = _hybrid(monkeypatch, k=2)
    calls = spy(monkeypatch, "rate")
    eng.generate(PROMPT, max_new_tokens=40, num_draft_tokens=2, ignore_eos=True)
    picks = [args[2] for module, args, _ in calls if module == "draftwise.proposers.hybrid"]
    # Each pick prices lookup's free guess against the draft model's chain of k.
    forwards = {offers[0].forwards for offers in picks}
    assert 0 in forwards and 2 in forwards  # (1 near the end: k stops at the tokens left)


def test_the_hybrids_free_round_asks_the_planner_against_a_plain_step(monkeypatch):
    eng = _hybrid(monkeypatch, k=0)  # draft forwards never pay: every round is lookup's or plain
    calls = spy(monkeypatch, "rate")
    eng.generate(PROMPT, max_new_tokens=40, num_draft_tokens=4, ignore_eos=True)
    priced = [args[2] if len(args) > 2 else () for module, args, _ in calls if module == "draftwise.proposers.hybrid"]
    assert () in priced  # a plain step
    assert any(len(offers) == 1 and offers[0].forwards == 0 and offers[0].width > 0 for offers in priced)
