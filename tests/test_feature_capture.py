"""`--capture-features`: the target's features as it serves, kept per request, and a head trained from them alone.

Capturing must not change a token (greedy ids compared with and without it, alone and batched, chains and trees),
and what it keeps must be the target's own features of the text (compared with one pass over the finished text;
a control shifted by one position must not match)."""
from __future__ import annotations

import os
import queue
import stat
import threading

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from safetensors import safe_open

from draftwise import Engine
from draftwise.backends.prefix_cache import PrefixCache, features_entry
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.serve.feature_capture import FeatureCapture, captured_files
from draftwise.serve.scheduler import Scheduler
from draftwise.train.features import load_shards, target_features
from draftwise.train.head import CAPTURED_HELD_OUT, TrainConfig, train_head

PROMPTS = ("The quick brown fox jumps over the lazy dog.", "for i in range(10):\n    print(i * i)",
           "def add(a, b):\n    return a + b")
CFG = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def engine(method: str, sink=None) -> Engine:
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, layers=1),
                             method=method)
    eng.feature_sink = sink
    return eng


def batched(eng: Engine, prompts=PROMPTS, cfg=CFG):
    """Each prompt's sequence, stepped together to the end (closed)."""
    tok = eng.tokenizer
    seqs = [eng.open_sequence(tok.encode(p), cfg) for p in prompts]
    for seq in seqs:
        while not seq.prefill_done:
            eng.prefill(seq)
    while any(seq.finish is None for seq in seqs):
        eng.step([seq for seq in seqs if seq.finish is None])
    for seq in seqs:
        eng.close_sequence(seq)
    return seqs


@pytest.mark.parametrize("method", ["none", "draft", "lookup", "draft-tree", "hybrid"])
def test_capturing_changes_no_token_and_keeps_the_targets_own_features(method):
    plain = [seq.context for seq in batched(engine(method))]
    got: dict[int, list[tuple[int, torch.Tensor]]] = {}
    eng = engine(method, sink=lambda seq, start, f: got.setdefault(id(seq), []).append((start, f.clone())))
    seqs = batched(eng)
    assert [seq.context for seq in seqs] == plain  # token ids, batched
    reference = tiny_model("llama", 0)
    for seq in seqs:
        parts = sorted(got[id(seq)], key=lambda part: part[0])
        positions = [start + i for start, f in parts for i in range(len(f))]
        assert positions == list(range(len(seq.context) - 1))  # every position fed, once, in order
        captured = torch.cat([f for _, f in parts])  # [L - 1, H]
        own, _ = target_features(reference, seq.context[:-1])  # one pass over the text
        assert torch.allclose(captured.float(), own.float(), atol=1e-4, rtol=1e-3)
        assert not torch.allclose(captured[1:].float(), own[:-1].float(), atol=1e-2)  # the control: one off


def test_a_finished_request_is_written_whole_private_and_within_budget(tmp_path):
    folder = tmp_path / "captured"
    capture = FeatureCapture(folder, max_bytes=1 << 30)
    eng = engine("draft")
    scheduler = Scheduler(eng, max_batch=4, prefill_chunk=8, feature_capture=capture)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    done = queue.Queue()
    tok = eng.tokenizer
    for prompt in PROMPTS:
        scheduler.submit(tok.encode(prompt), CFG, lambda ev: ev.finish_reason and done.put(ev.finish_reason))
    cancelled = scheduler.submit(tok.encode("cancel me " * 4), GenerationConfig(max_new_tokens=200, ignore_eos=True),
                                 lambda ev: ev.finish_reason and done.put(ev.finish_reason))
    scheduler.cancel(cancelled)
    reasons = sorted(done.get(timeout=60) for _ in range(4))
    scheduler.drain(5)
    capture.close()
    assert reasons == ["cancelled", "length", "length", "length"]
    files = captured_files(folder)
    assert len(files) == 3 and capture.written == 3  # the cancelled request's answer is not kept
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(path).st_mode) == 0o600 for path in files)
    assert not list(folder.glob(".*partial"))
    sequences = load_shards(files)
    for sequence, path in zip(sequences, files):
        ids = sequence["ids"].tolist()
        assert sequence["next"].tolist() == ids[1:] + sequence["next"].tolist()[-1:]  # each position's next token
        assert tok.decode(ids[:sequence["answer_start"]]) in PROMPTS
        with safe_open(str(path), "pt") as f:
            assert f.metadata()["request_id"].startswith("req-") and f.metadata()["greedy"] == "true"
    # Past the budget the earliest go, the newest stays.
    small = FeatureCapture(tmp_path / "small", max_bytes=os.path.getsize(files[0]) + 1)
    for _ in range(3):
        seq = batched(eng, PROMPTS[:1])[0]
        small.observe(seq, 0, torch.zeros(len(seq.context) - 1, 64))
        small.finish(seq, "req-x", seq.finish)
    small.close()
    assert len(captured_files(tmp_path / "small")) == 1 and small.written == 3


def served_one_after_another(capture: FeatureCapture, eng: Engine, prompts) -> list:
    """Each prompt through a Scheduler, the next submitted once the last has ended; each request's finished seq."""
    scheduler = Scheduler(eng, max_batch=4, prefill_chunk=8, feature_capture=capture)
    ended = []
    original = capture.finish
    capture.finish = lambda seq, request_id, reason: (original(seq, request_id, reason), ended.append(seq))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    for prompt in prompts:
        done = queue.Queue()
        scheduler.submit(eng.tokenizer.encode(prompt), CFG, lambda ev: ev.finish_reason and done.put(ev.finish_reason))
        assert done.get(timeout=60) == "length"
    scheduler.drain(5)
    capture.close()
    return ended


