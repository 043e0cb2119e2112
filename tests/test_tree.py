"""Token trees: the layout, the greedy and multi-candidate verifiers (with a control that must fail), the tree
pass of the backend against plain chains, the cache keeping only the kept path, and lookup's trees."""
from __future__ import annotations

import pytest
import torch
from conftest import decode_together, tiny_model, tiny_tokenizer, transformers_greedy

from draftwise import Engine
from draftwise.backends.hf import HFBackend
from draftwise.estimates import StepCosts
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.proposers.prompt_lookup import PromptLookupProposer, rank_nodes, token_tree
from draftwise.proposers.tree_growth import GrownTree, SizedTree, TreeSizing, grow
from draftwise.sampling import sample
from draftwise.types import Draft, TreeLayout, Verdict, chain_parents
from draftwise.verify import verify_greedy
from draftwise.verify.batch import DraftBatch, verify_batch
from draftwise.verify.tree import verify_tree_greedy, verify_tree_sampled
from stats_helpers import fit_pvalue

#        root
#       /    \
#     n0=3   n1=1
#     / \      \
#  n2=4 n3=0   n4=2
TOKENS, PARENTS = (3, 1, 4, 0, 2), (-1, -1, 0, 0, 1)


def gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_layout_has_depths_children_and_the_ancestor_mask():
    layout = TreeLayout.of(PARENTS)
    assert layout.depth == (0, 1, 1, 2, 2, 2) and layout.max_depth == 2
    assert layout.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert layout.visible[3].tolist() == [True, True, False, True, False, False]  # n2 sees root, n0, itself
    assert layout.visible[5].tolist() == [True, False, True, False, False, True]
    assert Draft(TOKENS, parents=PARENTS).depth == 2 and Draft((5, 6, 7)).depth == 3
    assert TreeLayout.of(chain_parents(3)).depth == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="parent"):
        TreeLayout.of((-1, 2, 0))


def test_greedy_follows_the_targets_argmax_through_the_tree():
    layout = TreeLayout.of(PARENTS)
    # target argmax per pass position: root -> 1 (n1), n1 -> 2 (n4), n4 -> 7
    assert verify_tree_greedy(TOKENS, layout, [1, 9, 2, 9, 9, 7]) == Verdict(2, 7, path=(1, 4))
    assert verify_tree_greedy(TOKENS, layout, [3, 0, 9, 9, 5, 9]) == Verdict(2, 5, path=(0, 3))
    assert verify_tree_greedy(TOKENS, layout, [8, 0, 0, 0, 0, 0]) == Verdict(0, 8, path=())
    draft = Draft(TOKENS, parents=PARENTS)
    assert draft.accepted(Verdict(2, 5, path=(0, 3))) == [3, 0]
    assert draft.as_chain(Verdict(1, 9, path=(0,))) == (3, 4)  # the kept path, then the first child after it


P = torch.tensor([  # [6, vocab 5]: the target's p at each pass position
    [0.2, 0.3, 0.1, 0.25, 0.15],
    [0.1, 0.1, 0.2, 0.2, 0.4],
    [0.5, 0.1, 0.1, 0.1, 0.2],
    [0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2],
])


def _first_two(verify, runs=6000):
    """(first, second) emitted token of many verifications, the second only when the first was kept."""
    layout, out = TreeLayout.of(PARENTS), []
    g = gen(1)
    for _ in range(runs):
        v = verify(TOKENS, layout, P, g)
        emitted = [TOKENS[n] for n in v.path] + [v.next_token]
        out.append(tuple(emitted[:2]) if v.path else (emitted[0], None))
    return out


def _expected_first_two():
    """The target's own: t1 ~ p[root]; after a kept guess, t2 ~ p at that node (n0 is position 1, n1 position 2);
    after a token the tree did not guess, no second token is emitted in this round."""
    table = {}
    for t1 in range(5):
        node = {3: 1, 1: 2}.get(t1)
        if node is None:
            table[(t1, None)] = float(P[0, t1])
        else:
            for t2 in range(5):
                table[(t1, t2)] = float(P[0, t1] * P[node, t2])
    return table


