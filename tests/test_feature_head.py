"""The feature head: training on a tiny model raises validation accuracy above chance, a trained head's token
trees keep the target's greedy output (alone, in a batch, for several k and architectures) and its sampled
distribution, the trees are sized by the measured costs, and bad heads are refused with a clear error."""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, cpu_kernels, decode_together, tiny_model, tiny_tokenizer, transformers_greedy

from draftwise import Engine
from draftwise.adaptive import DraftLengthPolicy
from draftwise.estimates import StepCosts
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.proposers.feature_head import HeadProposer, attention_window
from draftwise.proposers.head_model import CONFIG_FILE, WEIGHTS_FILE, FeatureHead, load_head, readout_ids
from draftwise.proposers.hybrid import HybridProposer
from draftwise.proposers.tree_growth import GrownTree, TreeSizing
from draftwise.train.answers import target_answers
from draftwise.train.as_run import GAP_WARNING
from draftwise.train.head import (CHECKPOINT_FILE, TrainConfig, _held_back, attention_window_of, frequent_tokens,
                                  readout_cover, train_head)
from draftwise.types import Draft

# Imported before any test here patches kernels.plan_kernels: loading imports compact, which binds plan_kernels by
# name, so a first import under such a patch would keep it for every later test in the process (a GPU run's workers
# built compact drafts on int8 after the int8 tests below had imported it).
from draftwise import loading  # noqa: F401

# A request like the training ones (the head learns the target's features inside its answers), not one of them.
PROMPT = [{"role": "user", "content": "def quicksort(arr):\n    if len(arr) <= 1:"}]
NEW_TOKENS = 40
TINY = TrainConfig(seq_len=64, epochs=4, lr=5e-3, warmup_steps=5, intermediate_size=64, readout=300,
                   checkpoint_every=20)


def requests() -> list[tuple[str, list[dict]]]:
    """Pieces of the test corpus's sentences as requests: many different contexts for the tiny target to answer."""
    texts = sorted({text[start:start + n] for text in CORPUS for start in range(0, len(text) - 20, 3) for n in (12, 30)})
    return [(f"request {i}", [{"role": "user", "content": text}])
            for i, text in enumerate(texts) if text != PROMPT[0]["content"]]


@functools.lru_cache(maxsize=None)
def answers(arch: str) -> list:
    return target_answers(tiny_model(arch, 0), tiny_tokenizer(), requests(), max_new_tokens=48, batch_size=32,
                          progress=False)


@functools.lru_cache(maxsize=None)
def trained(arch: str, tmp_root: str) -> tuple[Path, dict]:
    """A head trained on the tiny target's own greedy answers (what it will draft for)."""
    out = Path(tmp_root) / arch
    record = train_head(tiny_model(arch, 0), tiny_tokenizer(), out, TINY, progress=False, pieces=answers(arch),
                        log=lambda _: None)
    return out, record


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("heads"))
    return lambda arch="qwen2": trained(arch, root)


def prompt_ids() -> list[int]:
    return tiny_tokenizer().apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True, return_dict=False)


def reference(arch: str) -> list[int]:
    """The target's own greedy tokens, from transformers' generate."""
    return transformers_greedy(tiny_model(arch, 0), prompt_ids(), NEW_TOKENS)


def head_engine(arch: str, folder: Path, method: str = "head") -> Engine:
    return Engine.from_models(tiny_model(arch, 0), tiny_tokenizer(), method=method, head=str(folder))


