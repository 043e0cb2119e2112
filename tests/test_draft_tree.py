"""Method draft-tree: the draft model grows a token tree, a depth per forward. The backend's tree that continues
in the slot, greedy identity (alone, adaptive, in a batch), and the draft cache holding exactly the accepted
text after every round, a failed one included."""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import near_model, tiny_model, tiny_tokenizer, transformers_greedy

from draftwise import Engine
from draftwise.adaptive import DraftLengthPolicy
from draftwise.backends.hf import HFBackend, SlotView
from draftwise.config import GenerationConfig
from draftwise.proposers.tree_growth import TreeSizing
from draftwise.types import TreeLayout

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"
NEW_TOKENS = 40
ARCHS = ["llama", "qwen2", "mistral-sliding"]


@functools.lru_cache(maxsize=None)
def model(arch, seed, layers=2):
    return tiny_model(arch, seed, layers)


def drafts(arch):
    return {"same": model(arch, 0), "unrelated": model(arch, 1, 1), "near": near_model(arch)}


@functools.lru_cache(maxsize=None)
def reference(arch, prompt=PROMPT, n=NEW_TOKENS):
    """The target's own greedy tokens, from transformers' generate: an independent implementation."""
    ids = tiny_tokenizer()(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    return transformers_greedy(model(arch, 0), ids, n)


def engine(arch, draft, **options):
    options.setdefault("compact_draft", False)  # a "same" draft stays an exact twin
    return Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=drafts(arch)[draft], method="draft-tree",
                              **options)


# -- the backend: a tree that continues in the slot ----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
def test_a_tree_grown_a_depth_per_forward_scores_every_node_as_its_own_chain(arch):
    # Depth 1: a, b under the root; depth 2: c under a, d under b, fed in a second forward that must not see
    # b from c or a from d. 30 tokens of text: past mistral's window of 16, which counts depths, not slots.
    backend = HFBackend(model(arch, 0))
    text = list(range(10, 40))
    tree = backend.open_slot()
    tree.prefill(text)  # the root (the text's last token) is cached, as after a round's first draft forward
    a, b, c, d = 5, 6, 7, 8
    level1 = backend.forward_batch([(tree, [a, b])], trees=[TreeLayout.of((-1, -1))])[0]  # [2, vocab]
    level2 = backend.forward_batch([(tree, [c, d])], trees=[TreeLayout.of((-1, -1, 0, 1))])[0]
    for row, path in [(level1[0], [a]), (level1[1], [b]), (level2[0], [a, c]), (level2[1], [b, d])]:
        chain = backend.open_slot()
        chain.prefill(text)
        assert torch.allclose(row, chain.forward(path)[-1], atol=1e-4), path
        chain.close()


def test_a_tree_longer_than_the_slot_is_refused():
    backend = HFBackend(model("llama", 0))
    slot = backend.open_slot()
    slot.prefill([1])
    with pytest.raises(ValueError, match="tree"):
        backend.forward_batch([(slot, [5])], trees=[TreeLayout.of((-1, 0, 1))])  # 2 positions behind, 1 cached


# -- greedy identity -----------------------------------------------------------------------------------------------
def _watch_rounds(eng):
    """Every verified round's (draft, verdict, k that round could draft at most)."""
    rounds = []

    def observe(seq, draft, verdict, _times):
        rounds.append((draft, verdict, min(seq.cfg.num_draft_tokens, seq.remaining - 1)))

    eng.round_observer = observe
    return rounds