def test_multi_candidate_sampling_follows_the_target():
    assert fit_pvalue(_first_two(verify_tree_sampled), _expected_first_two()) > 1e-3


def _recovers_from_the_full_p(token_ids, layout, p, generator):
    """A broken rule: a rejected guess stays possible when the next token is drawn (no residual)."""
    at, path = 0, []
    while True:
        for child in layout.children[at]:
            if torch.rand(1, generator=generator).item() < float(p[at, token_ids[child - 1]]):
                path.append(child - 1)
                at = child
                break
        else:
            return Verdict(len(path), sample(p[at], generator), path=tuple(path))


def test_the_same_check_rejects_a_tree_rule_without_the_residual():
    assert fit_pvalue(_first_two(_recovers_from_the_full_p), _expected_first_two()) < 1e-6


def test_the_batch_verifier_gives_the_tree_verdicts():
    tree, chain = Draft(TOKENS, parents=PARENTS), Draft((2, 2))
    logits = torch.log(torch.cat([P, P[:3]]) + 1e-9)  # [6 + 3, vocab]
    greedy = verify_batch(DraftBatch.of([tree, chain]), logits, [SamplingConfig()] * 2, [gen(), gen()])
    assert greedy[0] == verify_tree_greedy(TOKENS, TreeLayout.of(PARENTS), P.argmax(-1).tolist())
    assert greedy[1] == verify_greedy([2, 2], logits[6:])  # the chain's rows follow the tree's
    sampled = verify_batch(DraftBatch.of([tree]), logits[:6], [SamplingConfig(temperature=1.0)], [gen(5)])
    assert sampled[0] == verify_tree_sampled(TOKENS, TreeLayout.of(PARENTS), torch.softmax(logits[:6], -1), gen(5))


def _backend(seed=0):
    return HFBackend(tiny_model("llama", seed=seed))


def test_a_tree_pass_scores_every_node_as_its_own_chain_would():
    backend = _backend()
    context = list(range(10, 30))
    tree = backend.open_slot()
    tree.prefill(context[:-1])
    rows = tree.backend.forward_batch([(tree, [context[-1], *TOKENS])], trees=[TreeLayout.of(PARENTS)])[0]
    layout = TreeLayout.of(PARENTS)
    for at in range(len(TOKENS) + 1):
        path, node = [], at
        while node:  # the pass positions from the root to `at`
            path.append(TOKENS[node - 1])
            node = next(up for up, kids in enumerate(layout.children) if node in kids)
        chain = backend.open_slot()
        chain.prefill(context[:-1])
        expected = chain.forward([context[-1], *reversed(path)])[-1]
        assert torch.allclose(rows[at], expected, atol=1e-4), at
        chain.close()


def test_keeping_a_path_leaves_the_cache_as_if_the_chain_had_been_fed():
    backend = _backend()
    context = list(range(10, 30))
    tree, chain = backend.open_slot(), backend.open_slot()
    for slot in (tree, chain):
        slot.prefill(context[:-1])
    base = len(context) - 1
    backend.forward_batch([(tree, [context[-1], *TOKENS])], trees=[TreeLayout.of(PARENTS)])
    tree.keep(base + 1, [base + 1 + node for node in (1, 4)])  # the path n1 -> n4
    tree.trim(base + 3)
    chain.forward([context[-1], TOKENS[1], TOKENS[4]])
    assert torch.allclose(tree.forward([7])[-1], chain.forward([7])[-1], atol=1e-4)


