"""The proposal log: one row per proposed token, written off the hot path, bounded, readable, exportable."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time

import pytest

from conftest import FinalEvents, tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.cli import main
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.metrics import Stats
from draftwise.serve.log_command import export_pairs, log_stats
from draftwise.serve.proposal_log import ProposalLog, round_rows
from draftwise.serve.scheduler import Scheduler

PROMPTS = ["The quick brown fox", "def quicksort(arr):\n", "for i in range(10):", "Summaries copy spans of",
           "The dog sleeps; the fox runs away. The dog"]


def engine(method="draft"):
    draft = tiny_model("llama", 1, 1) if method == "draft" else None
    return Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=draft, method=method)


def serve(log, requests, method="draft"):
    """Run (prompt, max_tokens) requests through a scheduler with the log; returns each one's final event."""
    scheduler = Scheduler(engine(method), max_batch=3, prefill_chunk=4, proposal_log=log)
    scheduler.start()
    finals, done = {}, threading.Semaphore(0)

    def sink_for(i):
        def sink(event):
            if event.finish_reason is not None:
                finals[i] = event
                done.release()
        return sink

    for i, (prompt, n) in enumerate(requests):
        cfg = GenerationConfig(max_new_tokens=n, ignore_eos=True, num_draft_tokens=3, adaptive=False)
        scheduler.submit(tiny_tokenizer()(prompt)["input_ids"], cfg, sink_for(i), request_id=f"r{i}")
    for _ in requests:
        assert done.acquire(timeout=60)
    scheduler.drain(5)
    log.close()
    return [finals[i] for i in range(len(requests))]


def rows(path, table="rounds"):
    """Every row of a log's table (rounds, or requests), as dicts, in the order written."""
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(f"SELECT * FROM {table} ORDER BY rowid")]
    finally:
        db.close()


def texts(path):
    db = sqlite3.connect(path)
    try:
        return {rid: json.loads(p) + json.loads(o) for rid, p, o in
                db.execute("SELECT request_id, prompt_ids, output_ids FROM requests")}
    finally:
        db.close()


def test_one_row_per_proposed_token_with_the_targets_token_and_accepted_flags(tmp_path):
    path = tmp_path / "log.sqlite"
    finals = serve(ProposalLog(path), [(p, 14) for p in PROMPTS])
    logged = rows(path)
    assert len(logged) == sum(f.stats.proposed for f in finals) > 0
    assert sum(r["accepted"] for r in logged) == sum(f.stats.accepted for f in finals)
    text = texts(path)
    assert set(text) == {f"r{i}" for i in range(len(PROMPTS))}
    rounds: dict[tuple, list[dict]] = {}
    for r in logged:
        rounds.setdefault((r["request_id"], r["step"]), []).append(r)
    for (request_id, _), group in rounds.items():
        flags = [r["accepted"] for r in group]
        assert flags == sorted(flags, reverse=True)  # kept tokens are a prefix of the draft
        for r in group:
            assert r["method"] == "draft" and r["draft_s"] >= 0 and r["verify_s"] > 0
            at = r["offset"] + r["position"]
            if r["accepted"]:
                assert r["target"] == r["proposed"] == text[request_id][at]
            elif r["target"] is not None:  # the first rejected position: the target's own token went out
                assert r["target"] != r["proposed"] and r["target"] == text[request_id][at]
        assert sum(r["target"] is not None for r in group) == min(len(group), flags.count(1) + 1)


def test_a_full_queue_drops_rows_and_counts_them_never_a_request(tmp_path):
    gate = threading.Event()

    class SlowDisk(ProposalLog):
        def _write(self, db, items):
            gate.wait(30)  # the disk has fallen behind: the queue fills
            super()._write(db, items)

    path = tmp_path / "log.sqlite"
    log = SlowDisk(path, queue_size=1)
    finals_box = []
    runner = threading.Thread(target=lambda: finals_box.append(serve(log, [(p, 12) for p in PROMPTS[:3]])))
    runner.start()
    while runner.is_alive() and log.dropped == 0:
        runner.join(0.05)
    gate.set()
    runner.join(60)
    finals = finals_box[0]
    assert all(f.finish_reason == "length" for f in finals)  # every request finished
    assert log.dropped > 0
    assert len(rows(path)) + log.dropped == sum(f.stats.proposed for f in finals)
    # A request's own row lost the same way is counted too: its arm's figures in `log stats` lack it.
    assert len(texts(path)) + log.requests_dropped == len(finals)
    stats = log_stats(path)
    assert stats["rows_dropped"] == log.dropped and stats["requests_dropped"] == log.requests_dropped


