"""Self-speculation by layer skipping: the draft is the target with layers passed over, in the target's own slot.

Exactness through the engine is covered where every method is (test_greedy_identity.py, test_sampling_e2e.py
run "skip"); here: the skipping itself, the cache rule (the slot never holds more than the text), batches,
and the calibration that picks the layers.
"""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import cpu_kernels, input_batch, tiny_model, tiny_tokenizer, transformers_greedy
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.proposers import skip_calibration
from draftwise.backends.hf import HFBackend
from draftwise.backends.kernels import kernel_counts, on_timed_kernels
from draftwise.proposers.layer_skip import DraftStack, SkippingBackend, cheaper_stack, decoder_layers, drafting
from draftwise.proposers.skip_calibration import measure_skip, plan_skip, skip_order
from test_batch import PROMPTS, run_together

LAYERS = 4
# A prompt whose tail occurred before: prompt lookup has matches to offer from the first round.
REPEATING = PROMPTS[0] + " " + PROMPTS[0]
KEPT_VOCAB = 200  # of the tiny tokenizer's 300 ids: a compact readout that drops a third of them


@functools.lru_cache(maxsize=None)
def target(arch="llama"):
    return tiny_model(arch, 0, LAYERS)


@functools.lru_cache(maxsize=None)
def reference(arch, prompt, new_tokens):
    return transformers_greedy(target(arch), tiny_tokenizer()(prompt)["input_ids"], new_tokens)


def engine(arch="llama", **options):
    return Engine.from_models(target(arch), tiny_tokenizer(), method="skip", **options)


# The draft's layers on int8 copies and its output layer over the lowest ids only, whatever the timings say.
INT8 = dict(draft_kernels=("int8",), draft_vocab=KEPT_VOCAB)


def int8_stack(running, arch="llama"):
    """The int8 copies of running (target(arch) on its timed kernels), whatever the timings say."""
    return cheaper_stack(target(arch), running, kernels=("int8",), keep_vocab=KEPT_VOCAB)


def greedy(n, **options):
    return GenerationConfig.from_options(max_new_tokens=n, ignore_eos=True, **options)


def test_skipping_passes_over_the_layers_and_puts_them_back():
    model = target()
    layers = list(decoder_layers(model))
    ids = input_batch(tiny_tokenizer()(PROMPTS[0])["input_ids"])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        with drafting(model, DraftStack((1, 2))):  # skipping alone: nothing copied
            assert [type(layer).__name__ for layer in decoder_layers(model)][1:3] == ["_PassThrough"] * 2
            shallow = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert list(decoder_layers(model)) == layers
    assert not torch.allclose(full, shallow) and torch.equal(full, again)


@pytest.mark.parametrize("skip", [(0, 1, 2, 3), (1, 1), (4,), (-1,)])
def test_a_skip_set_that_cannot_draft_is_refused_with_the_allowed_range(skip):
    backend = engine().target
    with pytest.raises(DraftwiseError, match="between 0 and 3"):
        SkippingBackend(backend, DraftStack(skip))


@cpu_kernels  # int8 copies: CPU kernels
def test_skipping_nothing_is_refused_unless_the_draft_runs_cheaper_copies():
    backend = engine().target
    with pytest.raises(DraftwiseError, match="skips no layer must run cheaper copies"):
        SkippingBackend(backend, DraftStack())
    assert SkippingBackend(backend, int8_stack(backend.model)).skip == ()


