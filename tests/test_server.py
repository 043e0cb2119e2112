"""The server end to end: the official openai client against a live uvicorn on 127.0.0.1, tiny models.

Every test is bounded: requests are short, clients time out, waits poll with a deadline.
"""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.serve.app import create_app
from draftwise.serve.command import serve_in_thread
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.scheduler import Scheduler

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "def quicksort(arr):\n", "for i in range(10):", "Summaries copy spans of",
           "The dog sleeps; the fox", "Speculative decoding proposes", "print(i * i)", "the article says that"]


def start(api_key=None, max_waiting=64, max_batch=8):
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                                method="draft")
    metrics = ServeMetrics()
    scheduler = Scheduler(engine, max_batch=max_batch, max_waiting=max_waiting, prefill_chunk=4, metrics=metrics)
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, MODEL, metrics, api_key))
    return url, scheduler, metrics, stop


@pytest.fixture(scope="module")
def server():
    url, scheduler, metrics, stop = start()
    yield url, scheduler, metrics
    stop()
    scheduler.drain(5)


def client(url, key="unused"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def complete(url, prompt, **extra):
    options = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    options.update(extra)
    return client(url).completions.create(**options)


def alone(scheduler, prompt, max_tokens=16, **options):
    """The same request on a fresh engine of the same models, one at a time: the reference."""
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                                method="draft")
    return engine.generate(prompt, max_new_tokens=max_tokens, **options).text


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_models_lists_the_served_model(server):
    assert [m.id for m in client(server[0]).models.list().data] == [MODEL]


def test_a_completion_is_the_targets_own_text_with_usage_and_stats(server):
    url, scheduler, _ = server
    out = complete(url, PROMPTS[0])
    assert out.choices[0].text == alone(scheduler, PROMPTS[0])
    prompt_tokens = len(tiny_tokenizer()(PROMPTS[0])["input_ids"])
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == prompt_tokens
    stats = out.model_extra["draftwise"]
    assert stats["method"] == "draft" and stats["new_tokens"] == 16 and stats["proposed"] > 0
    assert stats["arm"] == ""  # no experiment


def test_chat_streaming_equals_chat_whole_and_reports_usage(server):
    url = server[0]
    messages = [{"role": "user", "content": "Write quicksort."}]
    whole = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_stop_string_ends_the_text_before_it(server):
    url, scheduler, _ = server
    full = complete(url, PROMPTS[1], max_tokens=24).choices[0].text
    stop = full[5:8]
    out = complete(url, PROMPTS[1], max_tokens=24, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[: full.index(stop)]
    chunks = list(complete(url, PROMPTS[1], max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Without stream_options.include_usage, the last chunk still carries the request's stats.
    assert chunks[-1].model_extra["draftwise"]["new_tokens"] == out.model_extra["draftwise"]["new_tokens"]


def test_per_request_speculation_settings(server):
    url = server[0]
    off = complete(url, PROMPTS[2], extra_body={"speculation": "off"})
    lookup = complete(url, PROMPTS[2], extra_body={"speculation": {"method": "lookup", "num_draft_tokens": 2}})
    draft = complete(url, PROMPTS[2], extra_body={"speculation": {"method": "draft", "adaptive": False,
                                                                  "num_draft_tokens": 3}})
    assert off.model_extra["draftwise"]["method"] == "none" and off.model_extra["draftwise"]["proposed"] == 0
    assert lookup.model_extra["draftwise"]["method"] == "lookup"
    assert lookup.model_extra["draftwise"]["num_draft_tokens"] == 2
    assert draft.model_extra["draftwise"]["per_position_acceptance"][:3]  # three positions offered
    assert off.choices[0].text == lookup.choices[0].text == draft.choices[0].text


@pytest.mark.parametrize("options,param", [
    ({"temperature": 5}, "temperature"), ({"n": 2}, "n"), ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"), ({"top_p": 0}, "top_p"), ({"stop": ["a"] * 5}, "stop"),
    ({"extra_body": {"speculation": {"method": "psychic"}}}, "speculation.method"),
    ({"extra_body": {"speculation": {"num_draft_tokens": 0}}}, "speculation.num_draft_tokens"),
    ({"extra_body": {"speculation": {"k": 3}}}, "speculation"), ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"seed": 1.5}, "seed"), ({"echo": True}, "echo"), ({"logprobs": 2}, "logprobs"),
    ({"seed": 2**64}, "seed"), ({"max_tokens": 10**400}, "max_tokens"),  # (past a float's range: no overflow)
    ({"stop": "x" * 1001}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"max_completion_tokens": None, "max_tokens": 10**6}}, "max_tokens"),
    ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
])
def test_bad_parameters_are_400s_that_name_the_parameter(server, options, param):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server[0], PROMPTS[0], **options)
    assert caught.value.body["param"] == param and caught.value.body["message"]