def test_a_log_that_cannot_be_opened_by_the_writer_counts_every_row_lost(tmp_path, monkeypatch):
    path = tmp_path / "log.sqlite"
    log_module = __import__("draftwise.serve.proposal_log", fromlist=["connect"])
    real_connect = log_module.connect

    def gone_once_started(p, create=False):
        if not create:
            raise log_module.DraftwiseError("no proposal log there")  # the file went away after start
        return real_connect(p, create)

    monkeypatch.setattr(log_module, "connect", gone_once_started)
    log = ProposalLog(path)
    finals = serve(log, [(p, 8) for p in PROMPTS[:2]])
    assert log.dropped == sum(f.stats.proposed for f in finals) and log.requests_dropped == len(finals)


def test_the_log_keeps_at_most_max_rows_the_newest(tmp_path):
    path = tmp_path / "log.sqlite"
    finals = serve(ProposalLog(path, max_rows=10), [(p, 16) for p in PROMPTS[:3]])
    logged = rows(path)
    assert 0 < len(logged) <= 10 < sum(f.stats.proposed for f in finals)
    assert logged[-1]["id"] == sum(f.stats.proposed for f in finals)  # the newest stayed
    assert set(texts(path)) == {r["request_id"] for r in logged}  # requests no row needs are gone