# -- training ----------------------------------------------------------------------------------------------
def test_training_lifts_validation_accuracy_far_above_chance_and_saves_a_small_head(heads):
    folder, record = heads()
    chance = 1 / 300  # the readout covers the tiny vocabulary
    before, after = record["val_before"], record["val_after"][-1]
    assert before["top1"] < 5 * chance
    assert after["top1"] > 0.3 and after["top1"] > 20 * chance
    assert after["top3"] >= after["top1"] and after["top1_depth2"] > 0.2
    assert [epoch["top1"] for epoch in record["val_after"]] == sorted(epoch["top1"] for epoch in record["val_after"])
    assert (folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file()
    head, ids = load_head(folder)
    assert head.config.training["val_after"] == record["val_after"]  # the record travels with the weights
    assert len(ids) == head.config.readout_size
    assert record["readout_cover"] == 1.0  # the readout spans the tiny vocabulary
    assert not list(folder.glob("*.partial")) and not list((folder / "features").glob("*.partial"))


def test_a_fused_head_reads_a_lower_layer_too_learns_and_keeps_the_targets_output(tmp_path):
    # EAGLE-3's fusion: the first decoder layer's output beside the last hidden state, brought down to H.
    fused = replace(TINY, feature_layers=(0,))
    out = tmp_path / "fused"
    record = train_head(tiny_model("qwen2", 0), tiny_tokenizer(), out, fused, progress=False, pieces=answers("qwen2"),
                        log=lambda _: None)
    assert record["val_after"][-1]["top1"] > 0.3 and (out / "features-0").is_dir()
    head, _ = load_head(out)
    assert head.config.feature_layers == (0,) and head.reduce.in_features == 2 * head.config.hidden_size
    for method in ("head", "hybrid-head"):
        engine = head_engine("qwen2", out, method)
        assert engine.target.feature_layers == (0,)  # the target hands the head both layers' features
        result = engine.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
        assert result.token_ids == reference("qwen2") and result.stats.accepted > 0
    config = json.loads((out / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps({**config, "feature_layers": [5]}))
    with pytest.raises(DraftwiseError, match=r"reads decoder layers \[5\]; this target has 2 decoder layers"):
        head_engine("qwen2", out)
    with pytest.raises(ValueError, match="decoder layers are 0 to 1"):
        train_head(tiny_model("qwen2", 0), tiny_tokenizer(), tmp_path / "bad", replace(TINY, feature_layers=(2,)),
                   progress=False, pieces=answers("qwen2"), log=lambda _: None)


def test_a_head_without_the_current_token_as_trained_before_it_learns_and_keeps_the_targets_output(heads, tmp_path):
    out = tmp_path / "plain"
    record = train_head(tiny_model("qwen2", 0), tiny_tokenizer(), out, replace(TINY, reads_current=False),
                        progress=False, pieces=answers("qwen2"), log=lambda _: None)
    assert record["val_after"][-1]["top1"] > 0.3
    config = json.loads((out / CONFIG_FILE).read_text())
    del config["reads_current"]  # as a head saved before the field
    (out / CONFIG_FILE).write_text(json.dumps(config))
    head, _ = load_head(out)
    assert not head.config.reads_current and head.fuse.in_features == 2 * head.config.hidden_size
    assert load_head(heads()[0])[0].fuse.in_features == 3 * head.config.hidden_size  # the default reads it
    for method in ("head", "hybrid-head"):
        result = head_engine("qwen2", out, method).generate(prompt_ids(), max_new_tokens=NEW_TOKENS,
                                                           num_draft_tokens=4, ignore_eos=True, adaptive=False)
        assert result.token_ids == reference("qwen2") and result.stats.accepted > 0


def test_each_input_reads_its_own_token_and_each_tree_node_its_parents(heads, monkeypatch):
    out, _ = heads()
    engine = head_engine("qwen2", out)
    proposer = engine.proposer
    head, embed = proposer.head, proposer.embed
    propose, expand, forward, events = proposer.propose, proposer._expand, head.forward, []

    def spy_propose(context, k, stop_confidence=0.0):
        events.append(("text", list(context)))
        return propose(context, k, stop_confidence)

    def spy_expand(nodes, tree, *rest):
        events.append(("parents", [tree.tokens[tree.parents[n]] if tree.parents[n] >= 0 else None for n in nodes]))
        return expand(nodes, tree, *rest)

    def spy_forward(features, embeddings, positions, past=None, mask=None, return_kv=False, current=None):
        events.append(("forward", positions.tolist(), embeddings[0].clone(), current[0].clone()))
        return forward(features, embeddings, positions, past=past, mask=mask, return_kv=return_kv, current=current)

    monkeypatch.setattr(proposer, "propose", spy_propose)
    monkeypatch.setattr(proposer, "_expand", spy_expand)
    monkeypatch.setattr(head, "forward", spy_forward)
    result = engine.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                             adaptive=False)
    assert result.token_ids == reference("qwen2")
    embedded = lambda ids: embed(torch.tensor(ids, device=embed.weight.device))  # [n, H]
    text, parents, seen = [], None, {"catch-up": 0, "depth 1": 0, "deeper": 0}
    for event in events:
        if event[0] == "text":
            text = event[1]
        elif event[0] == "parents":
            parents = event[1]
        elif parents is None:  # the catch-up: position t reads x_t, beside x_{t+1}
            _, positions, embeddings, current = event
            assert torch.equal(current, embedded([text[t] for t in positions]))
            assert torch.equal(embeddings, embedded([text[t + 1] for t in positions]))
            seen["catch-up"] += 1
        else:  # a tree's depth: each node reads its parent's token, the text's last below depth 1's nodes
            assert torch.equal(event[3], embedded([text[-1] if token is None else token for token in parents]))
            seen["depth 1" if None in parents else "deeper"] += 1
            parents = None
    assert min(seen.values()) > 0, seen


def test_training_hands_each_depth_its_own_current_token(heads, monkeypatch):
    from draftwise.proposers.head_model import readout_layer
    from draftwise.train.head import _Trainer

    model = tiny_model("qwen2", 0)
    head, ids = load_head(heads()[0], device=model.device)
    embed = model.get_input_embeddings()
    trainer = _Trainer(head.requires_grad_(True), readout_layer(model, ids).float(), embed, ids,
                       model.config.vocab_size, TINY, total_steps=1)
    forward, calls = head.forward, []

    def spy(features, embeddings, positions, past=None, mask=None, return_kv=False, current=None):
        calls.append((positions.tolist(), embeddings[0], current[0]))
        return forward(features, embeddings, positions, past=past, mask=mask, return_kv=return_kv, current=current)

    monkeypatch.setattr(head, "forward", spy)
    tokens = torch.tensor([5, 9, 14, 3, 27, 8], device=model.device)
    features = torch.randn(6, head.config.hidden_size, device=model.device)
    trainer._losses({"ids": tokens, "features": features}, noise=0.0)
    embedded = lambda at: embed(tokens[at]).float()  # [n, H]
    (depth1, next1, current1), (depth2, next2, current2) = calls
    assert depth1 == [0, 1, 2, 3, 4] and depth2 == [1, 2, 3, 4]  # depth 2 reads position t + 1's predicted feature
    for positions, following, current in ((depth1, next1, current1), (depth2, next2, current2)):
        assert torch.equal(current, embedded(positions))  # at both depths, position p reads x_p beside x_{p+1}
        assert torch.equal(following, embedded([p + 1 for p in positions]))


def test_the_readout_takes_the_targets_frequent_tokens_first_then_the_lowest_ids():
    # What the target emits on the training split, most frequent first (ties: the lower id).
    sequences = [{"next": torch.tensor([70, 3, 70, 42, 3, 70])}, {"next": torch.tensor([42, 42, 9])}]
    assert frequent_tokens(sequences) == [42, 70, 3, 9]
    # Four ids: the four frequent ones, whatever their rank in the vocabulary, and the special one.
    assert readout_ids(100, 4, special_ids=[99], frequent=[42, 70, 3, 9]).tolist() == [3, 9, 42, 70, 99]
    assert readout_ids(100, 2, frequent=[42, 70, 3, 9]).tolist() == [42, 70]  # the likeliest win the places
    assert readout_ids(100, 5, frequent=[42]).tolist() == [0, 1, 2, 3, 42]  # the rest: the lowest ids
    assert readout_ids(100, 3).tolist() == [0, 1, 2]
    assert readout_ids(4, 9, frequent=[7, 2]).tolist() == [0, 1, 2, 3]  # never past the vocabulary
    assert readout_cover(sequences, torch.tensor([42, 70])) == round(6 / 9, 4)


def test_an_interrupted_run_resumes_to_the_same_head_without_recomputing_features(heads, tmp_path, monkeypatch):
    folder, _ = heads()
    model, tokenizer = tiny_model("qwen2", 0), tiny_tokenizer()
    copy = tmp_path / "again"
    (copy / "features").mkdir(parents=True)
    for shard in (folder / "features").iterdir():
        (copy / "features" / shard.name).write_bytes(shard.read_bytes())
    # The features are there: computing any would be a failure to reuse them.
    monkeypatch.setattr("draftwise.train.features.target_features", lambda *_: pytest.fail("features recomputed"))
    from draftwise.train import head as train

    real_step, steps = train._Trainer.step, []

    def interrupted(self, sequence):
        if len(steps) == TINY.checkpoint_every + 3:  # past a checkpoint, in the middle of an epoch
            raise KeyboardInterrupt
        steps.append(1)
        return real_step(self, sequence)

    monkeypatch.setattr(train._Trainer, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_head(model, tokenizer, copy, TINY, progress=False, pieces=answers("qwen2"), log=lambda _: None)
    monkeypatch.setattr(train._Trainer, "step", real_step)
    state = torch.load(copy / CHECKPOINT_FILE, weights_only=True)
    del state["config"]["feature_layers"]  # as a checkpoint written before the field was: it resumes all the same
    torch.save(state, copy / CHECKPOINT_FILE)
    record = train_head(model, tokenizer, copy, TINY, progress=False, pieces=answers("qwen2"), log=lambda _: None)
    assert record["resumed_at_step"] == TINY.checkpoint_every
    resumed, _ = load_head(copy)
    uninterrupted, _ = load_head(folder)
    for (name, a), b in zip(resumed.state_dict().items(), uninterrupted.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name  # the same head as a run never stopped


def test_saved_answers_are_reused_only_for_the_same_requests(tmp_path, monkeypatch):
    """Generating the answers is the slow part of a run, so they are kept; other requests must not reuse them."""
    from draftwise.train import head as train
    from draftwise.train.corpus import Piece

    made = []

    def answer(model, tokenizer, requests, max_new_tokens, batch_size=8, progress=True):
        made.append(len(requests))
        return [Piece(source, [1, 2, 3], 1) for source, _messages in requests]

    monkeypatch.setattr(train, "target_answers", answer)
    monkeypatch.setattr(train, "answer_prompts", lambda count, seed: [(f"file {i}", []) for i in range(count)])
    cfg = TrainConfig(answers=3, everyday=0)
    first = train.own_answers(None, None, cfg, tmp_path, progress=False)
    assert train.own_answers(None, None, cfg, tmp_path, progress=False) == first and made == [3]
    from draftwise.train import answers as answer_kinds

    monkeypatch.setattr(answer_kinds, "REQUESTS", answer_kinds.REQUESTS[:-1])  # a kind of request dropped
    train.own_answers(None, None, cfg, tmp_path, progress=False)
    assert made == [3, 3]


def test_everyday_answers_are_added_after_the_package_answers_and_kept_apart(tmp_path, monkeypatch):
    """--everyday N: the target answers N everyday requests too; each set is saved and reused on its own."""
    from draftwise.train import everyday, head as train
    from draftwise.train.corpus import Piece

    made = []

    def answer(model, tokenizer, requests, max_new_tokens, batch_size=8, progress=True):
        made.append([source for source, _messages in requests])
        return [Piece(source, [1, 2, 3], 1) for source, _messages in requests]

    monkeypatch.setattr(train, "target_answers", answer)
    monkeypatch.setattr(train, "answer_prompts", lambda count, seed: [(f"file {i}", []) for i in range(count)])
    pieces = train.own_answers(None, None, TrainConfig(answers=2, everyday=3), tmp_path, progress=False)
    assert [p.source.split("/")[0] for p in pieces] == ["file 0", "file 1", "everyday", "everyday", "everyday"]
    assert train.own_answers(None, None, TrainConfig(answers=2, everyday=3), tmp_path, progress=False) == pieces
    assert len(made) == 2  # both sets were reused
    train.own_answers(None, None, TrainConfig(answers=2, everyday=4), tmp_path, progress=False)
    assert [len(sources) for sources in made] == [2, 3, 4]  # only the changed set was answered again
    monkeypatch.setattr(everyday, "TOPICS", everyday.TOPICS[:-1])  # other requests: not the saved answers
    train.own_answers(None, None, TrainConfig(answers=2, everyday=4), tmp_path, progress=False)
    assert [len(sources) for sources in made] == [2, 3, 4, 4]
    assert train.own_answers(None, None, TrainConfig(answers=0, everyday=0), tmp_path, progress=False) == []


def test_everyday_requests_are_seeded_named_by_topic_and_some_topics_are_held_back():
    from draftwise.train import everyday
    from draftwise.train.corpus import EXCLUDED_WORDS
    from draftwise.train.head import _held_back

    requests = everyday.everyday_prompts(200)
    assert requests == everyday.everyday_prompts(200) != everyday.everyday_prompts(200, seed=1)
    sources = {source for source, _messages in requests}
    assert sources <= {f"everyday/{topic}" for topic in everyday.TOPICS} and len(sources) > 40
    texts = [messages[0]["content"] for _source, messages in requests]
    assert len(set(texts)) > 150 and not any("{" in text for text in texts)  # every field filled in
    assert not any(word in text.lower() for text in texts for word in EXCLUDED_WORDS)
    held = [topic for topic in everyday.TOPICS if _held_back(f"everyday/{topic}")]
    assert 0 < len(held) < len(everyday.TOPICS) / 5  # validation sees everyday text; training keeps most topics


def int8_wherever_allowed(monkeypatch) -> None:
    """Kernel plans that put every linear a draft kernel may run on int8-dynamic, whatever the timings say."""
    from draftwise.backends import kernels

    real = kernels.plan_kernels

    def plan(model, allowed=kernels.EXACT_KERNELS, widths=kernels.TARGET_WIDTHS, cache=True):
        chosen = real(model, allowed, widths, cache)
        return replace(chosen, choices=dict.fromkeys(chosen.choices, "int8-dynamic")) if "int8-dynamic" in allowed \
            else chosen

    monkeypatch.setattr(kernels, "plan_kernels", plan)


def test_the_trained_head_is_scored_again_as_the_engine_runs_it(heads):
    # The tiny head's linears time fastest on dense: the engine's path computes what training's validation does,
    # a position a call instead of a sequence, so its top-1 is training's but for rounding.
    _, record = heads()
    as_run, trained = record["val_as_run"], record["val_after"][-1]
    assert as_run["tokens"] == trained["tokens"]  # the same positions scored
    assert abs(as_run["top1"] - trained["top1"]) < 0.01


@cpu_kernels
@pytest.mark.parametrize("fuse_exact", [True, False])
def test_a_kernel_that_costs_the_engines_head_accuracy_shows_in_its_training_run(tmp_path, monkeypatch, fuse_exact):
    """Negative control for the as-run score: the fuse on int8-dynamic (as the engine ran it before 14163fa) loses
    accuracy that training's validation, whose wide calls run the float weight, never sees; the run says so."""
    from draftwise import loading

    int8_wherever_allowed(monkeypatch)
    if not fuse_exact:
        monkeypatch.setattr(loading, "EXACT_INPUT_LAYERS", ())
    lines = []
    record = train_head(tiny_model("qwen2", 0), tiny_tokenizer(), tmp_path, TINY, progress=False,
                        pieces=answers("qwen2"), log=lines.append)
    as_run, trained = record["val_as_run"], record["val_after"][-1]["top1"]
    assert as_run["kernels"] == ({"dense": 1, "int8-dynamic": 7} if fuse_exact else {"int8-dynamic": 8})
    assert "validation as the engine runs the head" in lines[-1]
    if fuse_exact:  # the other linears on int8 move the tiny head's score by a point at most, either way
        assert abs(as_run["top1"] - trained) < GAP_WARNING and "loses accuracy" not in lines[-1]
    else:
        assert as_run["top1"] < trained - 0.04 and "loses accuracy" in lines[-1]


def test_the_fuse_is_never_planned_on_a_draft_kernel(heads, monkeypatch):
    """The fuse runs on the target's exact kernels only: the draft kernels' plan never sees it, so no int8 copy of it
    is timed or built only to be thrown away."""
    from draftwise.backends import kernels
    from draftwise.loading import head_proposer

    real, draft_plans = kernels.plan_kernels, []

    def plan(model, allowed=kernels.EXACT_KERNELS, widths=kernels.TARGET_WIDTHS, cache=True):
        if "int8-dynamic" in allowed:
            draft_plans.append({m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)})
        return real(model, allowed, widths, cache)

    monkeypatch.setattr(kernels, "plan_kernels", plan)
    folder, _ = heads()
    proposer = head_proposer(tiny_model("qwen2", 0), str(folder))
    hidden = proposer.head.config.hidden_size
    assert draft_plans and all(2 * hidden not in shapes for shapes in draft_plans)


def test_validation_holds_back_whole_sources_and_scores_answers_only(heads):
    pieces = answers("qwen2")
    held = {p.source for p in pieces if _held_back(p.source)}
    assert 0 < len(held) < len({p.source for p in pieces}) / 5
    _, record = heads()
    # Scored: the target's prediction of every answer token and of the one after the answer's last.
    scored = sum(len(p.ids) - p.answer_start + 1 for p in pieces if p.source in held)
    assert record["val_before"]["tokens"] == scored


# -- exactness ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_head_trees_keep_the_targets_greedy_output(heads, arch, k):
    folder, _ = heads(arch)
    result = head_engine(arch, folder).generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                                                ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(arch)
    stats = result.stats
    assert stats.accepted > 0  # the head drafts well enough that trees are really verified, not just offered
    assert stats.nodes <= k * stats.rounds  # a fixed k: at most k nodes a round, whatever the timings


def test_a_head_reads_its_window_from_its_record_and_older_heads_keep_their_longest_sequence():
    from types import SimpleNamespace

    def window(training):
        return attention_window(SimpleNamespace(training=training))

    assert window({"window": 522, "longest_sequence": 1419, "config": {"seq_len": 512}}) == 522
    assert window({"longest_sequence": 900, "config": {"seq_len": 512}}) == 900  # trained before the window
    assert window({"config": {"seq_len": 512}}) == 512
    assert window(None) is None


def test_the_window_leaves_out_the_few_longest_training_sequences():
    assert attention_window_of([10] * 98 + [500, 900]) == 10  # two odd ones in a hundred teach too little
    assert attention_window_of(list(range(1, 101))) == 98
    assert attention_window_of([5, 7]) == 7  # with few sequences, every one counts
    assert attention_window_of([40]) == 40


@pytest.mark.parametrize("window", [6, 12])
def test_a_head_attends_no_further_back_than_its_window_and_keeps_the_output(heads, window, monkeypatch):
    # Distances longer than most training sequences give the head features it cannot read; past its window it sees
    # nothing, and a long prompt's catch-up feeds only the window's positions.
    folder, record = heads()
    trained = [len(p.ids) for p in answers("qwen2") if not _held_back(p.source)]
    assert record["longest_sequence"] == max(trained)
    assert record["window"] == attention_window_of(trained)
    eng = head_engine("qwen2", folder)
    assert eng.proposer.window == record["window"]  # by default, what training saw often enough
    eng.proposer.window = window
    seen = []
    real_forward = FeatureHead.forward

    def forward(self, features, embeddings, positions, past=None, mask=None, return_kv=False, current=None):
        seen.append((mask is None, 0 if past is None else past[0].shape[2], len(positions)))  # catch-up?, keys, new
        return real_forward(self, features, embeddings, positions, past, mask, return_kv, current)

    monkeypatch.setattr(FeatureHead, "forward", forward)
    result = eng.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                          adaptive=False)
    assert result.token_ids == reference("qwen2")
    assert len(prompt_ids()) > window and seen[0] == (True, 0, window)  # the prompt: its last `window` positions
    # A catch-up (the verified text, contiguous) reaches the window back from its first new position; a tree depth
    # sees the window's text and this round's speculative entries (3 depths of 4 at most).
    assert all(keys + new - 1 <= window + 4 for catch_up, keys, new in seen if catch_up)
    assert all(keys <= window + 12 for catch_up, keys, _ in seen if not catch_up)
    assert any(keys == window for catch_up, keys, _ in seen if catch_up)  # the window was reached, and held
    assert result.stats.accepted > 0


def test_a_trained_head_accepts_far_more_than_an_untrained_one(heads, tmp_path):
    folder, _ = heads()
    trained_rate = head_engine("qwen2", folder).generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=4,
                                                         ignore_eos=True, adaptive=False).stats.acceptance_rate
    head, ids = load_head(folder)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02)
    from draftwise.proposers.head_model import save_head

    save_head(head, ids, tmp_path / "random")
    random_result = head_engine("qwen2", tmp_path / "random").generate(prompt_ids(), max_new_tokens=NEW_TOKENS,
                                                                     num_draft_tokens=4, ignore_eos=True, adaptive=False)
    assert random_result.token_ids == reference("qwen2")  # exact even when nothing is accepted
    assert trained_rate > 0.3 > random_result.stats.acceptance_rate


