"""Speculation under a grammar (grammar.py): the mask on p at every verified position, drafts cut at a forbidden
guess, forced tokens drafted for free. Greedy output is the target alone under the same grammar, token for token,
for every method, alone and batched; sampled output follows the masked distribution."""
from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from conftest import input_batch, near_model, tiny_model, tiny_tokenizer, transformers_greedy
from draftwise import Engine
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.grammar import Grammar, GrammarCompiler
from draftwise.methods import TRAINED_HEAD, methods_needing
from draftwise.models import model_path
from draftwise.sampling import logits_to_probs
from draftwise.types import Draft
from stats_helpers import fit_pvalue
from test_sampling_e2e import trained_head

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"
NEW_TOKENS = 40
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
# The schema's language without free whitespace: a random model ends it in a few tokens (under the JSON schema it
# may write whitespace for ever), and its frame is forced text.
COMPACT = 'start: "{\\"color\\": \\"" COLOR "\\", \\"n\\": " DIGIT "}"\nCOLOR: "red" | "green" | "blue"\nDIGIT: /[0-9]/'
GRAMMARS = {"schema": lambda: Grammar.json_schema(SCHEMA), "compact": lambda: Grammar.lark(COMPACT)}
# (method, draft): a draft that is the target's twin, one near it, and the methods with no second model.
CASES = [("none", None), ("draft", "same"), ("draft", "near"), ("draft-tree", "near"), ("lookup", None),
         ("lookup-tree", None), ("hybrid", "near"), ("hybrid-tree", "near"), ("skip", None), ("hybrid-skip", None),
         ("head", None), ("hybrid-head", None)]


@functools.lru_cache(maxsize=None)
def model(seed=0):
    return tiny_model("qwen2", seed)


@functools.lru_cache(maxsize=None)
def engine(method, draft=None):
    drafts = {"same": lambda: model(0), "near": lambda: near_model("qwen2"), None: lambda: None}
    # (the sampling tests' head, trained for a sharper copy of this target: it drafts for this one all the same)
    head = {"head": str(trained_head())} if method in methods_needing(TRAINED_HEAD) else {}
    return Engine.from_models(model(), tiny_tokenizer(), draft_model=drafts[draft](), method=method,
                              compact_draft=False, **head)


@functools.lru_cache(maxsize=None)
def reference(grammar_name):
    """The target alone under the grammar: `none`, one token per pass."""
    return engine("none").generate(PROMPT, max_new_tokens=NEW_TOKENS, grammar=GRAMMARS[grammar_name]()).token_ids


def allowed_prefix(grammar: Grammar, token_ids: list[int]) -> int:
    return engine("none").grammars.constraint(grammar).allowed_prefix(token_ids)


@pytest.mark.parametrize("grammar_name", GRAMMARS)
def test_the_reference_is_constrained_and_differs_from_free_text(grammar_name):
    """The control for everything below: the grammar changes what the target writes, and what it writes obeys it."""
    ids = reference(grammar_name)
    free = transformers_greedy(model(), tiny_tokenizer()(PROMPT)["input_ids"], len(ids))
    assert ids != free[: len(ids)]
    assert allowed_prefix(GRAMMARS[grammar_name](), ids) == len(ids)
    assert allowed_prefix(GRAMMARS[grammar_name](), free) < len(free)


@pytest.mark.parametrize("jump_forward", [True, False], ids=["forced", "no-forced"])
@pytest.mark.parametrize("grammar_name", GRAMMARS)
@pytest.mark.parametrize("method,draft", CASES, ids=[f"{m}-{d}" if d else m for m, d in CASES])
def test_greedy_under_a_grammar_is_the_target_alone_under_it(method, draft, grammar_name, jump_forward):
    grammar = GRAMMARS[grammar_name]().with_jump_forward(jump_forward)
    result = engine(method, draft).generate(PROMPT, max_new_tokens=NEW_TOKENS, grammar=grammar)
    assert result.token_ids == reference(grammar_name)
    if grammar_name == "compact":  # a whole sentence of the grammar, ended by EOS
        assert result.finish_reason == "eos"
        value = json.loads(result.text)
        jsonschema.validate(value, SCHEMA)
    if method != "none" and jump_forward and grammar_name == "compact":
        assert result.stats.forced_tokens > 0  # the frame came as free drafts, and the target kept them
    if not jump_forward or method == "none":
        assert result.stats.forced_tokens == 0