def _greedy_chain_kept(draft, verdict) -> bool:
    """Whether the kept path is the draft's own top choice at every node, as deep as the tree has it (a node's
    first child is its likeliest)."""
    parents = draft.parents or tuple(range(-1, len(draft) - 1))
    chain, at = [], -1
    while (child := next((n for n, p in enumerate(parents) if p == at), None)) is not None:
        chain.append(child)
        at = child
    return list(verdict.path if verdict.path is not None else range(verdict.num_accepted)) == chain


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["same", "unrelated"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_the_targets_own(arch, draft, k):
    eng = engine(arch, draft)
    rounds = _watch_rounds(eng)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(arch)
    assert result.finish_reason == "length" and result.stats.new_tokens == NEW_TOKENS
    assert all(len(d) == cap for d, _, cap in rounds)  # a fixed k: exactly k nodes (timings move nothing)
    if draft == "same":  # a twin of the target: its top choice is always the target's
        assert all(_greedy_chain_kept(d, v) for d, v, _ in rounds)
        if k <= 4:  # (deeper, the tree's deepest node may sit off the top-choice chain, which is then shorter)
            assert result.stats.acceptance_rate == 1.0
        if k > 1:
            assert result.stats.nodes > result.stats.proposed  # trees with branches, not chains
    if draft == "unrelated":
        assert result.stats.acceptance_rate < 0.3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["same", "near"])
def test_adaptive_trees_and_a_compact_draft_keep_the_targets_output(arch, draft):
    # What users run: k and the tree's size chosen from measured costs, an int8 draft over 200 tokens.
    eng = engine(arch, draft, compact_draft=True, draft_vocab=200)
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=8, ignore_eos=True)
    assert result.token_ids == reference(arch)
    assert result.stats.new_tokens == NEW_TOKENS


def _draft_k_max_always(monkeypatch):
    """The engine's policy pinned: every round drafts k_max, with no confidence stop."""
    monkeypatch.setattr(DraftLengthPolicy, "choose", lambda self, rates, k_max, *args, **kw: k_max)
    monkeypatch.setattr(DraftLengthPolicy, "stop_confidence", lambda self, rows: 0.0)


@pytest.mark.parametrize("forward_s, deep", [(10.0, False), (1e-9, True)])
def test_a_depth_is_drafted_only_while_a_forward_can_pay(monkeypatch, forward_s, deep):
    # Timings pinned: draft forwards dearer than any depth could give stop at the root's candidates; free ones
    # grow every round to k. Either way the output is the target's. (The tiny draft costs what its target does,
    # so the engine's own policy would rarely draft: k is pinned too.)
    monkeypatch.setattr(TreeSizing, "time_forwards", lambda self, seconds, forwards: setattr(self, "forward_s", forward_s))
    monkeypatch.setattr(TreeSizing, "time_expansion", lambda self, nodes, seconds: None)  # every width: forward_s
    _draft_k_max_always(monkeypatch)
    eng = engine("llama", "near")
    proposer, grown = eng.proposer, []
    real_finish = proposer.finish

    def finish():  # each round's k and the draft forwards it ran
        grown.append((proposer._k, proposer._forwards))
        return real_finish()

    proposer.finish = finish
    result = eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert result.token_ids == reference("llama")
    assert grown[0] == (4, 4)  # nothing timed yet: grown to k
    assert all(forwards == (depth if deep else 1) for depth, forwards in grown[1:])  # else the root's forward alone


@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
def test_a_depth_expands_only_the_nodes_whose_rows_pay_and_the_output_and_cache_stay_exact(monkeypatch, arch):
    # Widths priced so that only the likeliest node of a depth pays for its row (a chain in all but the root's
    # siblings): every depth's forward feeds one node, kept paths still land in the cache, the output is the target's.
    monkeypatch.setattr(TreeSizing, "time_forwards", lambda self, seconds, forwards: setattr(self, "forward_s", 1e-9))
    monkeypatch.setattr(TreeSizing, "expansion_cost", lambda self, nodes: 1e-9 if nodes == 1 else 10.0)
    _draft_k_max_always(monkeypatch)
    widths = []
    monkeypatch.setattr(TreeSizing, "time_expansion", lambda self, nodes, seconds: widths.append(nodes))
    eng = engine(arch, "near")
    seq = _open(eng, PROMPT, num_draft_tokens=4)
    while seq.finish is None:
        eng.step([seq])
        assert_draft_holds_text(seq.proposer, seq.context, near_model(arch))
    assert seq.context[len(seq.prompt_ids):] == reference(arch)
    assert widths[:3] == [4, 4, 4]  # the first round, nothing timed yet: k depths, WIDTH nodes each
    assert widths[3:] and set(widths[3:]) == {1}
    eng.close_sequence(seq)