@cpu_kernels
def test_the_heads_fuse_stays_on_the_models_own_values_where_int8_is_chosen_for_every_linear(heads, monkeypatch):
    """The fuse reads the next token's embedding beside the target's far larger feature: int8-dynamic's one
    activation scale per call would round the embedding away (loading.EXACT_INPUT_LAYERS). Every other linear may
    take the kernel the timings choose, here int8-dynamic wherever a draft kernel may be."""
    from draftwise.backends import kernels

    int8_wherever_allowed(monkeypatch)
    folder, _ = heads()
    engine = head_engine("qwen2", folder)
    head = engine.proposer.head
    assert kernels.kernel_counts(head.fuse).keys() <= set(kernels.EXACT_KERNELS)
    others = [name for name, module in head.named_children() if name != "fuse" and kernels._kernel_name(module)]
    assert len(others) == 7 and all(kernels._kernel_name(getattr(head, name)) == "int8-dynamic" for name in others)
    assert engine.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids == reference("qwen2")


def test_adaptive_trees_sized_by_cost_keep_the_output(heads):
    folder, _ = heads()
    result = head_engine("qwen2", folder).generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=6,
                                                   ignore_eos=True)
    assert result.token_ids == reference("qwen2")


@pytest.mark.parametrize("method", ["head", "hybrid-head"])
def test_head_sequences_in_one_batch_each_get_the_targets_output(heads, method):
    folder, _ = heads()
    eng = head_engine("qwen2", folder, method)
    tok = tiny_tokenizer()
    prompts = [prompt_ids(), tok("The quick brown fox")["input_ids"], tok("for i in range(10):\n")["input_ids"]]
    alone = [eng.generate(p, max_new_tokens=24, num_draft_tokens=3, ignore_eos=True, adaptive=False).token_ids
             for p in prompts]
    cfg = GenerationConfig.from_options(max_new_tokens=24, num_draft_tokens=3, ignore_eos=True, adaptive=False)
    seqs = decode_together(eng, prompts, cfg)
    assert alone == [transformers_greedy(tiny_model("qwen2", 0), p, 24) for p in prompts]
    assert [seq.context[len(seq.prompt_ids):] for seq in seqs] == alone
    if method == "hybrid-head":  # the batched rounds (in steps, batch.py) went to both
        assert sum(seq.proposer.rounds["lookup"] for seq in seqs) > 0
        assert sum(seq.proposer.drafting_acceptance.rate > 0.5 for seq in seqs) > 0  # (0.5: before any head round)