def test_unknown_model_malformed_json_and_overlong_prompts(server):
    url, _, metrics = server
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    raw = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    nan = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": "hi", "temperature": NaN}')
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        complete(url, "word " * 600)
    assert caught.value.code == "context_length_exceeded"
    parts = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    not_text = httpx.post(f"{url}/v1/chat/completions", json=parts)
    assert not_text.status_code == 400 and not_text.json()["error"]["param"] == "messages"
    assert complete(url, PROMPTS[0]).choices[0].text  # and the server goes on serving


def test_bodies_no_tokenizer_or_parser_can_take_are_400s_or_413_not_500s(server, monkeypatch):
    url = server[0]

    def post(content: bytes, route="completions"):
        return httpx.post(f"{url}/v1/{route}", content=content, headers={"content-type": "application/json"})

    surrogate = post(b'{"model": "tiny", "prompt": "a\\ud800"}')  # a lone surrogate, as JSON may escape it
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt"
    chat = post(b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}', "chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    digits = post(b'{"model": "tiny", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}")
    deep = post(b"[" * 200_000)
    assert digits.status_code == deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"
    # Refused by their size before a tokenizer or the per-id check runs on the event loop.
    for prompt in ("word " * 10_000, [1] * 100_000):  # (the tiny context: 512 tokens, 32,768 characters)
        too_long = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt}, timeout=30)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    ids = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, len(tiny_tokenizer())]})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    monkeypatch.setattr("draftwise.serve.routes.body.MAX_BODY_BYTES", 1000)
    large = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x" * 2000})
    assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large"
    assert complete(url, PROMPTS[0]).choices[0].text  # and the server goes on serving


def test_unknown_routes_and_methods_answer_in_openais_error_shape(server):
    url = server[0]
    missing = httpx.post(f"{url}/v1/embeddings", json={})
    wrong_method = httpx.get(f"{url}/v1/completions")
    assert missing.status_code == 404 and "/v1/completions" in missing.json()["error"]["message"]
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]


def test_a_prompt_of_token_ids_is_the_same_request_as_its_text(server):
    url = server[0]
    ids = tiny_tokenizer()(PROMPTS[5])["input_ids"]
    assert complete(url, ids).choices[0].text == complete(url, PROMPTS[5]).choices[0].text


def test_32_requests_at_concurrency_8_each_equal_to_alone(server):
    url, scheduler, metrics = server
    requests = [(PROMPTS[i % 8], 8 + (i * 5) % 17) for i in range(32)]  # ragged lengths: rows leave mid-batch
    batches = []
    real_observe = metrics.observe_step
    metrics.observe_step = lambda size, *a: (batches.append(size), real_observe(size, *a))
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda r: complete(url, r[0], max_tokens=r[1]).choices[0].text, requests))
    finally:
        metrics.observe_step = real_observe
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                                method="draft")
    for (prompt, n), text in zip(requests, got):
        assert text == engine.generate(prompt, max_new_tokens=n).text
    assert max(batches) > 1  # they really shared steps


def test_a_disconnect_mid_stream_cancels_and_frees_the_slot(server):
    url, scheduler, _ = server
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    wait_until(lambda: scheduler.running == 0 and scheduler.engine.target.open_slots == 1)


def test_a_round_that_raises_ends_only_its_request_with_a_500(server):
    url, scheduler, _ = server
    poison = tiny_tokenizer()(PROMPTS[4])["input_ids"]

    def inject(seq):
        if seq.prompt_ids == poison and seq.stats.new_tokens >= 3:
            raise RuntimeError("injected fault")

    scheduler.fault_injector = inject
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, url, p, max_tokens=20) for p in PROMPTS[3:7]]
            with pytest.raises(openai.InternalServerError) as caught:
                futures[1].result()
            others = [f.result().choices[0].text for i, f in enumerate(futures) if i != 1]
    finally:
        scheduler.fault_injector = None
    assert "injected fault" in caught.value.body["message"]
    assert others == [alone(scheduler, p, 20) for i, p in enumerate(PROMPTS[3:7]) if i != 1]