def offered_rounds(eng, grammar: Grammar) -> list[tuple[list[int], tuple[int, ...]]]:
    """Each verified round's (text emitted before it, draft offered) for a fixed-k generation under the grammar."""
    rounds = []
    prompt_len = len(tiny_tokenizer()(PROMPT)["input_ids"])
    eng.round_observer = lambda seq, draft, verdict, times: rounds.append((seq.context[prompt_len:], draft.token_ids))
    try:
        eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, grammar=grammar, adaptive=False, num_draft_tokens=4)
    finally:
        eng.round_observer = None
    return rounds


def all_allowed(eng, grammar: Grammar, rounds) -> bool:
    for before, offered in rounds:
        constraint = eng.grammars.constraint(grammar)
        constraint.advance(before)
        if constraint.allowed_prefix(offered) < len(offered):
            return False
    return True


def test_a_draft_reaches_the_target_only_as_far_as_the_grammar_allows_it(monkeypatch):
    eng = engine("draft", "same")
    grammar = GRAMMARS["schema"]().with_jump_forward(False)
    assert all_allowed(eng, grammar, offered_rounds(eng, grammar))
    # Unguided, a draft's guesses still reach the target only as far as the grammar allows them (the cut)...
    monkeypatch.setattr("draftwise.proposers.draft_model.DraftModelProposer.follow_grammar", lambda self, g: None)
    unguided = engine("draft", "same")
    engine.cache_clear()
    assert all_allowed(unguided, grammar, offered_rounds(unguided, grammar))
    # ... and the control: uncut too, the twin's free-running guesses break the grammar (the mask rejects them).
    monkeypatch.setattr("draftwise.grammar.Constraint.shape", lambda self, draft, room: draft)
    assert not all_allowed(unguided, grammar, offered_rounds(unguided, grammar))


def test_a_draft_model_guided_by_the_grammar_keeps_to_it_and_its_guesses_are_kept(monkeypatch):
    """A twin of the target, its logits masked by the grammar as it drafts, guesses what the target keeps under the
    grammar: every guess kept, but for those after the end of text. Unguided, the same twin loses guesses to the
    grammar (cut before the pass)."""
    grammar = GRAMMARS["schema"]().with_jump_forward(False)
    options = dict(max_new_tokens=NEW_TOKENS, grammar=grammar, adaptive=False, num_draft_tokens=4)
    guided = engine("draft", "same").generate(PROMPT, **options)
    assert guided.token_ids == reference("schema") and guided.stats.acceptance_rate > 0.9
    monkeypatch.setattr("draftwise.proposers.draft_model.DraftModelProposer.follow_grammar", lambda self, g: None)
    engine.cache_clear()
    unguided = engine("draft", "same").generate(PROMPT, **options)
    engine.cache_clear()
    assert unguided.token_ids == reference("schema")
    assert unguided.stats.accepted < guided.stats.accepted / 2  # (its cut guesses never reach the pass)


@pytest.mark.parametrize("method,draft", [("draft", "near"), ("hybrid-tree", "near"), ("lookup", None)])
def test_a_batch_under_different_grammars_gives_each_the_target_alone(method, draft):
    eng = engine(method, draft)
    prompts = [PROMPT, "The quick brown fox", PROMPT + "    pivot", "for i in range(10):"]
    names = ["compact", "schema", None, "compact"]
    cfgs = [GenerationConfig.from_options(max_new_tokens=24 + 3 * i, grammar=GRAMMARS[n]() if n else None,
                                          method=["none", method][i % 2]) for i, n in enumerate(names)]
    got = run_batch(eng, prompts, cfgs)
    alone = engine("none")
    for prompt, cfg, tokens in zip(prompts, cfgs, got):
        want = alone.generate(prompt, max_new_tokens=cfg.max_new_tokens, grammar=cfg.grammar).token_ids
        assert tokens == want