def drafts_of(proposer) -> list[tuple[int, ...]]:
    """A spy on a head proposer's (or a hybrid's head's) drafts: each round's guessed tokens, in order."""
    head = proposer.draft if isinstance(proposer, HybridProposer) else proposer
    drafts, propose = [], head.propose

    def spied(context, k, stop_confidence=0.0):
        draft = propose(context, k, stop_confidence)
        drafts.append(draft.token_ids)
        return draft

    head.propose = spied
    return drafts


@pytest.mark.parametrize("method", ["head", "hybrid-head"])
@pytest.mark.parametrize("restores", [True, False])
def test_a_prompt_from_the_prompt_cache_gives_the_head_the_guesses_of_a_cold_one(heads, method, restores,
                                                                                monkeypatch):
    """A restored prefix is not run through the target, so its features come from the prompt cache; without them
    (restores=False: the control, the head restoring nothing) the head drafts from the new turn's positions alone."""
    folder, _ = heads()
    if not restores:
        monkeypatch.setattr(HeadProposer, "restore", lambda self, token_ids: 0)
    warm, cold = head_engine("qwen2", folder, method), head_engine("qwen2", folder, method)
    warm.enable_prompt_cache(64 << 20)
    options = dict(max_new_tokens=24, num_draft_tokens=3, ignore_eos=True, adaptive=False)
    first = warm.generate(prompt_ids(), **options)
    second_prompt = prompt_ids() + first.token_ids + tiny_tokenizer()(" and then the list is sorted")["input_ids"]
    warm_drafts, cold_drafts = drafts_of(warm.proposer), drafts_of(cold.proposer)
    again, fresh = warm.generate(second_prompt, **options), cold.generate(second_prompt, **options)
    assert again.stats.prompt_cached == len(prompt_ids()) + 24 - 1
    assert again.token_ids == fresh.token_ids  # the text is the target's either way
    assert cold_drafts and (warm_drafts == cold_drafts) == restores
    if restores:
        assert again.stats.accepted == fresh.stats.accepted