def test_the_engine_offers_skip_and_refuses_a_draft_it_has_no_model_for():
    # On plain copies: where a timing puts the draft's layers on int8, skipping none is a candidate and may win
    # (it did once in a full run), and this test is about the offer, not about that choice.
    eng = engine(draft_kernels=("dense",))
    assert eng.methods_available == ("none", "lookup", "lookup-tree", "skip", "hybrid-skip")
    assert eng.speed_paths["skip_layers"] and 0 not in eng.speed_paths["skip_layers"]
    with pytest.raises(DraftwiseError, match="'draft' is not available"):
        eng.open_sequence([1, 2, 3], GenerationConfig(method="draft"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
def test_skip_gives_the_targets_greedy_output_with_a_deeper_target(arch):
    result = engine(arch).generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True, num_draft_tokens=3,
                                   adaptive=False)
    assert result.token_ids == reference(arch, PROMPTS[0], 30)
    assert result.stats.proposed > 0


def test_the_slot_holds_exactly_the_text_after_every_round_even_a_failed_one():
    eng = engine(draft_kernels=("dense",))  # skipping layers, whatever the timings: a draft that skips none may
    # keep every guess, and the 12 tokens end before the failed round
    seq = eng.open_sequence(tiny_tokenizer()(PROMPTS[1])["input_ids"], greedy(12, num_draft_tokens=4, adaptive=False))
    while not seq.prefill_done:
        eng.prefill(seq)
    for _ in range(3):
        eng.step([seq])
        assert seq.target.cache_len == len(seq.context) - 1
    seq.proposer.take = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    eng.step([seq])
    assert seq.finish == "error" and seq.target.cache_len == len(seq.context) - 1
    eng.close_sequence(seq)


def test_skip_sequences_batched_with_others_each_get_their_own_output():
    eng = engine()
    requests = [(PROMPTS[i], greedy(n, method=m)) for i, n, m in
                [(0, 20, "skip"), (1, 12, "none"), (2, 25, "skip"), (3, 16, "lookup"), (4, 18, "skip")]]
    seqs = run_together(eng, requests)
    for (prompt, cfg), seq in zip(requests, seqs):
        assert seq.context[len(seq.prompt_ids):] == reference("llama", prompt, cfg.max_new_tokens)
    assert eng.target.open_slots == 1


def test_skip_order_never_moves_the_first_layer_nor_the_last_of_a_deep_stack():
    hidden = torch.randn(1, 3, 8)
    # Each layer turns the stream by a known amount: layer i adds i-scaled noise... here, by construction.
    turns = [0.9, 0.1, 0.5, 0.05, 0.3, 0.8]
    states = [hidden]
    for turn in turns:
        states.append(states[-1] + turn * torch.randn(1, 3, 8) * states[-1].norm(dim=-1, keepdim=True))
    order = skip_order(tuple(states))
    assert 0 not in order and 5 not in order and sorted(order) == [1, 2, 3, 4]
    assert order[0] in (1, 3)  # the smallest turns go first
    assert skip_order(tuple(states[:3])) == [1]  # two layers: only the second may go


def test_calibration_tries_several_counts_and_keeps_the_best_rate():
    ids = tiny_tokenizer()(" ".join(PROMPTS))["input_ids"]
    plan = measure_skip(HFBackend(target()), ids, k=4)
    assert len(plan.candidates) >= 2
    assert all(0.0 <= c["agreement"] <= 1.0 and c["cost"] > 0 for c in plan.candidates)
    assert list(plan.skip) == max(plan.candidates, key=lambda c: c["rate"])["skip"]
    assert 0 not in plan.skip and LAYERS - 1 not in plan.skip


def test_a_named_models_plan_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    model = tiny_model("llama", 0, LAYERS)
    model.config._name_or_path = "tiny-for-skip-cache"
    ids = tiny_tokenizer()(PROMPTS[2])["input_ids"]
    first = plan_skip(HFBackend(model), ids)
    assert list(tmp_path.glob("calibration/*.json"))
    monkeypatch.setattr(skip_calibration, "measure_skip", lambda *a, **k: pytest.fail("measured twice"))
    assert plan_skip(HFBackend(model), ids) == first


@cpu_kernels  # int8 copies: CPU kernels
def test_the_cheaper_stack_swaps_layers_and_readout_in_and_puts_everything_back():
    running = on_timed_kernels(target())
    stack = int8_stack(running)
    layers, head = list(decoder_layers(running)), running.get_output_embeddings()
    assert sorted(stack.layers) == list(range(LAYERS)) and stack.token_ids.tolist() == list(range(KEPT_VOCAB))
    assert kernel_counts(torch.nn.ModuleList(stack.layers.values())) == {"int8": 7 * LAYERS}
    drafts = stack.skipping((2,))
    assert sorted(drafts.layers) == [0, 1, 3]  # the skipped layer's copy would never run
    ids = input_batch(tiny_tokenizer()(PROMPTS[0])["input_ids"][:8])
    with torch.no_grad():
        full = running(input_ids=ids).logits  # [1, 8, 300]
        with drafting(running, drafts):
            inside = list(decoder_layers(running))
            assert running.get_output_embeddings() is stack.readout
            drafted = running(input_ids=ids).logits  # [1, 8, KEPT_VOCAB]
        again = running(input_ids=ids).logits
    assert type(inside[2]).__name__ == "_PassThrough" and all(inside[i] is stack.layers[i] for i in (0, 1, 3))
    assert drafted.shape[-1] == KEPT_VOCAB and not torch.allclose(full[..., :KEPT_VOCAB], drafted)
    assert list(decoder_layers(running)) == layers and running.get_output_embeddings() is head
    assert torch.equal(full, again)


@cpu_kernels  # int8 copies: CPU kernels
def test_a_draft_forward_that_fails_still_puts_the_targets_modules_back():
    running = on_timed_kernels(target())
    layers, head = list(decoder_layers(running)), running.get_output_embeddings()
    with pytest.raises(RuntimeError, match="injected"), drafting(running, int8_stack(running).skipping((1,))):
        raise RuntimeError("injected")
    assert list(decoder_layers(running)) == layers and running.get_output_embeddings() is head


@cpu_kernels  # int8 copies: CPU kernels
def test_the_copies_share_the_targets_tensors_where_they_keep_its_kernel():
    model = target()
    running = on_timed_kernels(model)
    stack = cheaper_stack(model, running, kernels=("int8",), keep_vocab=KEPT_VOCAB)
    copied, own = stack.layers[1], decoder_layers(running)[1]
    assert copied.input_layernorm.weight.data_ptr() == own.input_layernorm.weight.data_ptr()
    assert copied.self_attn.q_proj is not own.self_attn.q_proj and copied.self_attn.q_proj.weight.dtype == torch.int8


@cpu_kernels  # int8 copies: CPU kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
def test_skip_on_int8_copies_gives_the_targets_greedy_output(arch):
    eng = engine(arch, **INT8)
    assert eng.speed_paths["skip_kernels"] == {"int8": 7 * LAYERS - 7 * len(eng.speed_paths["skip_layers"])}
    assert eng.speed_paths["skip_vocab"] == KEPT_VOCAB  # the lowest ids (the end token, 0, among them)
    result = eng.generate(PROMPTS[0], max_new_tokens=30, ignore_eos=True, num_draft_tokens=3, adaptive=False)
    assert result.token_ids == reference(arch, PROMPTS[0], 30)
    assert result.stats.proposed > 0 and result.stats.accepted > 0


@cpu_kernels  # int8 copies: CPU kernels
def test_skip_on_int8_copies_batched_with_others_each_get_their_own_output():
    eng = engine(**INT8)
    requests = [(PROMPTS[i], greedy(n, method=m, num_draft_tokens=3, adaptive=False)) for i, n, m in
                [(0, 20, "skip"), (1, 12, "none"), (2, 25, "skip"), (4, 18, "skip")]]
    seqs = run_together(eng, requests)
    for (prompt, cfg), seq in zip(requests, seqs):
        assert seq.context[len(seq.prompt_ids):] == reference("llama", prompt, cfg.max_new_tokens)


def test_without_the_compact_draft_skip_shares_the_targets_own_modules():
    eng = engine(compact_draft=False, **INT8)
    stack = eng.proposer.skipping.stack
    assert not stack.cheaper and stack.token_ids is None and eng.speed_paths["skip_kernels"] == {}
    assert eng.speed_paths["skip_layers"] and eng.speed_paths["skip_vocab"] == 300


@cpu_kernels  # int8 copies: CPU kernels
def test_calibration_with_copies_also_weighs_skipping_no_layer():
    ids = tiny_tokenizer()(" ".join(PROMPTS))["input_ids"]
    backend = HFBackend(on_timed_kernels(target()))
    plan = measure_skip(backend, ids, k=4, stack=int8_stack(backend.model))
    assert plan.candidates[0]["skip"] == [] and 0 < plan.candidates[0]["agreement"] <= 1
    assert list(plan.skip) == max(plan.candidates, key=lambda c: c["rate"])["skip"]
    assert backend.default.cache_len == 0  # the measurement's slot is left empty


@cpu_kernels
def test_a_target_already_repacked_takes_its_copies_from_the_model_as_loaded():
    model = target()
    repacked = on_timed_kernels(model, ("onednn",))  # as the bench shares one fast copy among its engines
    eng = Engine.from_models(repacked, tiny_tokenizer(), method="skip", loaded_model=model, **INT8)
    assert eng.speed_paths["skip_kernels"] == {"int8": 7 * LAYERS - 7 * len(eng.speed_paths["skip_layers"])}
    assert eng.proposer.skipping.stack.token_ids is not None
    result = eng.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True, num_draft_tokens=3, adaptive=False)
    assert result.token_ids == reference("llama", PROMPTS[0], 20)