def test_a_prompt_from_the_prompt_cache_is_captured_whole_with_the_features_kept_there(tmp_path):
    """A restored prompt computes no features for its restored part: the server keeps each captured request's
    features in the prompt cache, and the restored request takes its prefix's from there."""
    capture = FeatureCapture(tmp_path / "c", max_bytes=1 << 30)
    eng = engine("draft")
    eng.enable_prompt_cache(16 << 20)
    first, again = served_one_after_another(capture, eng, [PROMPTS[0], PROMPTS[0]])
    assert again.stats.prompt_cached > 0
    assert capture.written == 2 and capture.incomplete == 0
    records = load_shards(captured_files(tmp_path / "c"))
    reference = tiny_model("llama", 0)
    for seq, record in zip([first, again], records):
        assert record["ids"].tolist() == seq.context[:-1]
        own, _ = target_features(reference, seq.context[:-1])  # one pass over the text
        assert torch.allclose(record["features"].float(), own.float(), atol=1e-4, rtol=1e-3)
        assert not torch.allclose(record["features"][1:].float(), own[:-1].float(), atol=1e-2)  # the control
    restored = again.stats.prompt_cached
    assert torch.equal(records[1]["features"][:restored], records[0]["features"][:restored])  # the cache's copy


@pytest.mark.parametrize("cache", ["none attached", "no room for the features"])
def test_a_request_missing_its_first_positions_is_not_captured(tmp_path, cache):
    """Controls: a capture given no prompt cache, or one that does not hold the restored prefix's features, has no
    features for the restored part, and a head cannot learn from a text whose first positions it never sees."""
    capture = FeatureCapture(tmp_path / "c", max_bytes=1 << 30)
    eng = engine("draft", sink=capture.observe)
    eng.enable_prompt_cache(16 << 20)
    if cache == "no room for the features":  # (as where the cache let them go before the request came back)
        capture.attach_prompt_cache(PrefixCache(max_bytes=0), features_entry())
    first, again = batched(eng, PROMPTS[:1]), batched(eng, PROMPTS[:1])
    capture.finish(first[0], "req-a", "length"), capture.finish(again[0], "req-b", "length")
    capture.close()
    assert again[0].stats.prompt_cached > 0
    assert capture.written == 1 and capture.incomplete == 1


def test_a_full_queue_drops_the_request_not_the_server(tmp_path):
    capture = FeatureCapture(tmp_path / "c", max_bytes=1 << 30, queue_size=1)
    seq = batched(engine("draft"), PROMPTS[:1])[0]
    writers = capture._queue
    capture._queue = queue.Queue(1)
    capture._queue.put("a request the writer has not reached")  # the writer far behind
    capture.observe(seq, 0, torch.zeros(len(seq.context) - 1, 64))
    capture.finish(seq, "req-a", "length")  # returns at once
    assert capture.dropped == 1 and capture.written == 0
    writers.put(None)  # (the writer's own queue: it stops)


def test_a_head_trains_from_captured_requests_alone_and_holds_out_the_latest(tmp_path):
    folder = tmp_path / "captured"
    capture = FeatureCapture(folder, max_bytes=1 << 30)
    eng = engine("none", sink=capture.observe)
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    for prompt in prompts:
        seq = batched(eng, [prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True))[0]
        capture.finish(seq, f"req-{prompt[:4]}", seq.finish)
    capture.close()
    files = captured_files(folder)
    assert len(files) == len(prompts)
    cfg = TrainConfig(seq_len=64, epochs=1, lr=5e-3, warmup_steps=2, intermediate_size=64, readout=300,
                      checkpoint_every=20)
    calls = []
    import draftwise.train.head as head

    original = head.collect
    head.collect = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        record = train_head(tiny_model("llama", 0), tiny_tokenizer(), tmp_path / "head", cfg, progress=False,
                            log=lambda _: None, captured=files)
    finally:
        head.collect = original
    assert not calls  # no target pass: the features are the server's
    held = max(1, round(len(files) * CAPTURED_HELD_OUT))
    assert record["sequences"] == len(files) and "held out" in record["corpus"]
    assert record["val_tokens"] == sum(len(s["ids"]) for s in load_shards(files[-held:]))  # the latest, by time
    assert record["val_after"][-1]["top1"] >= 0.0 and (tmp_path / "head" / "training.json").is_file()


def test_a_backend_without_hidden_states_refuses_capture():
    from argparse import Namespace

    from draftwise.serve.command import _feature_capture

    class Target:
        backend_name = "llamacpp"

    class Eng:
        target = Target()

    with pytest.raises(DraftwiseError, match="--capture-features needs the target's hidden states"):
        _feature_capture(Namespace(capture_features="/tmp/x", capture_features_mb=1.0), Eng())


def test_an_answer_that_ends_at_its_eos_is_kept_one_cut_short_is_not(tmp_path):
    capture = FeatureCapture(tmp_path / "c", max_bytes=1 << 30)
    eng = engine("draft", sink=capture.observe)
    for reason in ("eos", "stop", "content_filter", "error", "cancelled"):
        seq = batched(eng, PROMPTS[:1])[0]
        capture.finish(seq, f"req-{reason}", reason)
    capture.close()
    assert capture.written == 2 and not capture._parts
