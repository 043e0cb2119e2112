"""draftwise loadgen: the summary math on made-up timings, the chunk parsing, and whole runs against a stand-in
OpenAI streaming server (a stdlib http.server thread on 127.0.0.1), never the real draftwise server."""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftwise.errors import DraftwiseError
from draftwise.bench.load_plan import LoadPlan, base_url, request_body
from draftwise.bench.load_record import (RequestRecord, finish_record, http_error, sse_data, take_chunk,
                                         time_per_token)
from draftwise.bench.load_report import markdown_table, throttle_table
from draftwise.bench.load_stats import acceptance, percentile, summarise
from draftwise.bench.interleave import order_for_repeat
from draftwise.bench.loadgen_command import add_loadgen, plan_from_args, without_secrets

# -- the summary math -----------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks_like_numpy():
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order of arrival does not matter
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0 and percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0


def _rec(mode, c, **kw):
    return RequestRecord(mode, c, kw.pop("prompt_id", "p"), **kw)


def test_summary_per_mode_and_level_with_ratio_against_one_user_without_speculation():
    records = [
        # off, c1: 2 requests, 10 tokens each, in 4 s -> 5 tok/s
        _rec("off", 1, ttft_s=0.5, gaps_s=[0.2, 0.2, 0.4], completion_tokens=10, level_wall_s=4.0),
        _rec("off", 1, ttft_s=1.5, gaps_s=[0.2], completion_tokens=10, level_wall_s=4.0),
        # on, c2: 3 requests, one failed (its tokens and times do not count); 30 tokens in 2 s -> 15 tok/s
        _rec("on", 2, ttft_s=0.1, gaps_s=[0.1, 0.3], completion_tokens=20, level_wall_s=2.0,
             stats={"method": "draft", "proposed": 8, "accepted": 6, "mean_accepted_length": 3.0}),
        _rec("on", 2, ttft_s=0.3, gaps_s=[0.1], completion_tokens=10, level_wall_s=2.0,
             stats={"method": "draft", "proposed": 2, "accepted": 0, "mean_accepted_length": 1.0}),
        _rec("on", 2, ttft_s=9.0, gaps_s=[9.0], completion_tokens=99, error="HTTP 500: boom", level_wall_s=2.0),
    ]
    off, on = summarise(records)
    assert (off["mode"], off["concurrency"], on["mode"], on["concurrency"]) == ("off", 1, "on", 2)
    assert off["tokens_per_s"] == pytest.approx(5.0) and on["tokens_per_s"] == pytest.approx(15.0)
    assert off["vs_c1_off"] == pytest.approx(1.0) and on["vs_c1_off"] == pytest.approx(3.0)
    assert (on["requests"], on["failed"], on["tokens"]) == (3, 1, 30)
    assert off["ttft_p50_s"] == pytest.approx(1.0) and off["ttft_p95_s"] == pytest.approx(1.45)
    # TBT pools every gap of every successful request: [0.2, 0.2, 0.4, 0.2] -> p50 0.2, p95 0.37
    assert off["tbt_p50_s"] == pytest.approx(0.2) and off["tbt_p95_s"] == pytest.approx(0.37)
    assert on["tbt_p50_s"] == pytest.approx(0.1) and on["tbt_p95_s"] == pytest.approx(0.28)  # not the failed 9.0
    # acceptance pooled over proposed tokens: 6 / 10, not the mean of 0.75 and 0.0
    assert on["acceptance"] == pytest.approx(0.6) and off["acceptance"] is None
    assert on["mean_accepted_length"] == pytest.approx(2.0) and on["server_methods"] == ["draft"]


def test_summary_without_a_baseline_or_any_success():
    rows = summarise([_rec("on", 4, error="timed out after 1s", level_wall_s=1.0),
                      _rec("on", 4, error="ConnectError", level_wall_s=1.0)])
    (row,) = rows
    assert row["failed"] == 2 and row["tokens"] == 0 and row["tokens_per_s"] == 0.0
    assert row["vs_c1_off"] is None and row["ttft_p50_s"] is None and row["tbt_p95_s"] is None
    table = markdown_table(rows)
    assert "| on | 4 | 2 (2) | 0.0 | - | - / - | - / - | - / - | - |" in table


def test_acceptance_falls_back_to_the_mean_of_reported_rates():
    assert acceptance([_rec("on", 1, acceptance=0.5), _rec("on", 1, acceptance=1.0), _rec("on", 1)]) == 0.75
    assert acceptance([_rec("on", 1)]) is None


def _runs(mode, method, c, rates, tokens=60):
    """One record per repeat whose run made `tokens` tokens at these rates (None: the repeat did not run)."""
    return [_rec(mode, c, method=method, repeat=i, completion_tokens=tokens, level_wall_s=tokens / rate)
            for i, rate in enumerate(rates) if rate is not None]