@cpu_kernels  # int8 copies: CPU kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
def test_hybrid_skip_gives_the_targets_greedy_output_with_rounds_of_both(arch):
    eng = Engine.from_models(target(arch), tiny_tokenizer(), method="hybrid-skip", **INT8)
    ids = tiny_tokenizer()(REPEATING)["input_ids"]
    result = eng.generate(ids, max_new_tokens=30, ignore_eos=True, num_draft_tokens=3, adaptive=False)
    assert result.token_ids == reference(arch, REPEATING, 30)
    assert eng.proposer.rounds["lookup"] > 0 and eng.proposer.rounds["draft"] > 0


@cpu_kernels  # int8 copies: CPU kernels
def test_hybrid_skip_batched_with_skip_and_others_each_get_their_own_output():
    eng = Engine.from_models(target(), tiny_tokenizer(), method="hybrid-skip", **INT8)
    requests = [(prompt, greedy(n, method=m, num_draft_tokens=3, adaptive=False)) for prompt, n, m in
                [(REPEATING, 20, "hybrid-skip"), (PROMPTS[1], 12, "skip"), (PROMPTS[2] + " " + PROMPTS[2], 25,
                 "hybrid-skip"), (PROMPTS[3], 16, "lookup"), (PROMPTS[4], 18, "none")]]
    seqs = run_together(eng, requests)
    for (prompt, cfg), seq in zip(requests, seqs):
        assert seq.context[len(seq.prompt_ids):] == reference("llama", prompt, cfg.max_new_tokens)
    for seq in (seqs[0], seqs[2]):
        assert seq.proposer.rounds["lookup"] > 0 and seq.proposer.rounds["draft"] > 0
    assert eng.target.open_slots == 1