def run_batch(eng, prompts: list[str], cfgs: list[GenerationConfig]) -> list[list[int]]:
    """Each prompt's new tokens, every sequence stepped in one batch to its end."""
    seqs = [eng.open_sequence(tiny_tokenizer()(p)["input_ids"], cfg) for p, cfg in zip(prompts, cfgs)]
    running = list(seqs)
    while running:
        for seq in running:
            while not seq.prefill_done:
                eng.prefill(seq)
        eng.step(running)
        for seq in [s for s in running if s.finish is not None]:
            eng.close_sequence(seq)
            running.remove(seq)
    return [seq.context[len(seq.prompt_ids):] for seq in seqs]


def test_a_seeded_sampled_request_under_a_grammar_repeats_alone_and_in_a_batch():
    eng = sharp_engine("draft")
    sampled = dict(max_new_tokens=20, temperature=1.0, seed=11, method="draft", num_draft_tokens=3)
    cfg = GenerationConfig.from_options(grammar=Grammar.lark(LETTERS), **sampled)
    alone = eng.generate(PROMPT, grammar=cfg.grammar, **sampled).token_ids
    others = [GenerationConfig.from_options(grammar=GRAMMARS["compact"](), **{**sampled, "seed": 5}),
              GenerationConfig.from_options(**{**sampled, "seed": 6})]
    batched = run_batch(eng, [PROMPT, "The quick brown fox", PROMPT], [cfg, *others])
    assert batched[0] == alone
    assert allowed_prefix(cfg.grammar, alone) == len(alone)
    assert batched[1] != batched[2]  # (the batch-mates went their own ways: a grammar, and none)


def test_masks_for_a_chain_and_a_tree_are_the_grammars_at_each_node():
    """Constraint.mask against an oracle that walks a fresh matcher down to each position."""
    eng = engine("none")
    grammar = Grammar.lark(COMPACT)
    frame = eng.grammars.constraint(grammar).forced()  # '{"color": "' in tokens
    tok = tiny_tokenizer()
    red, green, bad = tok("red")["input_ids"][0], tok("green")["input_ids"][0], tok("}")["input_ids"][0]
    chain = Draft(tuple(frame) + (red,))
    # A tree: the frame, then three children of its last node (two allowed, one not), one grandchild.
    parents = tuple(range(-1, len(frame) - 1)) + (len(frame) - 1,) * 3 + (len(frame),)
    tree = Draft(tuple(frame) + (red, green, bad, bad), parents=parents)
    vocab = eng.grammars.vocab
    for draft in (chain, tree):
        masked = eng.grammars.constraint(grammar).mask(torch.zeros(len(draft) + 1, vocab), draft)
        for at in range(len(draft) + 1):
            path = _path_to(draft, at)
            oracle = eng.grammars.constraint(grammar)
            if oracle.allowed_prefix(path) < len(path):
                continue  # under a forbidden guess: never read
            oracle.advance(path)
            allowed = {t for t in range(vocab) if oracle.allowed_prefix([t])}
            assert {t for t in range(vocab) if masked[at, t] == 0} == allowed, at
    assert len({t for t in range(vocab) if masked[len(frame) + 1, t] == 0}) < vocab  # (the mask does bite)


def _path_to(draft: Draft, at: int) -> list[int]:
    """The tokens from the root to pass position `at` (0: the root)."""
    if draft.parents is None:
        return list(draft.token_ids[:at])
    path, node = [], at - 1
    while node >= 0:
        path.append(draft.token_ids[node])
        node = draft.parents[node]
    return path[::-1]


