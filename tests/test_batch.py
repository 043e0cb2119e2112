"""Many sequences stepped together: each one's output is what it is alone, and the target's own.

The reference for a prompt is transformers' generate on the target alone (an independent implementation);
the batched runs mix prompts of different lengths, methods, draft lengths and ends, so rows accept different
numbers of draft tokens, join mid-run (chunked prefill) and leave (freeing a slot moves another row).
"""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer, transformers_greedy
from draftwise import Engine
from draftwise import round as round_module
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.sampling import make_generator
from draftwise.types import Draft
from draftwise.verify import verify_greedy, verify_rejection
from draftwise.verify.batch import DraftBatch, verify_batch

PROMPTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "The quick brown fox",
    "Summaries copy spans of the article: the article says that prices rose by ten percent. The article",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding proposes several tokens and",
    "The dog sleeps; the fox runs away. The dog",
]


@functools.lru_cache(maxsize=None)
def model(arch, seed, layers=2):
    return tiny_model(arch, seed, layers)


@functools.lru_cache(maxsize=None)
def reference(arch, prompt, new_tokens):
    return transformers_greedy(model(arch, 0), tiny_tokenizer()(prompt)["input_ids"], new_tokens)


def engine(arch, method="draft"):
    return Engine.from_models(model(arch, 0), tiny_tokenizer(), draft_model=model(arch, 1, 1), method=method)


def run_together(eng, requests, chunk=3, fail=None):
    """Open every request, prefill them chunk by chunk while the others decode, step until all end.
    requests: (prompt, cfg); fail(seq) may raise inside a sequence's round. Returns each one's Sequence."""
    seqs = [eng.open_sequence(tiny_tokenizer()(p)["input_ids"], cfg) for p, cfg in requests]
    running = list(seqs)
    while running:
        prefilling = next((s for s in running if not s.prefill_done), None)
        if prefilling is not None:
            eng.prefill(prefilling, chunk)
        ready = [s for s in running if s.prefill_done]
        if fail is not None:
            for seq in ready:
                fail(seq)
        if ready:
            eng.step(ready)
        for seq in [s for s in running if s.finish is not None]:
            eng.close_sequence(seq)
            running.remove(seq)
    return seqs


def greedy(max_new_tokens, method=None, k=4, adaptive=True):
    return GenerationConfig.from_options(max_new_tokens=max_new_tokens, num_draft_tokens=k, ignore_eos=True,
                                         method=method, adaptive=adaptive)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding"])
@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_batch_of_mixed_requests_gives_each_the_targets_own_tokens(arch, method):
    eng = engine(arch, method)
    # Different lengths, methods and k, so rows are ragged and leave at different steps.
    requests = [(p, greedy(12 + 5 * i, ["none", "lookup", "draft", "hybrid"][i % 4], k=1 + i % 5,
                           adaptive=i % 2 == 0)) for i, p in enumerate(PROMPTS)]
    seqs = run_together(eng, requests)
    for (prompt, cfg), seq in zip(requests, seqs):
        assert seq.finish == "length"
        assert seq.context[len(seq.prompt_ids):] == reference(arch, prompt, cfg.max_new_tokens)
    assert sum(s.stats.accepted for s in seqs) > 0  # speculation happened in the batch
    assert eng.target.open_slots == 1  # only the engine's own slot is left


def test_sequences_joining_and_leaving_do_not_disturb_the_others():
    eng = engine("llama")
    first = run_together(eng, [(PROMPTS[0], greedy(30))])[0]
    # The same request among others that end early (their slots close and rows move under it).
    crowd = [(PROMPTS[i], greedy(4 + i)) for i in (1, 2, 3, 4)]
    seqs = run_together(eng, [*crowd[:2], (PROMPTS[0], greedy(30)), *crowd[2:]], chunk=2)
    assert seqs[2].context == first.context


def test_two_live_streams_on_one_engine_do_not_corrupt_each_other():
    eng = engine("qwen2")
    a = eng.stream(PROMPTS[0], max_new_tokens=20, ignore_eos=True)
    b = eng.stream(PROMPTS[1], max_new_tokens=20, ignore_eos=True)
    tokens = {"a": [], "b": []}
    for event_a, event_b in zip(a, b):  # interleaved, one event of each at a time
        for name, event in (("a", event_a), ("b", event_b)):
            if event.token_id is not None:
                tokens[name].append(event.token_id)
    assert tokens["a"] == reference("qwen2", PROMPTS[0], 20)
    assert tokens["b"] == reference("qwen2", PROMPTS[1], 20)