def test_k_1_and_a_one_token_prompt():
    prompt = tiny_tokenizer()(PROMPT)["input_ids"][:1]
    for k in (1, 3):
        result = engine("llama", "near").generate(prompt, max_new_tokens=12, num_draft_tokens=k, ignore_eos=True,
                                                  adaptive=False)
        assert result.token_ids == reference("llama", tuple(prompt), 12)


# -- the draft cache -----------------------------------------------------------------------------------------------
def assert_draft_holds_text(proposer, context, draft_model):
    """The draft slot holds exactly proposer._cached, a prefix of the text, with a fresh prefill's keys there."""
    backend = proposer.backend
    shared, slot = (backend.backend, backend.slot) if isinstance(backend, SlotView) else (backend, backend.default.slot)
    cached = proposer._cached
    assert slot.length == len(cached)
    assert cached == context[: len(cached)] and len(cached) <= len(context)  # nothing ahead of the text
    if not cached:
        return
    fresh = HFBackend(draft_model)
    fresh.prefill(cached)
    for got, want in zip(shared.cache.export(slot, len(cached)), fresh.cache.export(fresh.default.slot, len(cached))):
        for layer_got, layer_want in zip(got, want):
            assert torch.allclose(layer_got, layer_want, atol=1e-4)


def _record_moves(proposer):
    """Whether each keep_path moved entries from elsewhere than right after the text (a sibling's path)."""
    moves, keep = [], proposer.backend.keep

    def recording(start, sources):
        moves.append(sources != list(range(start, start + len(sources))))
        keep(start, sources)

    proposer.backend.keep = recording
    return moves


def _open(eng, prompt, **options):
    cfg = GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, ignore_eos=True, **options)
    seq = eng.open_sequence(tiny_tokenizer()(prompt)["input_ids"], cfg)
    while not seq.prefill_done:
        eng.prefill(seq)
    eng.catch_up_draft(seq)
    return seq


@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_the_draft_cache_holds_exactly_the_accepted_text_after_every_round(arch, adaptive):
    eng = engine(arch, "near")
    seq = _open(eng, PROMPT, num_draft_tokens=4, adaptive=adaptive)
    moves = _record_moves(seq.proposer)
    while seq.finish is None:
        eng.step([seq])
        assert_draft_holds_text(seq.proposer, seq.context, near_model(arch))
    assert seq.context[len(seq.prompt_ids):] == reference(arch)
    if not adaptive:  # (adaptive rounds here mostly draft depth 1: nothing fed to keep)
        assert any(moves)  # some kept path ran through a sibling, moved into place
    eng.close_sequence(seq)


def test_a_round_that_fails_leaves_only_the_text_in_the_draft_cache(monkeypatch):
    eng = engine("llama", "near")
    # The verification fails after the tree was grown in the draft cache.
    seq = _open(eng, PROMPT, num_draft_tokens=4, adaptive=False)
    eng.step([seq])
    forward_batch = eng.target.forward_batch

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(eng.target, "forward_batch", boom)
    events = eng.step([seq])[seq]
    assert events[-1].finish_reason == "error" and "boom" in seq.error
    assert_draft_holds_text(seq.proposer, seq.context, near_model("llama"))
    monkeypatch.setattr(eng.target, "forward_batch", forward_batch)
    eng.close_sequence(seq)

    # The draft fails halfway up the tree (its second forward, the first tree one).
    seq = _open(eng, PROMPT, num_draft_tokens=4, adaptive=False)
    shared = _draft_model_of(seq)
    draft_forward = shared.forward_batch

    def failing(rows, *args, trees=None, **kwargs):
        if trees is not None:
            raise RuntimeError("draft boom")
        return draft_forward(rows, *args, trees=trees, **kwargs)

    monkeypatch.setattr(shared, "forward_batch", failing)
    events = eng.step([seq])[seq]
    assert events[-1].finish_reason == "error" and "draft boom" in seq.error
    assert_draft_holds_text(seq.proposer, seq.context, near_model("llama"))
    eng.close_sequence(seq)