def test_a_draft_is_cut_at_its_first_forbidden_guess_and_the_forced_text_follows():
    eng = engine("none")
    constraint = eng.grammars.constraint(Grammar.lark(COMPACT))
    frame = constraint.forced()  # '{"color": "' in tokens
    wrong = tiny_tokenizer()("}")["input_ids"][0]
    guess = (frame[0], frame[1], wrong, frame[2])
    assert constraint.shape(Draft(guess), room=2).token_ids == guess[:2]  # no room for more
    shaped = constraint.shape(Draft(guess), room=16)  # greedy: the forbidden guess goes, the frame's rest comes
    assert shaped.token_ids == tuple(frame) and shaped.forced == len(frame) - 2
    # Sampled, with the draft's own q: the forbidden guess stays (the residual needs it), nothing after it.
    q = torch.full((len(guess), eng.grammars.vocab), 1.0 / eng.grammars.vocab)
    sampled = constraint.shape(Draft(guess, q=q), room=16)
    assert sampled.token_ids == guess[:3] and sampled.forced == 0
    # Allowed throughout: the forced text after it, with one-hot q rows for the verifier.
    whole = constraint.shape(Draft(guess[:2], q=q[:2]), room=16)
    assert whole.token_ids == tuple(frame) and torch.equal(whole.q[2:].argmax(-1), torch.tensor(frame[2:]))
    off = eng.grammars.constraint(Grammar.lark(COMPACT).with_jump_forward(False))
    assert off.shape(Draft(guess), room=16).token_ids == guess[:2]


def test_a_tree_that_misses_the_forced_text_gives_way_to_it_and_one_that_holds_it_stays():
    """A tree's nodes past a missed forced token are all masked: the forced run, as a chain, keeps more. A tree
    that holds the whole run as a path stays as it is (its branches past the run may be kept too)."""
    eng = engine("none")
    constraint = eng.grammars.constraint(Grammar.lark(COMPACT))
    frame = constraint.forced()  # '{"color": "' in tokens
    tok = tiny_tokenizer()
    red, wrong = tok("red")["input_ids"][0], tok("}")["input_ids"][0]
    # The frame but its last token, which two children of the node before it miss.
    missing = Draft((*frame[:-1], wrong, red), parents=(*range(-1, len(frame) - 2), len(frame) - 2, len(frame) - 2))
    shaped = constraint.shape(missing, room=16)
    assert shaped.parents is None and shaped.token_ids == tuple(frame) and shaped.own == 0
    assert constraint.shape(missing, room=3).token_ids == tuple(frame[:3])
    # The whole frame as a path, beside a wrong root child, then two guesses after it: as it is.
    holding = Draft((wrong, *frame, red, wrong), parents=(-1, -1, *range(1, len(frame)), len(frame), len(frame)))
    assert constraint.shape(holding, room=16) is holding
    # Controls: without jump_forward, or where the grammar leaves a choice, the tree stays as it is.
    off = eng.grammars.constraint(Grammar.lark(COMPACT).with_jump_forward(False))
    assert off.shape(missing, room=16) is missing
    constraint.advance(frame)
    assert constraint.forced() == [] and constraint.shape(missing, room=16) is missing


def test_a_grammar_that_cannot_compile_is_refused_before_work():
    eng = engine("draft", "near")
    bad = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "frobnicate"}}})
    with pytest.raises(DraftwiseError, match="frobnicate"):
        eng.generate(PROMPT, max_new_tokens=4, grammar=bad)
    with pytest.raises(DraftwiseError, match="ignore_eos"):
        eng.generate(PROMPT, max_new_tokens=4, grammar=GRAMMARS["compact"](), ignore_eos=True)
    assert eng.target.open_slots == 1  # nothing was left open


# -- sampling: the masked distribution ----------------------------------------------------------------------------
RUNS = 400
LETTERS = "start: /[a-z ]+/"  # forbids much of what the sharpened model wants (digits, symbols, capitals)


@functools.lru_cache(maxsize=None)
def loop() -> list[int]:
    """A few words and the sharpened target's own greedy text after them under the grammar, which falls into a loop:
    prompt lookup's guesses there are in the grammar, and the target often keeps them."""
    base = tiny_tokenizer()("the cat sat on the")["input_ids"]
    return base + sharp_engine("none").generate(base, max_new_tokens=40, grammar=Grammar.lark(LETTERS)).token_ids