def test_a_round_that_raises_in_one_sequence_ends_only_that_one():
    eng = engine("llama")
    doomed = {}

    def fail(seq):
        if seq.prompt_ids == tiny_tokenizer()(PROMPTS[1])["input_ids"] and seq.stats.new_tokens >= 5:
            doomed["seq"] = seq
            # Mid-draft: the shared draft forward has already grown this sequence's draft cache.
            seq.proposer.take = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))

    # A fixed k: every round drafts, so the doomed sequence reaches its draft whatever adaptive k would choose
    requests = [(p, greedy(25, adaptive=False)) for p in PROMPTS[:4]]
    seqs = run_together(eng, requests, fail=fail)
    assert seqs[1].finish == "error" and "injected" in seqs[1].error
    failed = doomed["seq"]
    assert failed.proposer._cached == failed.context[: len(failed.proposer._cached)]  # nothing ahead of the text
    for i in (0, 2, 3):
        assert seqs[i].context[len(seqs[i].prompt_ids):] == reference("llama", PROMPTS[i], 25)
    assert eng.target.open_slots == 1


@pytest.mark.parametrize("stage", ["commit", "emit"])
def test_a_sequence_that_fails_after_verification_ends_alone(stage):
    # After the shared pass each sequence commits its caches and emits its text: what fails there (a proposer's
    # commit, a detokenizer) is that sequence's alone, as a failed round is.
    eng = engine("llama")

    def fail(seq):
        if seq.prompt_ids == tiny_tokenizer()(PROMPTS[1])["input_ids"] and seq.stats.new_tokens >= 5:
            if stage == "commit":
                seq.proposer.observe = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
            else:
                seq.text.add = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))

    # A fixed k: every round drafts and commits a proposal, however a loaded machine prices drafting
    seqs = run_together(eng, [(p, greedy(25, adaptive=False)) for p in PROMPTS[:4]], fail=fail)
    assert seqs[1].finish == "error" and "injected" in seqs[1].error
    for i in (0, 2, 3):
        assert seqs[i].context[len(seqs[i].prompt_ids):] == reference("llama", PROMPTS[i], 25)
    assert eng.target.open_slots == 1


def test_a_draft_forward_that_fails_for_one_row_ends_only_that_request():
    # The draft model's forward is shared by the sequences drafting: what one alone brings ends its own round only.
    eng = engine("llama")
    doomed, failed_forwards = {}, []
    draft_model = eng.proposer.backend  # the draft's shared backend (forked proposers hold views of its slots)
    forward_batch = draft_model.forward_batch

    def mark(seq):
        if seq.prompt_ids == tiny_tokenizer()(PROMPTS[1])["input_ids"] and seq.stats.new_tokens >= 5:
            backend = seq.proposer.backend
            doomed["slot"] = backend.slot if hasattr(backend, "slot") else draft_model.default.slot

    def refuse_the_doomed_row(rows, **kwargs):
        if any(view.slot is doomed.get("slot") for view, _ in rows):
            failed_forwards.append(len(rows))
            raise RuntimeError("injected draft failure")
        return forward_batch(rows, **kwargs)

    draft_model.forward_batch = refuse_the_doomed_row
    seqs = run_together(eng, [(p, greedy(25, adaptive=False)) for p in PROMPTS[:4]], fail=mark)
    assert failed_forwards[0] > 1 and 1 in failed_forwards  # the shared forward, then the row alone
    assert seqs[1].finish == "error" and "injected draft failure" in seqs[1].error
    for i in (0, 2, 3):
        assert seqs[i].finish == "length"
        assert seqs[i].context[len(seqs[i].prompt_ids):] == reference("llama", PROMPTS[i], 25)