def test_lookup_merges_earlier_continuations_into_a_tree_within_the_budget():
    ranked = rank_nodes([(1, 2, 3, 4), (1, 2, 5, 6), (7, 8, 9, 9)])
    assert ranked[:4] == [((1,), 2), ((1, 2), 2), ((7,), 1), ((7, 8), 1)]  # shared nodes first, then the shallower
    assert token_tree(ranked[:4]) == Draft((1, 7, 2, 8), parents=(-1, -1, 0, 1))
    assert token_tree(rank_nodes([(1, 2, 3), (1, 2, 3)])) == Draft((1, 2, 3))  # agreeing continuations: a chain
    lookup = PromptLookupProposer(max_ngram=1, branches=3)
    lookup.begin([], SamplingConfig(), gen())
    draft = lookup.propose([5, 1, 5, 2, 5, 3, 5], k=2)  # "5" was followed by 1, 2 and 3
    assert sorted(draft.token_ids) == [2, 3] and draft.parents == (-1, -1)  # the two most recent, budget 2
    assert PromptLookupProposer(max_ngram=1).propose([5, 1, 5, 2, 5, 3, 5], k=2) == Draft((3, 5))


def _costs(per_extra_token: float) -> StepCosts:
    """Measured passes of one row: 0.2 s for one token, plus per_extra_token for each more."""
    costs = StepCosts()
    for width in (1, 3, 5, 9, 17, 25):
        costs.observe(1, width - 1, 0.0, 0.2 + per_extra_token * (width - 1))
    return costs


def test_a_tree_is_as_wide_as_pays_by_the_measured_costs():
    sizing = TreeSizing(max_nodes=24)
    probs = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01]  # the chance each node is kept, in offer order
    assert sizing.how_many(probs, k=3, forwards=0) == 3  # nothing measured: k nodes
    sizing.costs = _costs(0.0)  # a flat pass (bfloat16 on AVX-512 BF16): every node pays
    assert sizing.how_many(probs, k=3, forwards=0) == len(probs)
    sizing.costs = _costs(0.2)  # each token of width costs a plain step: only a likely node pays for its width
    assert sizing.how_many(probs, k=3, forwards=0) == 1  # 1.9 tokens for 0.4 s; a second: 2.7 for 0.6 s
    sizing.costs = _costs(0.02)
    assert 1 < sizing.how_many(probs, k=3, forwards=0) < len(probs)
    sizing.sized_by_cost = False  # a seeded sampled sequence: exactly k, whatever the costs
    assert sizing.how_many(probs, k=3, forwards=0) == 3


def test_a_tree_is_as_wide_as_pays_in_the_rows_of_its_step():
    """One row's pass is flat in width; four rows' turns dear (each node a position in every row's pass, padded): a
    tree priced at one row would be grown as wide in a batch, where it costs several plain steps."""
    costs = _costs(0.0)
    for width in (1, 3, 5, 9, 17, 25):
        costs.observe(4, width - 1, 0.0, 0.2 + 0.2 * (width - 1))
    sizing = TreeSizing(costs=costs, max_nodes=24)
    probs = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01]
    assert sizing.how_many(probs, k=3, forwards=0) == len(probs)  # (rows = 1 until told)
    proposer = SizedTree()  # (a tree proposer's part that speaks to its sizing)
    proposer.sizing = sizing
    proposer.prepare_round(3, rows=4)  # the engine, each round
    assert sizing.rows == 4 and sizing.how_many(probs, k=3, forwards=0) == 1


def _tree(*probs: float) -> tuple[GrownTree, list[int]]:
    """A tree of one depth: the text's candidates with these chances."""
    tree = GrownTree()
    return tree, tree.add_children(-1, torch.tensor(probs).log(), torch.arange(len(probs)))