def test_repeats_give_the_median_and_range_and_the_throttle_judges_repeat_by_repeat():
    records = [*_runs("on", "hybrid", 4, [20.0, 30.0, 24.0]), *_runs("always", "hybrid", 4, [18.0, 28.0, 30.0]),
               *_runs("off", None, 4, [21.0, 25.0, 22.0]),
               *_runs("on", "lookup", 4, [19.0, 22.0, 20.0]), *_runs("always", "lookup", 4, [15.0, 16.0, 15.0])]
    rows = summarise(records)
    on = next(r for r in rows if r["mode"] == "on" and r["method"] == "hybrid")
    assert on["tokens_per_s"] == pytest.approx(24.0) and on["runs_tokens_per_s"] == pytest.approx([20, 30, 24])
    assert (on["tokens_per_s_low"], on["tokens_per_s_high"]) == pytest.approx((20.0, 30.0))
    # Repeat by repeat against the better rival: 20/21, 30/28, 24/30 -> median 0.952, range 0.8-1.07
    assert on["on_vs_best"] == pytest.approx(20 / 21) and on["throttle_holds"]
    assert (on["on_vs_best_low"], on["on_vs_best_high"]) == pytest.approx((0.8, 30 / 28))
    # The control: lookup's on is below off in every repeat (19/21, 22/25, 20/22): the throttle fails it.
    lookup = next(r for r in rows if r["mode"] == "on" and r["method"] == "lookup")
    assert lookup["on_vs_best"] == pytest.approx(19 / 21) and lookup["throttle_holds"] is False
    table = throttle_table(rows)
    assert "| hybrid | 4 | 24.0 | 28.0 | 22.0 | 0.95x (0.80-1.07) | yes |" in table
    assert "| lookup | 4 | 20.0 | 15.0 | 22.0 | 0.90x (0.88-0.91) | **no** |" in table
    assert "| hybrid | on | 4 | 3 (0) | 24.0 (20.0-30.0) |" in markdown_table(rows)
    # Nothing to judge without a rival at the level; always and off rows carry no verdict.
    alone = summarise(_runs("on", "draft", 2, [10.0]))
    assert alone[0]["on_vs_best"] is None and alone[0]["throttle_holds"] is None and throttle_table(alone) == ""
    assert "on_vs_best" not in next(r for r in rows if r["mode"] == "off")


def test_interleaved_order_mirrors_each_pair_of_repeats_and_rotates_across_pairs():
    cells = ["a", "b", "c"]
    orders = [order_for_repeat(cells, r) for r in range(6)]
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"], ["a", "c", "b"], ["c", "a", "b"],
                      ["b", "a", "c"]]
    # Each pair is a mirror: a cell's mean position over the pair is the midpoint, so a steady drift cancels.
    for even, odd in zip(orders[::2], orders[1::2]):
        assert all(even.index(c) + odd.index(c) == len(cells) - 1 for c in cells)
    # Over the three pairs every cell takes every position twice.
    assert all(sorted(o.index(c) for o in orders) == [0, 0, 1, 1, 2, 2] for c in cells)
    assert [order_for_repeat(["x", "y"], r) for r in range(2)] == [["x", "y"], ["y", "x"]]
    assert order_for_repeat([], 3) == []


def test_slices_cut_a_cells_requests_and_interleave_a_methods_modes_slice_by_slice():
    plan = LoadPlan(url="http://h:1", levels=(1, 3, 8), modes=("on", "off"), prompts=(), requests=8,
                    methods=("draft", "lookup"), repeats=2, slices=4)
    assert plan.parts(1) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert plan.parts(3) == [range(0, 4), range(4, 8)]  # never fewer requests than the concurrency
    assert plan.parts(8) == [range(0, 8)]
    runs = list(plan.schedule(3))
    # A block per method; within it both modes for each slice in turn, mirrored slice to slice; the next repeat
    # runs the blocks backwards and goes on mirroring.
    assert runs == [(0, 0, "on", "draft"), (0, 0, "off", "draft"), (0, 1, "off", "draft"), (0, 1, "on", "draft"),
                    (0, 0, "on", "lookup"), (0, 0, "off", "lookup"), (0, 1, "off", "lookup"), (0, 1, "on", "lookup"),
                    (1, 0, "off", "lookup"), (1, 0, "on", "lookup"), (1, 1, "on", "lookup"), (1, 1, "off", "lookup"),
                    (1, 0, "off", "draft"), (1, 0, "on", "draft"), (1, 1, "on", "draft"), (1, 1, "off", "draft")]
    # One slice: each repeat's cells as before slices existed (blocks and cells by the repeat's order).
    whole = LoadPlan(url="http://h:1", levels=(1,), modes=("on", "off"), prompts=(), methods=("draft", "lookup"),
                     repeats=2)
    assert [run[2:] for run in whole.schedule(1)] == [
        ("on", "draft"), ("off", "draft"), ("on", "lookup"), ("off", "lookup"),
        ("off", "lookup"), ("on", "lookup"), ("off", "draft"), ("on", "draft")]