# -- hybrid-head: the head's trees, and prompt lookup's where the text copies ------------------------------
def head_rounds(hybrid: HybridProposer) -> list[list[int]]:
    """A spy on the hybrid's head: [lookup rounds before it, the depth it offered, tokens kept] for each round it
    drafted."""
    rounds, propose, observe = [], hybrid.draft.propose, hybrid.draft.observe

    def spied_propose(context, k, stop_confidence=0.0):
        draft = propose(context, k, stop_confidence)
        rounds.append([hybrid.rounds["lookup"], draft.depth, 0])
        return draft

    def spied_observe(num_accepted):
        rounds[-1][2] = num_accepted
        observe(num_accepted)

    hybrid.draft.propose, hybrid.draft.observe = spied_propose, spied_observe
    return rounds


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("k", [2, 4])
def test_hybrid_head_keeps_the_targets_greedy_output_with_rounds_of_both(heads, arch, k):
    folder, _ = heads(arch)
    eng = head_engine(arch, folder, "hybrid-head")
    drafted = head_rounds(eng.proposer)
    result = eng.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True,
                          adaptive=False)
    assert result.token_ids == reference(arch)
    assert eng.proposer.rounds["lookup"] > 0 and eng.proposer.rounds["draft"] > 0, eng.proposer.rounds
    # The head drafted, and the target kept its guesses, after lookup's rounds too: the verified text's features
    # reached it while it sat out.
    assert any(lookups > 0 and kept > 0 for lookups, _, kept in drafted), drafted