def test_a_depth_is_grown_only_while_a_forward_can_pay_for_it():
    sizing = TreeSizing(costs=_costs(0.0))  # a flat pass, 0.2 s
    sizing.forward_s = 0.02
    sure, nodes = _tree(0.9, 0.05)
    # Expanding 0.9 adds at most 0.9 tokens for 0.02 s (45/s); the tree as it is gives 1.95 tokens in 0.24 s (8/s).
    assert sizing.to_expand(sure, nodes[:1], forwards=2)
    unsure, nodes = _tree(0.03, 0.02, 0.01)
    assert not sizing.to_expand(unsure, nodes, forwards=2)  # at most 0.06 tokens for 0.02 s: 3/s, below 4.4/s
    sizing.forward_s = 0.001  # a forward nearly free: even a doubtful depth pays
    assert sizing.to_expand(unsure, nodes, forwards=2)
    sizing.forward_s, sizing.sized_by_cost = 0.02, False  # a fixed k: k nodes, so grown to k whatever the costs
    assert sizing.to_expand(unsure, nodes, forwards=2)

    def grown(probs, sizing):
        expanded = []

        def expand(tree, nodes):
            expanded.append(nodes)
            return torch.tensor(probs).log().expand(len(nodes), -1), torch.arange(len(probs)).expand(len(nodes), -1)

        sizing.sized_by_cost = True
        grow((torch.tensor(probs).log(), torch.arange(len(probs))), 4, expand, sizing=sizing)
        return len(expanded)

    assert grown([0.95, 0.03], sizing) == 3  # a confident proposer: every depth up to k
    # Depths 2 and 3 may add 0.6 and 0.25 tokens (30/s, 12.5/s, against 7.3/s and 8.2/s); depth 4 0.08 (4/s, 8.1/s).
    assert grown([0.3, 0.2, 0.1], sizing) == 2
    assert grown([0.04, 0.03], sizing) == 0


def test_a_depth_expands_only_the_nodes_that_pay_for_their_rows_of_the_forward():
    sizing = TreeSizing(costs=_costs(0.0))  # a flat pass, 0.2 s
    sizing.forward_s = 0.02
    assert sizing.expansion_cost(1) == sizing.expansion_cost(4) == 0.02  # nothing timed by width: the mean forward
    sizing.time_expansion(4, 0.04)
    # Unmeasured widths are optimists: a narrower one in proportion, a wider one as the widest measured.
    assert sizing.expansion_cost(1) == pytest.approx(0.01) and sizing.expansion_cost(8) == 0.04
    sizing.time_expansion(1, 0.03)  # on a CPU a 4-row forward costs little more than a 1-row one
    assert sizing.expansion_cost(2) == pytest.approx(0.03 + (0.04 - 0.03) / 3)
    one_sure, nodes = _tree(0.9, 0.02, 0.01, 0.01)
    # The tree gives 1.94 tokens in 0.22 s (8.8/s): the sure node's row adds at most 0.9 tokens for 0.03 s; the
    # other three 0.04 for 0.01 s more, short of the 0.088 tokens those seconds earn at that rate.
    assert sizing.to_expand(one_sure, nodes, forwards=1) == nodes[:1]
    four_likely, nodes = _tree(0.4, 0.3, 0.2, 0.1)
    assert sizing.to_expand(four_likely, nodes, forwards=1) == nodes  # 0.6 tokens more for 0.01 s more
    sizing.time_expansion(4, 10.0)
    sizing.time_expansion(4, 10.0)  # (decayed: a 4-row forward now measured dear)
    assert sizing.to_expand(four_likely, nodes, forwards=1) == nodes[:1]
    sizing.sized_by_cost = False  # a fixed k: WIDTH nodes a depth, whatever the costs
    assert sizing.to_expand(four_likely, nodes, forwards=1) == nodes