def test_a_seeded_sampled_request_repeats_alone_and_in_a_batch():
    eng = engine("llama")
    cfg = GenerationConfig.from_options(max_new_tokens=20, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    alone = [run_together(eng, [(PROMPTS[0], cfg)])[0].context for _ in range(2)]
    crowd = run_together(eng, [(PROMPTS[2], greedy(10)), (PROMPTS[0], cfg), (PROMPTS[3], greedy(15))])
    assert alone[0] == alone[1] == crowd[1].context


# --- the batched verifier against the scalar oracle --------------------------------------------------

def random_batch(seed, vocab=11):
    """Drafts of lengths 0..4, some drawn from a q, some one-hot, with target logits for each."""
    g = torch.Generator().manual_seed(seed)
    drafts, logits = [], []
    for n in (3, 0, 4, 1, 2):
        q = torch.softmax(torch.randn(n, vocab, generator=g) * 2, -1) if n % 2 else None  # [n, vocab]
        ids = tuple(torch.multinomial(q, 1, generator=g).flatten().tolist()) if q is not None else \
            tuple(torch.randint(vocab, (n,), generator=g).tolist())
        drafts.append(Draft(token_ids=ids, q=q))
        logits.append(torch.randn(n + 1, vocab, generator=g) * 2)  # [n + 1, vocab]
    return drafts, logits


SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5),
             SamplingConfig(temperature=1.3, top_p=0.8), SamplingConfig(temperature=1.0)]


def batched_verdicts(seed):
    drafts, logits = random_batch(seed)
    return drafts, logits, verify_batch(DraftBatch.of(drafts), torch.cat(logits), SAMPLINGS,
                                        [make_generator(seed * 10 + b) for b in range(5)])


def test_the_random_batches_take_every_path_in_sampled_rows():
    # The comparison below means something only if the sampled rows' drafts were kept in part, cut short, and kept
    # whole (the bonus token), over its seeds.
    kept, offered = [], []
    for seed in range(20):
        drafts, _, verdicts = batched_verdicts(seed)
        for b in range(1, 5):
            if drafts[b].token_ids:
                kept.append(verdicts[b].num_accepted)
                offered.append(len(drafts[b].token_ids))
    assert sum(0 < n < k for n, k in zip(kept, offered)) >= 3 and sum(n < k for n, k in zip(kept, offered)) >= 5
    assert any(n == k for n, k in zip(kept, offered))


@pytest.mark.parametrize("seed", range(20))
def test_batched_verdicts_equal_the_scalar_verifiers(seed):
    drafts, logits, batched = batched_verdicts(seed)
    for b, (draft, rows, sampling) in enumerate(zip(drafts, logits, SAMPLINGS)):
        if sampling.greedy:
            oracle = verify_greedy(draft.token_ids, rows)
        else:
            from draftwise.sampling import logits_to_probs
            oracle = verify_rejection(draft.token_ids, draft.q, logits_to_probs(rows, sampling),
                                      make_generator(seed * 10 + b))
        assert batched[b] == oracle