def test_a_round_that_raises_mid_stream_ends_the_stream_with_an_error_event(server):
    url, scheduler, _ = server
    poison = tiny_tokenizer()(PROMPTS[4])["input_ids"]
    scheduler.fault_injector = lambda seq: seq.prompt_ids == poison and seq.stats.new_tokens >= 3 and 1 / 0
    try:
        with ThreadPoolExecutor(2) as pool:
            bystander = pool.submit(complete, url, PROMPTS[6], max_tokens=20)
            stream = complete(url, PROMPTS[4], max_tokens=20, stream=True)
            with pytest.raises(openai.APIError, match="ZeroDivisionError"):
                list(stream)
            assert bystander.result().choices[0].text == alone(scheduler, PROMPTS[6], 20)
    finally:
        scheduler.fault_injector = None


def metric(url, name, labels=""):
    """A sample's value (0 when absent); labels as '{a="x",b="y"}', in any order (the client may sort them)."""
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
    return 0.0


def test_metrics_move_by_what_the_requests_produced(server):
    url, scheduler, _ = server
    names = ["draftwise_emitted_tokens_total", "draftwise_proposed_tokens_total", "draftwise_accepted_tokens_total",
             "draftwise_requests_total", "draftwise_rejected_requests_total"]
    labels = ['{arm=""}', '{method="draft",arm=""}', '{method="draft",arm=""}', '{finish_reason="length",arm=""}',
              '{reason="invalid_parameter"}']  # refusals have no arm: they were never served
    before = [metric(url, n, l) for n, l in zip(names, labels)]
    outs = [complete(url, p, max_tokens=10) for p in PROMPTS[:3]]
    with pytest.raises(openai.BadRequestError):
        complete(url, PROMPTS[0], temperature=-1)
    after = [metric(url, n, l) for n, l in zip(names, labels)]
    stats = [o.model_extra["draftwise"] for o in outs]
    assert after[0] - before[0] == sum(o.usage.completion_tokens for o in outs)
    assert after[1] - before[1] == sum(s["proposed"] for s in stats)
    assert after[2] - before[2] == sum(s["accepted"] for s in stats)
    assert after[3] - before[3] == 3 and after[4] - before[4] == 1
    assert "draftwise_time_to_first_token_seconds_bucket" in httpx.get(f"{url}/metrics").text


def metric_sum(url, name):
    """The sum of a labelled counter over all its label values."""
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_metrics_by_position_passes_and_refusals_by_reason(server):
    url = server[0]
    counters = ["draftwise_proposed_tokens_by_position_total", "draftwise_accepted_tokens_by_position_total",
                "draftwise_proposed_tokens_total", "draftwise_accepted_tokens_total"]
    reasons = ["invalid_json", "unknown_model", "context_length", "not_found"]
    before = [metric_sum(url, n) for n in counters] + [metric(url, "draftwise_verification_passes_total")]
    before_reasons = [metric(url, "draftwise_rejected_requests_total", f'{{reason="{r}"}}') for r in reasons]
    outs = [complete(url, p, max_tokens=12, extra_body={"speculation": {"num_draft_tokens": 3}}) for p in PROMPTS[:2]]
    httpx.post(f"{url}/v1/completions", content=b"[")
    httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "word " * 600})
    httpx.get(f"{url}/v2/nothing")
    after = [metric_sum(url, n) for n in counters] + [metric(url, "draftwise_verification_passes_total")]
    after_reasons = [metric(url, "draftwise_rejected_requests_total", f'{{reason="{r}"}}') for r in reasons]
    moved = [a - b for a, b in zip(after, before)]
    assert moved[0] == moved[2] == sum(o.model_extra["draftwise"]["proposed"] for o in outs)  # each offer has a place
    assert moved[1] == moved[3] == sum(o.model_extra["draftwise"]["accepted"] for o in outs)
    assert 1 <= moved[4] <= sum(o.model_extra["draftwise"]["target_forwards"] for o in outs)  # batched: maybe fewer
    assert [a - b for a, b in zip(after_reasons, before_reasons)] == [1, 1, 1, 1]


def test_a_client_that_leaves_is_counted_as_cancelled(server):
    url = server[0]
    before = metric(url, "draftwise_requests_total", '{finish_reason="cancelled",arm=""}')
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())
    wait_until(lambda: metric(url, "draftwise_requests_total", '{finish_reason="cancelled",arm=""}') == before + 1)