def test_hybrid_head_sized_by_cost_keeps_the_output(heads):
    folder, _ = heads()
    result = head_engine("qwen2", folder, "hybrid-head").generate(prompt_ids(), max_new_tokens=NEW_TOKENS,
                                                                  num_draft_tokens=6, ignore_eos=True)
    assert result.token_ids == reference("qwen2")


def test_the_head_keeps_no_more_features_than_its_window_while_lookup_wins(heads, monkeypatch):
    folder, _ = heads()
    eng = head_engine("qwen2", folder, "hybrid-head")
    head = eng.proposer.draft
    head.window = 6
    kept, real = [], HeadProposer.add_features

    def add_features(self, start, features):
        real(self, start, features)
        kept.append(len(self._features))

    monkeypatch.setattr(HeadProposer, "add_features", add_features)
    result = eng.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                          adaptive=False)
    assert result.token_ids == reference("qwen2")
    assert max(kept) == 6 and eng.proposer.rounds["lookup"] > 0  # (the prompt alone brought more than 6)


@pytest.mark.parametrize("built, asked", [("hybrid-head", "head"), ("head", "hybrid-head")])
def test_a_head_engine_serves_both_head_methods(heads, built, asked):
    folder, _ = heads()
    eng = head_engine("qwen2", folder, built)
    assert set(eng.methods_available) == {"none", "lookup", "lookup-tree", "head", "hybrid-head"}
    seq = eng.open_sequence(prompt_ids(), GenerationConfig.from_options(max_new_tokens=4, method=asked))
    try:  # (another method than the engine's: a proposer of its own)
        proposer = seq.proposer
        assert type(proposer) is (HybridProposer if asked == "hybrid-head" else HeadProposer)
        assert type(getattr(proposer, "draft", proposer)) is HeadProposer
    finally:
        eng.close_sequence(seq)
    result = eng.generate(prompt_ids(), method=asked, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                          adaptive=False)
    assert result.token_ids == reference("qwen2")
    assert result.stats.method == asked and result.stats.accepted > 0