def test_the_batched_verifier_keeps_the_targets_distribution():
    """The first emitted token of a one-token draft follows p, row by row of a batch (chi-square)."""
    from scipy.stats import chisquare

    p_logits = torch.tensor([[1.0, 0.5, 0.0, -1.0, 0.2], [0.0, 0.0, 1.0, 0.0, 0.0]])  # [2, vocab]
    p = torch.softmax(p_logits, -1)
    q = torch.softmax(torch.tensor([[0.0, 1.5, 0.5, 0.0, -1.0]]), -1)  # [1, vocab]
    g = make_generator(0)
    counts = torch.zeros(5)
    n = 6000
    for _ in range(n // 2):
        x = int(torch.multinomial(q[0], 1, generator=g))
        drafts = [Draft((x,), q), Draft((2,), None)]  # drawn from q, and a one-hot guess
        verdicts = verify_batch(DraftBatch.of(drafts), torch.cat([p_logits, p_logits]),
                                [SamplingConfig(temperature=1.0)] * 2, [g, g])
        for draft, verdict in zip(drafts, verdicts):
            counts[draft.token_ids[0] if verdict.num_accepted else verdict.next_token] += 1
    assert chisquare(counts.numpy(), (p[0] * n).numpy()).pvalue > 1e-3


def test_a_target_pass_that_fails_for_one_row_ends_only_that_request():
    # What one sequence alone brings to the shared pass ends its own round only: the pass is tried row by row.
    eng = engine("llama")
    doomed, failed_passes = {}, []
    forward_batch = eng.target.forward_batch

    def mark(seq):
        if seq.prompt_ids == tiny_tokenizer()(PROMPTS[1])["input_ids"] and seq.stats.new_tokens >= 5:
            doomed["slot"] = seq.target

    def refuse_the_doomed_row(rows, **kwargs):
        if any(view is doomed.get("slot") for view, _ in rows):
            failed_passes.append(len(rows))
            raise RuntimeError("injected")
        return forward_batch(rows, **kwargs)

    eng.target.forward_batch = refuse_the_doomed_row
    seqs = run_together(eng, [(p, greedy(25)) for p in PROMPTS[:4]], fail=mark)
    assert failed_passes[0] > 1 and failed_passes[1] == 1  # the shared pass, then the row alone
    assert seqs[1].finish == "error" and "injected" in seqs[1].error
    for i in (0, 2, 3):
        assert seqs[i].context[len(seqs[i].prompt_ids):] == reference("llama", PROMPTS[i], 25)
    assert eng.target.open_slots == 1


def test_a_seeded_request_draws_the_same_when_a_batch_mates_row_fails_the_shared_verification(monkeypatch):
    # The shared verification draws for the rows before the one that fails it; verified again alone, the seeded
    # row must draw as it would have, or its text would depend on another request's failure.
    eng = engine("llama")
    cfg = GenerationConfig.from_options(max_new_tokens=20, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    alone = run_together(eng, [(PROMPTS[0], cfg)])[0].context
    real, shared_failures = round_module.verify_batch, []

    def draw_then_fail_when_shared(batch, logits, samplings, generators, drawn=None):
        verdicts = real(batch, logits, samplings, generators, drawn)
        if len(generators) > 1:
            shared_failures.append(len(generators))
            raise RuntimeError("injected after the draws")
        return verdicts

    monkeypatch.setattr(round_module, "verify_batch", draw_then_fail_when_shared)
    sampled = GenerationConfig.from_options(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    # Both prefilled at once, so they share every step (and every shared verification draws, then fails).
    crowd = run_together(eng, [(PROMPTS[2], sampled), (PROMPTS[0], cfg)], chunk=64)
    assert shared_failures and crowd[0].finish == crowd[1].finish == "length"
    assert crowd[1].context == alone


def test_a_stream_never_read_holds_no_slot_and_a_failed_open_gives_its_slot_back(monkeypatch):
    eng = engine("llama")
    slots = eng.target.open_slots
    for _ in range(3):
        eng.stream(PROMPTS[0], max_new_tokens=4)  # made, never iterated: its finally would never run
    assert eng.target.open_slots == slots
    assert [e.token_id for e in eng.stream(PROMPTS[1], max_new_tokens=4, ignore_eos=True)][:4] == \
        reference("llama", PROMPTS[1], 4)
    held = eng.open_sequence(tiny_tokenizer()(PROMPTS[0])["input_ids"], greedy(4))  # takes the default slot
    monkeypatch.setattr(eng.sequences, "_new_proposer", lambda method, draft=None: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(MemoryError):
        eng.open_sequence(tiny_tokenizer()(PROMPTS[1])["input_ids"], greedy(4))  # a slot of its own, then fails
    assert eng.target.open_slots == slots
    eng.close_sequence(held)


def test_a_fixed_k_sequence_stays_prefilled_when_a_round_leaves_its_draft_one_behind():
    # A draft that is the target keeps every token; the last is never fed, so the draft ends each round one behind.
    # That is the next round's to feed, as alone: the sequence must not drop out of the batch's steps for it.
    eng = Engine.from_models(model("llama", 0), tiny_tokenizer(), draft_model=model("llama", 0), method="draft")
    seq = eng.open_sequence(tiny_tokenizer()(PROMPTS[1])["input_ids"], greedy(16, k=3, adaptive=False))
    while not seq.prefill_done:
        eng.prefill(seq)
    for _ in range(3):
        eng.step([seq])
        assert seq.draft_behind == 1 and seq.prefill_done
    assert seq.stats.accepted == seq.stats.proposed == 9
    eng.close_sequence(seq)