def test_a_repeats_rate_pools_its_slices():
    """A repeat's tokens over the sum of its slices' walls, not the median of slices nor one slice's wall."""
    records = [_rec("on", 2, repeat=0, part=0, completion_tokens=30, level_wall_s=1.0),
               _rec("on", 2, repeat=0, part=0, completion_tokens=30, level_wall_s=1.0),
               _rec("on", 2, repeat=0, part=1, completion_tokens=60, level_wall_s=3.0),
               _rec("off", 2, repeat=0, part=0, completion_tokens=60, level_wall_s=2.0),
               _rec("off", 2, repeat=0, part=1, completion_tokens=60, level_wall_s=2.0)]
    rows = summarise(records)
    on = next(r for r in rows if r["mode"] == "on")
    assert on["runs_tokens_per_s"] == pytest.approx([120 / 4.0]) and on["wall_s"] == pytest.approx(4.0)
    assert on["on_vs_best"] == pytest.approx(30.0 / 30.0)


# -- one stream's chunks ----------------------------------------------------------------------------------


def test_chat_chunks_fold_into_times_tokens_and_stats():
    r = _rec("on", 1)
    take_chunk(r, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.05)
    take_chunk(r, {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}, 0.5)
    take_chunk(r, {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]}, 0.75)
    take_chunk(r, {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": None}]}, 1.25)
    take_chunk(r, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, 1.3)
    take_chunk(r, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
                   "draftwise": {"acceptance_rate": 0.5, "proposed": 4, "accepted": 2}}, 1.31)
    assert r.ttft_s == 0.5 and r.chunk_times_s == [0.5, 0.75, 1.25] and r.gaps_s == pytest.approx([0.25, 0.5])
    assert r.finish_reason == "length" and r.completion_tokens == 3 and r.tokens_from_usage
    assert r.acceptance == 0.5 and r.stats["accepted"] == 2
    finish_record(r)
    assert r.error == "the stream ended before data: [DONE]"  # never saw [DONE]


def test_completion_chunks_error_chunks_and_no_usage():
    r = _rec("off", 1)
    for t, text in ((0.1, "a"), (0.2, ""), (0.4, "b")):
        take_chunk(r, {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}, t)
    take_chunk(r, {"error": {"message": "the request failed while generating: boom", "type": "server_error"}}, 0.5)
    r.done = True
    finish_record(r)
    assert r.ttft_s == 0.1 and r.gaps_s == pytest.approx([0.3]) and r.completion_tokens == 2  # chunks counted
    assert not r.tokens_from_usage and r.error == "error in stream: the request failed while generating: boom"
    with pytest.raises(ValueError):
        take_chunk(r, ["not", "an", "object"], 0.6)
    # Chunks of another shape are a bad stream for their request (ValueError), never an error that ends the run.
    for chunk in ({"choices": [None]}, {"choices": "abc"}, {"choices": [{"delta": "x"}]},
                  {"usage": {"completion_tokens": None}}, {"draftwise": {"proposed": "many"}}):
        with pytest.raises(ValueError, match="not in OpenAI's shape"):
            take_chunk(_rec("on", 1), chunk, 0.1)


def test_llama_servers_timings_give_acceptance_and_tpot_counts_tokens_not_chunks():
    """llama-server reports its drafts in `timings`; a verified draft's tokens may come in one chunk, so TPOT
    divides by the tokens the server counted, not by the chunks."""
    r = _rec("on", 1)
    for t, text in ((1.0, "a"), (1.1, "bcd"), (2.0, "ef")):  # 6 tokens in 3 chunks
        take_chunk(r, {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}, t)
    take_chunk(r, {"choices": [], "usage": {"completion_tokens": 6},
                   "timings": {"predicted_n": 6, "draft_n": 8, "draft_n_accepted": 6}}, 2.01)
    r.done = True
    finish_record(r)
    assert r.completion_tokens == 6 and r.acceptance == 0.75 and time_per_token(r) == pytest.approx(1.0 / 5)
    assert acceptance([r]) == 0.75 and r.stats is None
    # Without usage, the timings' count, not the chunks'.
    bare = _rec("on", 1)
    take_chunk(bare, {"choices": [{"index": 0, "text": "abc"}]}, 0.1)
    take_chunk(bare, {"choices": [], "timings": {"predicted_n": 3}}, 0.2)
    bare.done = True
    finish_record(bare)
    assert bare.completion_tokens == 3 and time_per_token(bare) == 0.0 and time_per_token(_rec("on", 1)) is None
    with pytest.raises(ValueError, match="not in OpenAI's shape"):
        take_chunk(_rec("on", 1), {"timings": {"draft_n": "eight"}}, 0.1)


def test_sse_lines_and_http_errors():
    assert sse_data("data: [DONE]") == "[DONE]" and sse_data('data:{"a":1}') == '{"a":1}'
    assert sse_data("") is None and sse_data(": keep-alive") is None and sse_data("event: x") is None
    body = json.dumps({"error": {"message": "too many waiting requests", "type": "rate_limit"}}).encode()
    assert http_error(429, body) == "HTTP 429: too many waiting requests"
    assert http_error(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    assert http_error(500, b"") == "HTTP 500: (empty body)"


def test_urls_and_request_bodies():
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert base_url("https://example.org/api/v1") == "https://example.org/api"
    for bad in ("ftp://127.0.0.1:8000", "127.0.0.1:8000", "http://"):
        with pytest.raises(DraftwiseError, match="--url"):
            base_url(bad)
    plan = plan_from_args(_args("--url", "http://h:1", "--method", "lookup", "--per-category", "1"))
    assert plan.methods == ("lookup",)
    on, off = request_body("m", plan, "on", "lookup"), request_body("m", plan, "off", "lookup")
    assert on["speculation"] == {"method": "lookup"} and off["speculation"] == {"method": "none"}
    assert on["stream"] and on["stream_options"] == {"include_usage": True} and on["temperature"] == 0
    plain = plan_from_args(_args("--url", "http://h:1", "--per-category", "1"))
    assert "speculation" not in request_body("m", plain, "on")
    assert request_body("m", plain, "always")["speculation"] == {"adaptive": False}
    assert request_body("m", plan, "always", "lookup")["speculation"] == {"method": "lookup", "adaptive": False}
    # METHOD:DRAFT drafts with a version loaded beside the server's own draft; off stays the target alone.
    versions = plan_from_args(_args("--url", "http://h:1", "--methods", "hybrid,hybrid:d@v1", "--per-category", "1"))
    assert versions.methods == ("hybrid", "hybrid:d@v1")
    assert request_body("m", versions, "on", "hybrid:d@v1")["speculation"] == {"method": "hybrid", "draft": "d@v1"}
    assert request_body("m", versions, "off", "hybrid:d@v1")["speculation"] == {"method": "none"}
    # Every level sends the same requests: one per prompt, at least the largest concurrency.
    assert [plain.count(c) for c in (1, 2, 4, 8)] == [max(len(plain.prompts), 8)] * 4
    fixed = plan_from_args(_args("--url", "http://h:1", "--requests", "3", "--per-category", "1"))
    assert [fixed.count(c) for c in (1, 2, 4, 8)] == [3, 3, 4, 8]  # never below the concurrency


def test_the_report_keeps_the_command_without_the_api_key():
    argv = ["--url", "http://h:1", "--api-key", "s3cret", "--api-key=0ther", "--max-tokens", "8"]
    kept = " ".join(without_secrets(argv))
    assert "s3cret" not in kept and "0ther" not in kept and "--max-tokens 8" in kept and "--api-key" in kept
    assert "s3cret" in " ".join(argv)  # (the control: it was there to hide)


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "--concurrency"), (["--concurrency", "0"], "--concurrency"),
    (["--speculation", "on,maybe"], "--speculation"), (["--requests", "0"], "--requests"),
    (["--repeats", "0"], "--repeats"), (["--slices", "0"], "--slices"), (["--methods", " , "], "--methods"), (["--methods", "draft:"], "--methods"),
    (["--methods", ":d@v1"], "--methods"),
    (["--max-tokens", "0"], "--max-tokens"), (["--timeout", "0"], "--timeout"), (["--timeout", "inf"], "--timeout"),
    (["--categories", "nope"], "unknown category"),
    (["--temperature", "2.5"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--seed", "1"], "--seed apply to sampled runs only"), (["--top-p", "0.9"], "--top-p apply"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p"), (["--temperature", "0.7", "--seed", "-1"], "--seed"),
])
def test_bad_options_fail_before_any_request(argv, message):
    with pytest.raises(DraftwiseError, match=message):
        plan_from_args(_args("--url", "http://127.0.0.1:9", *argv))