def test_stats_and_export_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "log.sqlite"
    finals = serve(ProposalLog(path), [(p, 14) for p in PROMPTS[:4]])
    assert main(["log", "stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["proposed"] == sum(f.stats.proposed for f in finals)
    assert stats["acceptance"] == pytest.approx(stats["accepted"] / stats["proposed"], abs=1e-4)
    assert sum(p["proposed"] for p in stats["by_position"]) == stats["proposed"]
    assert [p["position"] for p in stats["by_position"]] == list(range(len(stats["by_position"])))
    assert stats["by_method_and_arm"][0]["method"] == "draft"
    assert sum(s["proposed"] for s in stats["over_time"]) == stats["proposed"]
    assert main(["log", "stats", str(path)]) == 0
    assert "by draft position" in capsys.readouterr().out

    out = tmp_path / "pairs.jsonl"
    assert main(["log", "export", str(path), "--jsonl", str(out)]) == 0
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    text = texts(path)
    assert len(pairs) == sum(r["target"] is not None for r in rows(path)) > 0
    for pair in pairs:  # each pair is a real position of a real text, and the target is what was emitted there
        assert any(t[: len(pair["context"])] == pair["context"] and t[len(pair["context"])] == pair["target"]
                   for t in text.values())


def test_a_log_that_cannot_be_written_or_read_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DraftwiseError, match="cannot write the proposal log"):
        ProposalLog(blocker / "log.sqlite")
    with pytest.raises(DraftwiseError, match="no proposal log at"):
        log_stats(tmp_path / "missing.sqlite")
    with pytest.raises(DraftwiseError, match="no proposal log at"):
        export_pairs(tmp_path / "missing.sqlite", None)


def test_a_file_that_is_not_a_proposal_log_is_refused_and_left_as_it_was(tmp_path, capsys):
    text, empty, other = tmp_path / "pairs.jsonl", tmp_path / "empty.db", tmp_path / "other.sqlite"
    text.write_text('{"context": [1]}\n')
    empty.write_bytes(b"")
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE things (x)")
    for path in (text, empty, other):
        before = path.read_bytes()
        assert main(["log", "stats", str(path)]) == 1
        assert "is not a proposal log" in capsys.readouterr().err
        assert path.read_bytes() == before and not path.with_name(path.name + "-wal").exists()


def test_export_writes_its_file_whole_or_not_at_all(tmp_path, capsys):
    kept = tmp_path / "pairs.jsonl"
    kept.write_text("earlier pairs\n")
    assert main(["log", "export", str(tmp_path / "typo.sqlite"), "--jsonl", str(kept)]) == 1
    assert kept.read_text() == "earlier pairs\n"  # a wrong log name no longer empties the file first
    path = tmp_path / "log.sqlite"
    serve(ProposalLog(path), [(PROMPTS[0], 6)])
    assert main(["log", "export", str(path), "--jsonl", str(tmp_path / "no-such-dir" / "pairs.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "Traceback" not in err


def test_the_target_alone_logs_nothing(tmp_path):
    path = tmp_path / "log.sqlite"
    serve(ProposalLog(path), [(PROMPTS[0], 8)], method="none")
    assert rows(path) == [] and texts(path) == {}


def test_an_off_arms_requests_go_with_the_rows_of_their_time(tmp_path):
    """A request that never proposed has no rows to go with: it stays while the rows of its time do, so the arms
    kept are compared over the same span."""
    path = tmp_path / "log.sqlite"
    log = ProposalLog(path, max_rows=8)  # more than the requests: only the rounds' rows rotate them

    def request(request_id, arm, proposed):
        if proposed:
            log.record_round(round_rows(request_id, arm, 1, 1, "draft", (5, 6, 5, 6), 1, 7, 0.0, 0.0))
        time.sleep(0.01)  # every row's time differs
        stats = Stats("draft" if proposed else "none", 4, new_tokens=2, proposed=4 * proposed, target_forwards=1)
        log.record_request(request_id, arm, stats.method, [1], [5, 7], "length", stats=stats)
        time.sleep(0.01)

    for request_id, arm, proposed in [("old-off", "off", False), ("r1", "k2", True), ("r2", "k2", True),
                                      ("new-off", "off", False), ("r3", "k2", True)]:
        request(request_id, arm, proposed)
    log.close()
    assert [r["request_id"] for r in rows(path)] == ["r2"] * 4 + ["r3"] * 4  # 12 rows, the newest 8 kept
    assert set(texts(path)) == {"r2", "new-off", "r3"}


def test_a_log_from_before_the_timing_columns_gets_them(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE requests (request_id TEXT PRIMARY KEY, ts REAL NOT NULL, arm TEXT NOT NULL, "
               "method TEXT NOT NULL, prompt_ids TEXT NOT NULL, output_ids TEXT NOT NULL, finish TEXT, fallback TEXT)")
    db.execute("INSERT INTO requests VALUES ('old', 0, '', 'draft', '[1]', '[2]', 'length', NULL)")
    db.commit()
    db.close()
    log = ProposalLog(path)
    log.record_request("new", "", "draft", [1], [2, 3], "length",
                       stats=Stats("draft", 4, new_tokens=2, target_forwards=1, decode_s=0.5), ttft_s=0.1,
                       last_token_s=0.3)
    log.close()
    [arm] = log_stats(path)["by_arm"]
    assert arm["requests"] == 2 and arm["mean_accepted_length"] == 2.0 and arm["tokens_per_s"] == 4.0
    assert arm["ttft_ms"] == pytest.approx(100) and arm["tbt_ms"] == pytest.approx(200)  # the old row: unknown


# --- fallback: a failing or slow proposer leaves its request on the target alone, still exact ---------------

def _alone(prompt, n):
    eng = engine("none")
    return eng.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids


def test_a_proposer_that_raises_mid_request_gives_the_exact_target_only_output(tmp_path):
    path = tmp_path / "log.sqlite"
    eng = engine()
    log = ProposalLog(path)
    scheduler = Scheduler(eng, max_batch=3, prefill_chunk=4, proposal_log=log)
    doomed_prompt = tiny_tokenizer()(PROMPTS[1])["input_ids"]
    real = eng.proposer.fork

    def fork():  # every sequence's own proposer; the doomed one breaks on its third round
        proposer = real()
        start, rounds = proposer.start, {"n": 0}

        def failing_start(context, k, stop=0.0):
            if context[: len(doomed_prompt)] == doomed_prompt:
                rounds["n"] += 1
                if rounds["n"] == 3:
                    raise RuntimeError("the draft model fell over")
            return start(context, k, stop)

        proposer.start = failing_start
        return proposer

    eng.proposer.fork = fork
    scheduler.start()
    finals, done = {}, threading.Semaphore(0)
    for i, prompt in enumerate(PROMPTS[:3]):
        def sink(event, i=i):
            if event.finish_reason is not None:
                finals[i] = event
                done.release()
        scheduler.submit(tiny_tokenizer()(prompt)["input_ids"], GenerationConfig(max_new_tokens=16, ignore_eos=True, adaptive=False),
                         sink, request_id=f"r{i}")
    for _ in range(3):
        assert done.acquire(timeout=60)
    scheduler.drain(5)
    log.close()
    assert [finals[i].finish_reason for i in range(3)] == ["length"] * 3
    assert "fell over" in finals[1].stats.fallback and finals[0].stats.fallback is None
    db = sqlite3.connect(path)
    assert db.execute("SELECT request_id FROM requests WHERE fallback IS NOT NULL").fetchall() == [("r1",)]
    assert log_stats(path)["requests_fallen_back"] == 1
    texts_ = texts(path)
    for i, prompt in enumerate(PROMPTS[:3]):
        assert texts_[f"r{i}"][len(tiny_tokenizer()(prompt)["input_ids"]):] == _alone(prompt, 16)


def test_a_step_that_drafts_past_the_timeout_falls_back_and_stays_exact():
    eng = engine()
    scheduler = Scheduler(eng, max_batch=2, prefill_chunk=8, draft_timeout_s=1e-9)  # every draft is too slow
    scheduler.start()
    finals = FinalEvents()
    scheduler.submit(tiny_tokenizer()(PROMPTS[0])["input_ids"], GenerationConfig(max_new_tokens=12, ignore_eos=True, adaptive=False),
                     finals.sink)
    assert finals.wait()
    scheduler.drain(5)
    stats = finals.events[0].stats
    assert stats.fallback.startswith("TimeoutError") and stats.new_tokens == 12
    assert stats.proposed > 0 and set(stats.proposed_at) == {1}  # one drafted round, then plain steps
    with pytest.raises(DraftwiseError, match="draft timeout must be > 0"):
        Scheduler(eng, draft_timeout_s=0)


def test_a_blocked_response_leaves_no_text_in_the_log(tmp_path):
    """What the guard stopped is neither exported for training nor kept in the log's rows."""
    path = tmp_path / "log.sqlite"
    log = ProposalLog(path)
    for request_id in ("kept", "blocked"):
        log.record_round(round_rows(request_id, "", 1, 5, "draft", (7, 8), 1, 9, 0.01, 0.02))
    log.record_request("kept", "", "draft", [1, 2, 3], [7, 9], "length")
    log.record_request("blocked", "", "draft", [1, 2, 3], [7, 9], "content_filter")
    log.close()
    assert {r["request_id"] for r in rows(path)} == {"kept"}
    with sqlite3.connect(path) as db:
        outputs = dict(db.execute("SELECT request_id, output_ids FROM requests"))
    assert json.loads(outputs["blocked"]) == [] and json.loads(outputs["kept"]) == [7, 9]


def test_export_writes_to_a_pipe_as_it_is(tmp_path, capsys):
    path = tmp_path / "log.sqlite"
    serve(ProposalLog(path), [(PROMPTS[0], 6)])
    fifo = tmp_path / "pairs.fifo"
    os.mkfifo(fifo)
    read = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_text()))
    reader.start()
    assert main(["log", "export", str(path), "--jsonl", str(fifo)]) == 0  # (a partial file beside it would never reach it)
    reader.join(timeout=30)
    assert read and all(json.loads(line)["context"] for line in read[0].splitlines())
    assert not list(tmp_path.glob(".*partial"))


def test_the_log_is_its_owners_alone_and_deleted_rows_leave_no_bytes(tmp_path):
    path = tmp_path / "log.db"
    log = ProposalLog(path)
    log.record_request("secret-request", "default", "draft", [101, 102, 103], [7, 8, 9, 4242], "stop")
    log.record_round(round_rows("secret-request", "default", 0, 3, "draft", (7, 8), 1, 9, 0.01, 0.02))
    log.close()
    assert (path.stat().st_mode & 0o777) == 0o600
    wal = path.with_name(path.name + "-wal")
    assert not wal.exists() or (wal.stat().st_mode & 0o777) == 0o600
    assert main(["log", "purge", str(path), "--request", "secret-request", "--json"]) == 0
    for file in (path, wal):  # neither the request's id nor its rows are anywhere in the files
        assert not file.exists() or b"secret-request" not in file.read_bytes()
    assert log_stats(path)["requests_finished"] == 0


def test_rows_older_than_the_retention_go_and_purge_takes_an_age(tmp_path, capsys):
    path = tmp_path / "log.db"
    log = ProposalLog(path, max_age_s=3600)
    now = time.time()
    log.record_request("kept", "default", "draft", [1], [2], "stop")
    log.close()
    db = sqlite3.connect(path)
    with db:  # a request of two hours ago, as an older server run left it
        db.execute("INSERT INTO requests (request_id, ts, arm, method, prompt_ids, output_ids, finish) VALUES "
                   "('old', ?, 'default', 'draft', '[1]', '[2]', 'stop')", (now - 7200,))
    db.close()
    log = ProposalLog(path, max_age_s=3600)
    log.record_request("new", "default", "draft", [1], [2], "stop")  # each write drops what is past the retention
    log.close()
    assert {r["request_id"] for r in rows(path, "requests")} == {"kept", "new"}
    assert main(["log", "purge", str(path), "--older-than", "0"]) == 0
    assert "deleted 2 requests" in capsys.readouterr().out and rows(path, "requests") == []
    with pytest.raises(DraftwiseError, match="proposal-log-days must be > 0"):
        ProposalLog(path, max_age_s=0)