def test_a_failed_head_round_in_a_batch_reports_its_own_error(heads, monkeypatch):
    from draftwise.proposers.batch import propose_many
    from draftwise.proposers.prompt_lookup import PromptLookupProposer

    folder, _ = heads()
    hybrid = head_engine("qwen2", folder, "hybrid-head").proposer
    other = PromptLookupProposer()
    for proposer in (hybrid, other):
        proposer.begin([1, 2, 3], GenerationConfig.from_options().sampling, torch.Generator())

    def broken(self, context, k, stop_confidence=0.0):
        raise RuntimeError("the head broke")

    monkeypatch.setattr(HeadProposer, "propose", broken)
    # No earlier match for lookup: the round is the head's, and it fails; the other sequence's round goes on.
    results = propose_many([hybrid, other], [[1, 2, 3], [4, 5, 4]], [2, 2], [0.0, 0.0])
    assert isinstance(results[0], RuntimeError) and "the head broke" in str(results[0])
    assert isinstance(results[1], Draft)


# -- tree size by measured cost ----------------------------------------------------------------------------
def test_the_tree_grows_while_wider_passes_pay_and_backs_off_when_they_do_not():
    tree = GrownTree()  # nine guesses for the next token, by cumulative log-probability
    tree.add_children(-1, torch.tensor([-0.1, -0.2, -0.3, -0.5, -0.7, -1.0, -1.5, -2.0, -3.0]), torch.arange(9))
    flat, steep = StepCosts(), StepCosts()
    for width in (1, 2, 5, 10):
        flat.observe(1, width - 1, 0.0, 0.20 + 0.001 * width)  # wide passes cost about one step (native bf16)
        steep.observe(1, width - 1, 0.0, 0.20 * width)  # each token costs a step (an emulating CPU)
    sizing = TreeSizing()
    assert sizing.choose(tree, 3) == [0, 1, 2]  # nothing measured yet: k nodes
    sizing.time_forwards(0.03, 3)
    sizing.costs = flat
    assert len(sizing.choose(tree, 3)) >= 6
    sizing.costs = steep
    assert len(sizing.choose(tree, 3)) <= 2
    sizing.costs, sizing.sized_by_cost = flat, False  # a fixed k: exactly k nodes, whatever the timings
    assert sizing.choose(tree, 3) == [0, 1, 2]


@pytest.mark.parametrize("forward_s, deep", [(10.0, False), (1e-9, True)])
def test_the_head_grows_a_depth_only_while_a_forward_can_pay(heads, monkeypatch, forward_s, deep):
    # Timings pinned: a forward that costs more than any depth could give stops growth at the head's first guess
    # (the catch-up's); a free one grows every round to k.
    monkeypatch.setattr(TreeSizing, "time_forwards", lambda self, seconds, forwards: setattr(self, "forward_s", forward_s))
    monkeypatch.setattr(TreeSizing, "time_expansion", lambda self, nodes, seconds: None)  # every width: forward_s
    folder, _ = heads()
    eng = head_engine("qwen2", folder)
    grown, real_grow = [], eng.proposer._grow

    def grow(last, last_token, depth):
        tree, expanded = real_grow(last, last_token, depth)
        grown.append((depth, expanded))
        return tree, expanded

    eng.proposer._grow = grow
    # The engine's k pinned at 4: its own choice follows wall-clock timings, and a busy machine may keep it at 1,
    # where growth has nothing to stop. The tree is still sized by cost (adaptive).
    monkeypatch.setattr(DraftLengthPolicy, "choose", lambda self, rates, k_max, *args, **kw: k_max)
    result = eng.generate(prompt_ids(), max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True)
    assert result.token_ids == reference("qwen2")
    assert grown[0] == (4, 3)  # nothing timed yet: grown to k
    assert any(depth > 1 for depth, _ in grown[1:])  # (rounds where k left room to stop early)
    assert all(expanded == (depth - 1 if deep else 0) for depth, expanded in grown[1:]), grown


def test_a_tree_is_cut_to_the_room_left_in_the_context():
    tree = Draft((5, 6, 7, 8), parents=(-1, -1, 0, 2))
    assert tree.prefix(3) == Draft((5, 6, 7), parents=(-1, -1, 0))
    assert tree.prefix(9) is tree
    chain = Draft((5, 6, 7), q=torch.ones(3, 4))
    assert chain.prefix(2).token_ids == (5, 6) and chain.prefix(2).q.shape == (2, 4)