# -- batches -------------------------------------------------------------------------------------------------------
PROMPTS = [PROMPT, "The quick brown fox jumps over", "for i in range(10):\n    print("]


@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_batch_of_tree_and_chain_sequences_gives_each_its_greedy_output(arch, adaptive):
    # Tree sequences grow their trees in lockstep, one batched draft forward per depth, beside a chain sequence.
    eng = engine(arch, "near")
    methods = ["draft-tree", "draft-tree", "draft"]
    seqs = [_open(eng, p, num_draft_tokens=k, adaptive=adaptive, method=m)
            for p, k, m in zip(PROMPTS, (4, 2, 3), methods)]
    while any(seq.finish is None for seq in seqs):
        live = [seq for seq in seqs if seq.finish is None]
        eng.step(live)
        for seq in live:
            assert_draft_holds_text(seq.proposer, seq.context, near_model(arch))
    for seq, prompt in zip(seqs, PROMPTS):
        assert seq.finish == "length"
        assert seq.context[len(seq.prompt_ids):] == reference(arch, prompt)
        eng.close_sequence(seq)


def test_tree_sequences_in_a_batch_share_each_draft_forward(monkeypatch):
    # Each depth of every tree goes in one batched draft forward, beside the chain sequence's row: a step runs as
    # many draft forwards as its deepest round, not one per sequence per depth.
    eng = engine("llama", "near")
    seqs = [_open(eng, p, num_draft_tokens=4, adaptive=False, method=m)
            for p, m in zip(PROMPTS, ["draft-tree", "draft-tree", "draft"])]
    shared = _draft_model_of(seqs[0])
    calls = []
    real = shared.forward_batch

    def counting(rows, *args, trees=None, **kwargs):
        calls.append([t is not None for t in trees] if trees else [False] * len(rows))
        return real(rows, *args, trees=trees, **kwargs)

    monkeypatch.setattr(shared, "forward_batch", counting)
    eng.step(seqs)
    assert len(calls) == 4  # the roots (and the chain's first token), then three depths
    assert calls[0] == [False, False, False] and all(call[:2] == [True, True] for call in calls[1:])
    for seq in seqs:
        assert_draft_holds_text(seq.proposer, seq.context, near_model("llama"))
    for seq in seqs:
        eng.close_sequence(seq)


def test_a_failed_shared_tree_forward_ends_only_the_rounds_in_it_and_leaves_each_draft_at_its_text(monkeypatch):
    eng = engine("llama", "near")
    seqs = [_open(eng, p, num_draft_tokens=3, adaptive=False) for p in PROMPTS[:2]]
    shared = _draft_model_of(seqs[0])
    real = shared.forward_batch

    def failing(rows, *args, trees=None, **kwargs):
        if trees is not None:
            raise RuntimeError("draft boom")
        return real(rows, *args, trees=trees, **kwargs)

    monkeypatch.setattr(shared, "forward_batch", failing)
    events = eng.step(seqs)
    for seq in seqs:
        assert events[seq][-1].finish_reason == "error" and "draft boom" in seq.error
        assert_draft_holds_text(seq.proposer, seq.context, near_model("llama"))
        eng.close_sequence(seq)


def _draft_model_of(seq) -> HFBackend:
    backend = seq.proposer.backend
    return backend.backend if isinstance(backend, SlotView) else backend