@cpu_kernels  # int8 copies: CPU kernels
def test_hybrid_skip_keeps_the_slot_at_the_text_after_lookup_rounds_and_a_failed_one():
    """Batched, so that a round whose start fails is still settled (proposers/batch.py): after a skip round, the
    hybrid must not settle that old round again, which would cut the slot back to where it began."""
    eng = Engine.from_models(target(), tiny_tokenizer(), method="hybrid-skip", **INT8)
    cfg = greedy(40, num_draft_tokens=3, adaptive=False)
    seq, other = (eng.open_sequence(tiny_tokenizer()(prompt)["input_ids"], cfg) for prompt in (REPEATING, PROMPTS[1]))
    while not (seq.prefill_done and other.prefill_done):
        eng.prefill(seq if not seq.prefill_done else other)
    rounds = seq.proposer.rounds
    # Until both kinds of round were drafted, and the last was the skip draft's.
    while (not (rounds["lookup"] and rounds["draft"]) or seq.proposer.lookup_round) and seq.finish is None:
        eng.step([seq, other])
        assert seq.target.cache_len == len(seq.context) - 1
    assert rounds["lookup"] and rounds["draft"] and not seq.proposer.lookup_round
    seq.proposer._pick = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))  # fails before drafting
    eng.step([seq, other])
    assert seq.finish == "error" and seq.target.cache_len == len(seq.context) - 1
    assert other.finish is None and other.target.cache_len == len(other.context) - 1
    eng.close_sequence(seq)
    eng.close_sequence(other)