def test_a_client_that_leaves_a_whole_reply_while_tokens_keep_coming_frees_its_slot():
    # Tokens every 20 ms, never a pause of the relay's poll: the disconnect must still be seen within about one.
    url, scheduler, metrics, stop = start()
    scheduler.fault_injector = lambda seq: time.sleep(0.02)
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                "speculation": "off"}  # a token a step: about 8 s to max_tokens
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
        left = time.monotonic()
        wait_until(lambda: metric(url, "draftwise_requests_total", '{finish_reason="cancelled",arm=""}') == 1)
        wait_until(lambda: scheduler.engine.target.open_slots == 1)  # (freed at the scheduler's next step)
        assert time.monotonic() - left < 4.0
    finally:
        stop()
        scheduler.drain(5)


def test_a_wrong_or_missing_api_key_is_refused_but_health_is_open():
    url, scheduler, _, stop = start(api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert client(url, "s3cret").models.list().data[0].id == MODEL
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
    finally:
        stop()
        scheduler.drain(5)


def test_more_waiting_than_allowed_gets_429_with_retry_after():
    url, scheduler, _, stop = start(max_waiting=0)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            complete(url, PROMPTS[0])
        assert int(caught.value.response.headers["retry-after"]) >= 1
    finally:
        stop()
        scheduler.drain(5)


def test_draining_finishes_running_requests_and_refuses_new_ones():
    url, scheduler, _, stop = start()
    try:
        result = {}
        running = threading.Thread(target=lambda: result.update(out=complete(url, PROMPTS[0], max_tokens=60)))
        running.start()
        wait_until(lambda: scheduler.running == 1)
        drain = threading.Thread(target=scheduler.drain, args=(20,))
        drain.start()
        wait_until(lambda: scheduler.draining)
        with pytest.raises(openai.APIStatusError) as caught:
            complete(url, PROMPTS[1])
        assert caught.value.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503
        running.join(30)
        drain.join(30)
        assert result["out"].choices[0].finish_reason == "length" and result["out"].usage.completion_tokens == 60
    finally:
        stop()


def test_a_drain_that_times_out_ends_running_requests_with_503():
    url, scheduler, _, stop = start()
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            scheduler.drain(0)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
    finally:
        stop()


def test_a_stream_carries_openai_chunks_and_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    lines = [l for l in httpx.post(f"{server[0]}/v1/completions", json=body, timeout=30).text.splitlines() if l]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l.removeprefix("data: ")) for l in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["draftwise"]["new_tokens"] == 5


def test_loadgen_drives_a_live_server_and_writes_its_table(tmp_path, server):
    from draftwise.cli import main

    url = server[0]
    code = main(["loadgen", "--url", url, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "6",
                 "--per-category", "1", "--categories", "qa,translation", "--speculation", "on,always,off",
                 "--out", str(tmp_path), "--json"])
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for c in (1, 2) for m in ("on", "always", "off")]
    # EOS may end one early
    assert all(r["failed"] == 0 and 0 < r["tokens"] <= 12 and r["tokens_per_s"] > 0 for r in rows)
    # "on" may measure that speculation does not pay on a busy machine and draft nothing; "always" drafts every round
    assert all(r["acceptance"] is not None for r in rows if r["mode"] == "always")
    assert all(r["acceptance"] is None for r in rows if r["mode"] == "off")
    assert (tmp_path / "loadgen.png").stat().st_size > 0 and "| on | 2 |" in (tmp_path / "report.md").read_text()


def test_draftwise_serve_drains_on_sigterm(tmp_path):
    """The real command in its own process: SIGTERM lets a running stream finish, refuses new requests with 503,
    then exits 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    for name, model in (("target", tiny_model("llama", 0)), ("draft", tiny_model("llama", 1, 1))):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # One thread, as in this process (conftest.py): on a GPU machine running the suite on 15 workers, a server with a
    # thread a core took over the default 30 s to write 200 tokens, and the drain ended the stream it waits for.
    # The drain ends as soon as the stream does, so a long --drain-timeout costs nothing when all is well.
    env = dict(os.environ, DRAFTWISE_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-m", "draftwise", "serve", "--target", str(tmp_path / "target"),
                               "--draft", str(tmp_path / "draft"), "--model-id", MODEL, "--port", str(port),
                               "--drain-timeout", "300"],
                              env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{url}/health"), seconds=60)
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True,
                "speculation": "off"}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{url}/health").status_code == 503)
            assert httpx.post(f"{url}/v1/completions", json={**body, "stream": False}).status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False