def test_chances_count_as_far_as_the_target_bore_them_out():
    sizing = TreeSizing(costs=_costs(0.01))  # each token of width costs 5% of a step
    sizing.forward_s = 0.02
    sure, nodes = _tree(0.8, 0.1, 0.05)  # a proposer sure of its first guess
    assert sizing.trust(1) == 1.0 and sizing.choose(sure, k=3) == [0, 1]  # taken at its word: 0.8 and 0.1 pay
    for _ in range(20):
        sizing.choose(sure, k=3)
        sizing.observe(0)  # ... and wrong every time
    assert sizing.trust(1) < 0.15 and sizing.trust(2) == sizing.trust(1)  # depth 2 never offered: as depth 1
    assert sizing.choose(sure, k=3) == [0]  # 0.1 and 0.05 now claim 0.015 and 0.008, short of their width's price
    assert not sizing.to_expand(sure, nodes[:1], forwards=2)  # nor is a deeper guess worth its forward
    for _ in range(40):
        sizing.choose(sure, k=3)
        sizing.observe(1)  # right every time: trusted again, never beyond its own word
    assert sizing.trust(1) == 1.0 and sizing.trust(2) == 1.0
    assert sizing.choose(sure, k=3) == [0, 1]


def test_a_depth_that_did_badly_is_grown_again_once_it_has_gone_unoffered_for_a_while():
    # Only offered depths are measured: without a way back, a depth once found bad is never grown again.
    sizing = TreeSizing(costs=_costs(0.0))  # a flat pass, 0.2 s
    sizing.forward_s = 0.02
    two_deep = GrownTree()
    two_deep.add_children(two_deep.add_children(-1, torch.tensor([0.9]).log(), torch.tensor([0]))[0],
                          torch.tensor([0.5]).log(), torch.tensor([1]))  # chances 0.9 and 0.45
    for _ in range(20):
        assert sizing.choose(two_deep, k=2) == [0, 1]
        sizing.observe(1)  # depth 1 kept, depth 2 never (a prompt the draft could not follow that far)
    assert sizing.trust(1) == 1.0 and sizing.trust(2) < 0.05
    one_deep, nodes = _tree(0.9)
    assert not sizing.to_expand(one_deep, nodes, forwards=1)  # 0.9 x trust(2) tokens: not worth 0.02 s
    for rounds in range(1, 31):  # depth 2 goes unoffered while depth 1 keeps being right
        sizing.choose(one_deep, k=1)
        sizing.observe(1)
        if rounds == 10:
            assert 0.5 < sizing.trust(2) < 0.8  # fading back to depth 1's trust
    assert sizing.trust(2) > 0.95 and sizing.to_expand(one_deep, nodes, forwards=1)
    sizing.choose(two_deep, k=2)
    sizing.observe(1)  # grown, offered and measured again: the fresh miss counts at once
    assert sizing.trust(2) < 0.05


def test_lookup_tree_widens_only_where_a_wider_pass_pays():
    context = [5, 1, 6, 5, 2, 7, 5, 3, 8, 5]  # "5" was followed by 1 6, 2 7 and 3 8: 6 nodes at k = 2
    for per_extra_token, nodes in ((0.0, 6), (0.2, 0)):  # (0: a plain step gives more than any of them)
        lookup = PromptLookupProposer(max_ngram=1, branches=3, trusted_ngram=1)
        lookup.begin([], SamplingConfig(), gen())
        lookup.sizing.costs = _costs(per_extra_token)
        assert len(lookup.propose(context, k=2)) == nodes
    lookup.sizing.sized_by_cost = False
    assert len(lookup.propose(context, k=2)) == 2


def test_lookup_tree_drops_side_branches_the_target_does_not_bear_out():
    """Every guess's side branches are judged at the next one, offered or not: where the target goes on as the
    most recent occurrence did, the tree shrinks to that chain."""
    context = [5, 1, 6, 5, 2, 7, 5, 3, 8, 5]
    lookup = PromptLookupProposer(max_ngram=1, branches=3, trusted_ngram=1)
    lookup.begin([], SamplingConfig(), gen())
    lookup.sizing.costs = _costs(0.01)
    assert lookup.propose(context, k=2) == Draft((3, 2, 1, 8), parents=(-1, -1, -1, 0))  # the chain 3 8, and 2, 1
    for _ in range(5):
        lookup.propose(context + [3], k=2)  # judges the last guess: the target went on with the chain's 3
        lookup.propose(context, k=2)  # (a shorter text is a new one: nothing to judge)
    assert lookup.propose(context, k=2) == Draft((3, 8))