@functools.lru_cache(maxsize=None)
def sharp():
    target = tiny_model("qwen2", 0)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.5)  # mass on a few hundred pairs: a few hundred runs can test it
    return target


def masked_pairs(cfg: SamplingConfig, masked: bool = True) -> dict:
    """P(t1, t2) under the grammar: each step's logits masked (masked=False: the control, the target's own p)."""
    eng = engine("none")
    ids = loop()
    table = {}
    with torch.no_grad():
        constraint = eng.grammars.constraint(Grammar.lark(LETTERS))
        first_logits = sharp()(input_batch(ids)).logits[0, -1:]
        first = logits_to_probs(constraint.mask(first_logits, Draft(())) if masked else first_logits, cfg)[0]
        for t1 in torch.nonzero(first > 1e-4).flatten().tolist():
            logits = sharp()(input_batch(ids + [t1])).logits[0, -1:]
            if masked:
                after = eng.grammars.constraint(Grammar.lark(LETTERS))
                after.advance([t1])
                logits = after.mask(logits, Draft(()))
            second = logits_to_probs(logits, cfg)[0]
            for t2 in torch.nonzero(second * first[t1] > 1e-4).flatten().tolist():
                table[(t1, t2)] = float(first[t1] * second[t2])
    return table


@functools.lru_cache(maxsize=None)
def sharp_engine(method):
    draft = None if method in ("none", "lookup", "lookup-tree") else near_model("qwen2", noise=0.03)
    if draft is not None:
        with torch.no_grad():
            draft.lm_head.weight.mul_(2.5)
    return Engine.from_models(sharp(), tiny_tokenizer(), draft_model=draft, method=method, compact_draft=False)


@pytest.mark.parametrize("method", ["none", "draft", "lookup", "lookup-tree"])
def test_sampled_pairs_follow_the_masked_distribution(method):
    cfg = SamplingConfig(temperature=1.0)
    eng = sharp_engine(method)
    grammar = Grammar.lark(LETTERS)
    pairs, kept = [], 0
    for seed in range(RUNS):
        out = eng.generate(loop(), max_new_tokens=2, temperature=1.0, seed=seed, grammar=grammar,
                           num_draft_tokens=2, adaptive=False)
        pairs.append(tuple(out.token_ids[:2]))
        kept += out.stats.accepted
    assert method == "none" or kept > 0  # guesses were kept: the masked verification ran, not plain steps
    fit, control = fit_pvalue(pairs, masked_pairs(cfg)), fit_pvalue(pairs, masked_pairs(cfg, masked=False))
    assert fit > 1e-3
    assert control < 1e-6  # control: the unmasked p is not what ran


@pytest.mark.real_model
def test_an_added_token_the_grammar_refuses_is_never_emitted():
    """llguidance's mask allows Qwen's `<tool_call>` token where the grammar wants the text "<tool_call>", and its
    forced tokens name it, but its matcher refuses it: emitted, it would break the matcher. The mask leaves it out,
    and where nothing else is left, the text cannot go on: a clear error, not a token drawn from no choices."""
    tokenizer = AutoTokenizer.from_pretrained(model_path("qwen2.5-coder-0.5b-instruct"))
    compiler = GrammarCompiler(tokenizer, 151936, frozenset([151645]))
    at_tag = compiler.constraint(Grammar.lark('start: "<tool_call>" /[a-z]+/'))  # only that token spells it
    assert 151657 in at_tag._matcher.compute_ff_tokens()  # what llguidance itself forces there
    with pytest.raises(DraftwiseError, match=r"name it by id, <\[151657\]>"):
        at_tag.mask(torch.zeros(1, 151936), Draft(()))
    named = compiler.constraint(Grammar.lark('start: <[151657]> /[a-z]+/'))  # the token itself, by id: allowed
    assert named.mask(torch.zeros(1, 151936), Draft(()))[0, 151657] == 0