# -- bad input ---------------------------------------------------------------------------------------------
def test_train_head_refuses_an_out_that_is_a_file_before_loading(tmp_path, capsys, monkeypatch):
    from draftwise import cli

    monkeypatch.setattr("draftwise.loading.load_models", lambda *a, **k: pytest.fail("the target loaded first"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert cli.main(["train-head", "--target", "tiny", "--out", str(a_file), "-q"]) == 1
    assert "is a file" in capsys.readouterr().err and a_file.read_text() == "mine"


def test_the_default_head_folder_is_named_after_the_target_even_for_a_relative_path(tmp_path, monkeypatch):
    from draftwise.models import head_home

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path / "my-model")
    heads = tmp_path / "home" / "heads"
    assert head_home(".") == head_home("../my-model/") == heads / "my-model"
    (tmp_path / "current").symlink_to(tmp_path / "my-model")
    assert head_home("../current") == heads / "current"  # the name given, not the link's target
    assert head_home("qwen2.5-coder-1.5b-instruct") == heads / "qwen2.5-coder-1.5b-instruct"
    assert head_home("models/small.gguf") == heads / "small"


def test_method_head_without_a_trained_head_says_how_to_make_one(tmp_path):
    with pytest.raises(DraftwiseError, match="train-head"):
        Engine.from_models(tiny_model("qwen2", 0), tiny_tokenizer(), method="head", head=str(tmp_path / "none"))
    with pytest.raises(DraftwiseError, match="needs the folder of a trained head"):
        Engine.from_models(tiny_model("qwen2", 0), tiny_tokenizer(), method="head")


def test_a_head_for_another_hidden_size_is_refused(heads):
    folder, _ = heads()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tiny_tokenizer()
    wider = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(DraftwiseError, match="hidden size 64"):
        Engine.from_models(wider, tokenizer, method="head", head=str(folder))


def test_a_finished_run_run_again_keeps_its_head_and_record(heads):
    folder, _ = heads()
    before = (folder / "training.json").read_text()
    said = []
    again = train_head(tiny_model("qwen2", 0), tiny_tokenizer(), folder, TINY, progress=False,
                       pieces=answers("qwen2"), log=said.append)
    assert again == json.loads(before) and (folder / "training.json").read_text() == before  # (it had crashed)
    assert said == [f"the head in {folder} is already trained with these settings and data; its record is kept"]


def test_a_folder_holds_one_targets_run(heads):
    # Another model (or dtype) would reuse this run's features, named by the text alone, and resume its checkpoint.
    folder, _ = heads()
    with pytest.raises(ValueError, match="holds a run of another target or dtype"):
        train_head(tiny_model("qwen2", 1), tiny_tokenizer(), folder, TINY, progress=False, pieces=answers("qwen2"),
                   log=lambda _: None)
    with pytest.raises(ValueError, match="holds a run of another target or dtype"):
        train_head(tiny_model("qwen2", 0).to(torch.bfloat16), tiny_tokenizer(), folder, TINY, progress=False,
                   pieces=answers("qwen2"), log=lambda _: None)


@pytest.mark.parametrize("options, message", [
    (["--out", "{file}/head"], "cannot make the folder (Not a directory)"),
    (["--lr", "inf"], "--lr must be a number > 0, got inf"),
])
def test_train_head_refuses_an_unusable_out_or_lr_before_loading(tmp_path, capsys, monkeypatch, options, message):
    from draftwise import cli

    monkeypatch.setattr("draftwise.loading.load_models", lambda *a, **k: pytest.fail("the target loaded first"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    args = [option.format(file=a_file) for option in options]
    out = [] if "--out" in args else ["--out", str(tmp_path / "head")]
    assert cli.main(["train-head", "--target", "tiny", *out, *args, "-q"]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("options, reads_current", [([], TrainConfig().reads_current), (["--read-current"], True),
                                                     (["--no-read-current"], False)])
def test_train_head_passes_read_current_on(tmp_path, monkeypatch, options, reads_current):
    from draftwise import cli

    given = []
    monkeypatch.setattr("draftwise.loading.load_models", lambda *a, **k: (None, None, None))
    monkeypatch.setattr("draftwise.train.head.train_head", lambda _m, _t, _out, cfg, **k: given.append(cfg) or
                        {"val_after": [{"top1": 0.5, "top3": 0.6}], "train_tokens": 1, "train_s": 1, "collect_s": 1})
    assert cli.main(["train-head", "--target", "tiny", "--out", str(tmp_path / "head"), *options, "-q"]) == 0
    assert given[0].reads_current is reads_current


def test_the_corpus_keeps_no_benchmark_no_standard_library_copy_and_each_text_once(tmp_path):
    import textwrap as stdlib_module

    from draftwise.train.corpus import corpus_texts, stdlib_lines

    prose = "A guide to this package. " * 40
    files = {
        "alpha/guide.md": prose,
        "alpha/evals/human_eval_tasks.md": "Tasks to check a model with. " * 40,  # named in its path
        "beta/notes.md": "Scores on SpecBench prompts. " * 40,  # named in its text
        "beta/_vendor/alpha/guide.md": prose,  # a vendored copy: the same text
        "gamma/_compat/textwrap.py": Path(stdlib_module.__file__).read_text(),  # the standard library's own
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    kept = [label for label, _ in corpus_texts(sorted(tmp_path.iterdir()), stdlib_lines())]
    assert kept == ["alpha/guide.md"]
    # A vendored copy's name falls on the same side of the split as its package's own file.
    assert all(_held_back(f"pip/_vendor/{name}") == _held_back(name) for name in ("rich/a.py", "idna/core.py",
                                                                                  "packaging/version.py"))