@pytest.mark.parametrize("method", ["lookup", "lookup-tree"])
def test_lookup_judging_its_own_rounds_gives_the_targets_greedy_output_alone_and_in_a_batch(method):
    """Adaptive (the default): each round priced by lookup itself, after its free guess, in a batch by its rows."""
    prompts = ["the cat and the dog and the fox and the", "print(i) print(j) print(k) print("]
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method=method, lookup_max_ngram=1)
    eng.proposer.trusted_ngram = 1  # (one-token tails recur here: let them be offered from the start)
    alone = eng.generate(prompts[0], max_new_tokens=40, ignore_eos=True)
    assert alone.token_ids == _reference(prompts[0], 40) and alone.stats.proposed > 0
    seqs = decode_together(eng, [eng.tokenizer.encode(p) for p in prompts],
                           GenerationConfig.from_options(max_new_tokens=40, ignore_eos=True))
    assert [seq.context[len(seq.prompt_ids):] for seq in seqs] == [_reference(p, 40) for p in prompts]
    assert all(seq.stats.proposed > 0 for seq in seqs)


@pytest.mark.parametrize("method", ["lookup", "lookup-tree"])
def test_a_fixed_k_lookup_offers_exactly_k_whatever_the_engine_measured(method):
    """A request that drafts a fixed k (adaptive off) drafts it: its rounds must not follow timings."""
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method=method, lookup_max_ngram=1)
    prompt = "a b c a b d a b e a b f a b"
    eng.generate(prompt, max_new_tokens=8, ignore_eos=True)  # an adaptive request: passes get timed
    assert eng.draft_policy.costs.measured
    seq = eng.open_sequence(eng.tokenizer.encode(prompt), GenerationConfig.from_options(
        max_new_tokens=8, temperature=1.0, num_draft_tokens=3, adaptive=False))
    assert eng.lengths.choose([seq]) == [3]
    assert len(seq.proposer.propose(seq.context, 3)) == 3
    eng.close_sequence(seq)


def test_a_lookup_guess_armed_for_a_round_goes_no_further():
    costs = _costs(0.0)
    lookup = PromptLookupProposer(max_ngram=1, trusted_ngram=1)
    lookup.costs = costs
    lookup.begin([], SamplingConfig(), gen())
    assert lookup.free_round([5, 1, 6, 5], k=2) == 2  # armed: (1, 6)
    lookup.begin([], SamplingConfig(), gen())  # a new sequence before the round ran
    assert lookup.propose([7, 2, 7], k=2) == Draft((2, 7))  # its own guess, not the armed one


def _reference(prompt, n):
    return transformers_greedy(tiny_model("llama", 0), tiny_tokenizer()(prompt)["input_ids"], n)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_lookup_tree_gives_the_targets_greedy_output_alone_and_in_a_batch(k):
    prompts = ["the cat and the dog and the fox and the", "print(i) print(j) print(k) print("]
    # One-token tails: they recur with different continuations, so trees branch often.
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="lookup-tree", lookup_max_ngram=1)
    cfg_options = dict(max_new_tokens=40, ignore_eos=True, num_draft_tokens=k, adaptive=False)
    alone = eng.generate(prompts[0], **cfg_options)
    assert alone.token_ids == _reference(prompts[0], 40)
    assert alone.stats.nodes > alone.stats.proposed  # some rounds drafted a tree with branches
    seqs = decode_together(eng, [eng.tokenizer.encode(p) for p in prompts], GenerationConfig.from_options(**cfg_options))
    assert [seq.context[len(seq.prompt_ids):] for seq in seqs] == [_reference(p, 40) for p in prompts]