def _args(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_loadgen(parser.add_subparsers(), argparse.HelpFormatter)
    return parser.parse_args(["loadgen", *argv])


# -- whole runs against a stand-in server -----------------------------------------------------------------

TOKENS = ["Hello", ",", " world", "!"]


# What a strict OpenAI-compatible server takes (llama-server's own extensions among them); anything else is refused.
OPENAI_FIELDS = {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream",
                 "stream_options", "top_k", "min_p"}


class StandIn:
    """An OpenAI-style streaming server on a free loopback port. It records each request; `faults` maps the
    n-th POST (1-based, warm-ups included) to what goes wrong with it. kind: 'draftwise' (owned_by draftwise, its
    stats in the last chunk) or 'llama.cpp' (as llama-server: /props with build_info, timings instead of stats, a
    request with a field it does not know refused with 400, as a strict server may)."""

    def __init__(self, key: str | None = None, faults: dict | None = None, gap_s: float = 0.002,
                 kind: str = "draftwise"):
        self.key, self.faults, self.gap_s, self.kind = key, faults or {}, gap_s, kind
        self.posts: list[tuple[str, dict]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                if self._refused():
                    return
                llama = standin.kind == "llama.cpp"
                if self.path == "/props":
                    return self._json(200, {"build_info": "b7777-standin", "total_slots": 4} if llama else {})
                owner = "llamacpp" if llama else "draftwise"
                self._json(200, {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": owner}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                with standin.lock:
                    standin.posts.append((self.path, body))
                    fault = standin.faults.get(len(standin.posts))
                    standin.in_flight += 1
                    standin.most_in_flight = max(standin.most_in_flight, standin.in_flight)
                self._counted = True
                try:
                    self._answer(body, fault)
                except OSError:  # the client gave up (a timeout test)
                    pass
                finally:
                    self._leave()

            def _leave(self):
                """Out of the in-flight count before the response's last bytes: a client that has read them may send
                its next request before this thread runs again, and would be counted twice."""
                if getattr(self, "_counted", False):
                    self._counted = False
                    with standin.lock:
                        standin.in_flight -= 1

            def _answer(self, body, fault):
                if fault == "500":
                    return self._json(500, {"error": {"message": "boom", "type": "server_error", "param": None}})
                unknown = sorted(set(body) - OPENAI_FIELDS)
                if standin.kind == "llama.cpp" and unknown:
                    return self._json(400, {"error": {"message": f"unknown fields: {unknown}", "type": "invalid"}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                chat = self.path == "/v1/chat/completions"
                if chat:
                    self._event({"object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i, token in enumerate(TOKENS[: body["max_tokens"]]):
                    if fault == "stall":
                        time.sleep(5)
                    if fault == "cut" and i == 2:
                        return
                    time.sleep(standin.gap_s)
                    self._event(self._chunk(chat, token, None))
                if fault == "error chunk":
                    self._event({"error": {"message": "the request failed while generating: x",
                                           "type": "server_error"}})
                    return self._done()
                self._event(self._chunk(chat, "", "length"))
                off = body.get("speculation") == {"method": "none"}
                stats = None if off else {"method": "draft", "proposed": 4, "accepted": 3, "acceptance_rate": 0.75,
                                          "mean_accepted_length": 2.0}
                n = min(len(TOKENS), body["max_tokens"])
                last = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
                if standin.kind == "llama.cpp":
                    last["timings"] = {"predicted_n": n, "draft_n": 4, "draft_n_accepted": 2}
                else:
                    last["draftwise"] = stats
                self._event(last)
                self._done()

            @staticmethod
            def _chunk(chat, text, finish):
                if chat:
                    return {"object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"content": text} if text else {},
                                         "finish_reason": finish}]}
                return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

            def _refused(self) -> bool:
                if standin.key and self.headers.get("Authorization") != f"Bearer {standin.key}":
                    self._json(401, {"error": {"message": "invalid API key", "type": "invalid_request_error"}})
                    return True
                return False

            def _event(self, payload):
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            def _done(self):
                self._leave()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _json(self, status, payload):
                self._leave()
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


@pytest.fixture
def standin(request):
    server = StandIn(**getattr(request, "param", {}))
    yield server
    server.close()


def _run(*argv) -> int:
    args = _args(*argv)
    return args.func(args)


def test_a_run_writes_results_report_and_plot(tmp_path, standin, capsys, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_API_KEY", "")
    code = _run("--url", standin.url + "/v1", "--concurrency", "1,3", "--requests", "5", "--max-tokens", "4",
                "--categories", "qa,translation", "--per-category", "2", "--out", str(tmp_path))
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["summary"]
    assert [(r["mode"], r["concurrency"], r["requests"]) for r in rows] == [
        ("on", 1, 5), ("off", 1, 5), ("on", 3, 5), ("off", 3, 5)]
    assert all(r["failed"] == 0 and r["tokens"] == 5 * 4 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["ttft_p50_s"] > 0 and r["tbt_p50_s"] > 0 and r["tbt_p95_s"] >= r["tbt_p50_s"] for r in rows)
    assert [r["acceptance"] for r in rows] == [0.75, None, 0.75, None]
    assert rows[1]["vs_c1_off"] == pytest.approx(1.0)
    # 20 counted requests, 8 warm-ups (as many as the level's concurrency, at once: 1 + 1 + 3 + 3); each counted one
    # has 4 content chunks, so 3 gaps
    assert len(results["requests"]) == 20 and len(standin.posts) == 28
    assert all(len(r["chunk_times_s"]) == 4 and len(r["gaps_s"]) == 3 and r["tokens_from_usage"]
               for r in results["requests"])
    assert standin.most_in_flight == 3
    # what was sent: chat, greedy, streamed with usage; off asks for the target alone, on for the default
    paths = {path for path, _ in standin.posts}
    assert paths == {"/v1/chat/completions"}
    bodies = [body for _, body in standin.posts]
    assert all(b["messages"][0]["role"] == "user" and b["temperature"] == 0 and b["stream"] for b in bodies)
    assert sum(b.get("speculation") == {"method": "none"} for b in bodies) == 14  # 10 counted, 1 + 3 warm-ups
    assert sum("speculation" not in b for b in bodies) == 14
    report = (tmp_path / "report.md").read_text()
    assert "| on | 3 | 5 (0) |" in report and "| off | 1 | 5 (0) |" in report and "1.00x" in report
    assert (tmp_path / "loadgen.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr()
    assert out.out.startswith("| method | speculation | concurrency |") and "concurrency 3" in out.err


def test_several_methods_and_repeats_run_interleaved_each_beside_its_own_off(tmp_path, standin, capsys):
    code = _run("--url", standin.url, "--methods", "draft,lookup", "--speculation", "on,always,off", "--repeats", "2",
                "--concurrency", "1", "--requests", "2", "--max-tokens", "2", "--per-category", "1",
                "--out", str(tmp_path))
    assert code == 0
    asked = [(b.get("speculation") or {}) for _, b in standin.posts]
    sent = [("off" if a.get("method") == "none" else "always" if a.get("adaptive") is False else "on", a["method"])
            for a in asked]
    draft = [("on", "draft"), ("always", "draft"), ("off", "none")]
    lookup = [("on", "lookup"), ("always", "lookup"), ("off", "none")]
    # Repeat 0: each cell's warm-up, then its two requests, a block per method; repeat 1: no warm-up, repeat 0's
    # cells backwards (the blocks and the cells within each).
    again = (draft + lookup)[::-1]
    assert sent == [c for c in draft + lookup for _ in range(3)] + [c for c in again for _ in range(2)]
    rows = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert [(r["mode"], r["method"]) for r in rows] == [("on", "draft"), ("always", "draft"), ("off", "draft"),
                                                         ("on", "lookup"), ("always", "lookup"), ("off", "lookup")]
    assert all(r["requests"] == 4 and len(r["runs_tokens_per_s"]) == 2 for r in rows)
    assert all(r["on_vs_best"] > 0 for r in rows if r["mode"] == "on")
    out = capsys.readouterr().out
    assert "| lookup | always | 1 | 4 (0) |" in out and "| none (beside lookup) | off | 1 | 4 (0) |" in out
    assert "on / best of always, off" in out and "## Throttle" in (tmp_path / "report.md").read_text()


def test_slices_take_turns_within_a_cell_and_count_every_request_once(tmp_path, standin, capsys):
    code = _run("--url", standin.url, "--methods", "draft", "--speculation", "on,off", "--slices", "2",
                "--concurrency", "1", "--requests", "4", "--max-tokens", "2", "--per-category", "1",
                "--out", str(tmp_path))
    assert code == 0
    sent = ["off" if (b.get("speculation") or {}).get("method") == "none" else "on" for _, b in standin.posts]
    # on: warm-up and slice 1 (2 requests); off: warm-up and slice 1; slice 2 mirrored: off then on.
    assert sent == ["on"] * 3 + ["off"] * 3 + ["off"] * 2 + ["on"] * 2
    results = json.loads((tmp_path / "results.json").read_text())
    asked = [r["prompt_id"] for r in results["requests"] if r["mode"] == "on"]
    first_four = [b["messages"][0]["content"] for _, b in standin.posts[1:3] + standin.posts[8:10]]
    assert len(set(first_four)) == 4 and len(asked) == 4  # slice 2 sends requests 3 and 4, not 1 and 2 again
    assert [r["part"] for r in results["requests"] if r["mode"] == "on"] == [0, 0, 1, 1]
    assert all(r["requests"] == 4 and len(r["runs_tokens_per_s"]) == 1 for r in results["summary"])
    assert results["meta"]["slices"] == 2 and "2 slices" in (tmp_path / "report.md").read_text()
    assert "slice 2/2" in capsys.readouterr().err


def test_the_throttle_judges_on_against_the_off_beside_it():
    """Each method's on against the off run in its own block (the same minutes), not another block's."""
    records = [*_runs("on", "draft", 2, [20.0, 30.0]), *_runs("off", "draft", 2, [25.0, 30.0]),
               *_runs("on", "lookup", 2, [20.0, 30.0]), *_runs("off", "lookup", 2, [20.0, 28.0])]
    rows = summarise(records)
    verdict = {r["method"]: r["on_vs_best"] for r in rows if r["mode"] == "on"}
    assert verdict == pytest.approx({"draft": (0.8 + 1.0) / 2, "lookup": (1.0 + 30 / 28) / 2})
    table = throttle_table(rows)
    assert "| draft | 2 | 25.0 | - | 27.5 | 0.90x (0.80-1.00) | **no** |" in table


@pytest.mark.parametrize("standin", [{"faults": {3: "500", 4: "error chunk", 5: "cut", 6: "stall"}}],
                         indirect=True)
def test_failures_are_counted_never_retried(tmp_path, standin, capsys):
    code = _run("--url", standin.url, "--concurrency", "1", "--speculation", "on", "--requests", "6",
                "--max-tokens", "3", "--no-chat", "--timeout", "0.5", "--per-category", "1", "--out", str(tmp_path),
                "--json")
    assert code == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["requests"], row["failed"], row["tokens"]) == (6, 4, 2 * 3)
    requests = json.loads((tmp_path / "results.json").read_text())["requests"]
    errors = [r["error"] for r in requests]
    assert errors[0] is None and errors[5] is None
    assert errors[1] == "HTTP 500: boom" and requests[1]["status"] == 500
    assert errors[2] == "error in stream: the request failed while generating: x"
    assert errors[3] == "the stream ended before data: [DONE]"
    assert errors[4] == "timed out after 0.5s"
    assert len(standin.posts) == 7  # the warm-up and six, none sent again
    assert {path for path, _ in standin.posts} == {"/v1/completions"}
    assert all("prompt" in body and "messages" not in body for _, body in standin.posts)


@pytest.mark.parametrize("standin", [{"key": "sesame"}], indirect=True)
def test_a_wrong_api_key_stops_the_run_with_the_servers_reason(tmp_path, standin, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_API_KEY", "wrong")
    with pytest.raises(DraftwiseError, match="HTTP 401: invalid API key; pass --api-key"):
        _run("--url", standin.url, "--concurrency", "1", "--per-category", "1", "--out", str(tmp_path))
    assert not (tmp_path / "results.json").exists()
    assert _run("--url", standin.url, "--api-key", "sesame", "--concurrency", "1", "--speculation", "off",
                "--requests", "1", "--per-category", "1", "--out", str(tmp_path)) == 0
    # with --model given, /v1/models is skipped and the warm-up is the first to meet the refusal
    monkeypatch.delenv("DRAFTWISE_API_KEY")
    with pytest.raises(DraftwiseError, match="warm-up request .* HTTP 401"):
        _run("--url", standin.url, "--model", "m", "--concurrency", "1", "--per-category", "1",
             "--out", str(tmp_path))


def test_an_unusable_out_is_refused_before_any_request(tmp_path, standin):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    with pytest.raises(DraftwiseError, match="cannot make the folder"):
        _run("--url", standin.url, "--concurrency", "1", "--per-category", "1", "--out", str(a_file / "sub"))
    assert standin.posts == []


def test_levels_run_before_a_failing_one_are_written(tmp_path, standin, monkeypatch):
    # The server went away at the second level: what the first measured is kept, with the error raised after.
    from draftwise.bench import loadgen

    real_warm_up, levels = loadgen._warm_up, []

    async def warm_up_then_fail_at_the_second_level(http, plan, body, mode, level):
        levels.append(level)
        if level == 3:
            raise DraftwiseError("the server went away")
        return await real_warm_up(http, plan, body, mode, level)

    monkeypatch.setattr(loadgen, "_warm_up", warm_up_then_fail_at_the_second_level)
    with pytest.raises(DraftwiseError, match="the server went away"):
        _run("--url", standin.url, "--concurrency", "1,3", "--speculation", "on", "--requests", "2",
             "--max-tokens", "2", "--per-category", "1", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert [(r["concurrency"], r["requests"]) for r in rows] == [(1, 2)]


def test_the_run_never_goes_through_a_proxy_from_the_environment(tmp_path, standin, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nobody listens there
    monkeypatch.setenv("NO_PROXY", "")
    assert _run("--url", standin.url, "--concurrency", "1", "--speculation", "off", "--requests", "1",
                "--per-category", "1", "--out", str(tmp_path)) == 0


def test_no_server_at_the_address_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(DraftwiseError, match=f"cannot reach http://127.0.0.1:{port}"):
        _run("--url", f"http://127.0.0.1:{port}", "--per-category", "1", "--out", str(tmp_path))


# -- sampled runs, and servers that are not draftwise ------------------------------------------------------


def test_a_sampled_run_sends_the_temperature_and_a_seed_per_request(tmp_path, standin):
    code = _run("--url", standin.url, "--concurrency", "1,2", "--speculation", "on", "--requests", "3",
                "--max-tokens", "2", "--per-category", "1", "--temperature", "0.7", "--seed", "5",
                "--out", str(tmp_path))
    assert code == 0
    bodies = [body for _, body in standin.posts]
    assert all(b["temperature"] == 0.7 and b["top_p"] == 1.0 for b in bodies)
    assert not any("top_k" in b or "min_p" in b for b in bodies)  # llama.cpp's fields, for llama.cpp alone
    # Each level: its warm-ups (seeds 5, 5 + 1, ...), then requests 0-2 with seeds 5, 6, 7, the same at every level.
    # At concurrency 2 the posts of one group race each other, so that level is compared group by group as sets.
    seeds = [b["seed"] for b in bodies]
    assert seeds[:4] == [5, 5, 6, 7]
    assert sorted(seeds[4:6]) == [5, 6] and sorted(seeds[6:]) == [5, 6, 7]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["seed"] for r in results["requests"]] == [5, 6, 7, 5, 6, 7]
    assert results["meta"]["temperature"] == 0.7 and results["meta"]["seed"] == 5
    assert results["meta"]["server"] == "draftwise" and results["meta"]["server_kind"] == "draftwise"
    report = (tmp_path / "report.md").read_text()
    assert "temperature 0.7, top_p 1, seed 5 + the request's index" in report and "temperature 0 " not in report
    # Greedy (the default) sends no seed nor top_p, and says so.
    greedy = StandIn()
    try:
        assert _run("--url", greedy.url, "--concurrency", "1", "--speculation", "on", "--requests", "1",
                    "--max-tokens", "1", "--per-category", "1", "--out", str(tmp_path / "g")) == 0
        assert all(b["temperature"] == 0 and "seed" not in b and "top_p" not in b for _, b in greedy.posts)
        assert "temperature 0 (greedy)" in (tmp_path / "g" / "report.md").read_text()
    finally:
        greedy.close()


@pytest.mark.parametrize("standin", [{"kind": "llama.cpp"}], indirect=True)
def test_llama_server_is_sent_no_draftwise_field_and_named_in_the_report(tmp_path, standin, capsys):
    code = _run("--url", standin.url, "--concurrency", "1,2", "--speculation", "on", "--requests", "2",
                "--max-tokens", "4", "--per-category", "1", "--temperature", "0.7", "--out", str(tmp_path))
    assert code == 0  # the stand-in refuses (400) any body with a field it does not know: none was sent
    bodies = [body for _, body in standin.posts]
    assert len(bodies) == 1 + 2 + 2 + 2 and not any(set(b) - OPENAI_FIELDS for b in bodies)
    assert all(b["top_k"] == 0 and b["min_p"] == 0.0 and b["temperature"] == 0.7 for b in bodies)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["server"] == "llama.cpp llama-server b7777-standin"
    assert all(r["failed"] == 0 and r["acceptance"] == 0.5 and r["tpot_p50_s"] > 0 for r in results["summary"])
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(f"# Load test of {standin.url}, llama.cpp llama-server b7777-standin")
    assert "no `speculation` field sent" in report and "llama.cpp llama-server b7777-standin" in capsys.readouterr().err


@pytest.mark.parametrize("standin", [{"kind": "llama.cpp"}], indirect=True)
def test_the_control_a_draftwise_field_sent_to_llama_server_fails(tmp_path, standin):
    """Taken for draftwise (--server draftwise), a method is asked for in the `speculation` field, and the strict
    server refuses it: the check above would catch a body that carried it."""
    with pytest.raises(DraftwiseError, match=r"warm-up request .* HTTP 400: unknown fields: \['speculation'\]"):
        _run("--url", standin.url, "--server", "draftwise", "--concurrency", "1", "--speculation", "on",
             "--methods", "hybrid", "--requests", "1", "--max-tokens", "2", "--per-category", "1",
             "--out", str(tmp_path))
    assert [set(b) - OPENAI_FIELDS for _, b in standin.posts] == [{"speculation"}]


@pytest.mark.parametrize("standin", [{"kind": "llama.cpp"}], indirect=True)
def test_modes_a_plain_server_cannot_run_are_refused_before_any_request(tmp_path, standin):
    for argv in (["--speculation", "on,off"], ["--speculation", "on", "--methods", "lookup"]):
        with pytest.raises(DraftwiseError, match="llama.cpp llama-server b7777-standin, not draftwise"):
            _run("--url", standin.url, "--concurrency", "1", "--per-category", "1", "--out", str(tmp_path), *argv)
    assert standin.posts == []
    # --server plain: taken for a server that takes no draftwise field, whatever /v1/models says.
    plain = StandIn()
    try:
        with pytest.raises(DraftwiseError, match=r"an OpenAI-compatible server \(owned_by 'draftwise'\), not draft"):
            _run("--url", plain.url, "--server", "plain", "--concurrency", "1", "--per-category", "1",
                 "--out", str(tmp_path))
        assert plain.posts == []
    finally:
        plain.close()
