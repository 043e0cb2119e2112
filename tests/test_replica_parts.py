"""The parts of `serve --replicas` that need no Ray: an ASGI call run in process, the router's prefix memory,
and many replicas' metrics merged into one exposition."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from draftwise.serve.asgi_call import HTTPCall, ResponseStart, run_call
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.metrics_merge import merge_metrics
from draftwise.serve.prefix_routing import BLOCK_CHARS, PrefixIndex, routing_text


def _call(path: str, body: bytes = b"", method: str = "POST") -> HTTPCall:
    return HTTPCall(method, path, b"a=1", [(b"content-type", b"application/json")], body)


def _echo_app(left: list) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": (await request.body()).decode(), "query": request.url.query}

    @app.get("/stream")
    async def stream(request: Request):
        async def parts():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
                    if await request.is_disconnected():
                        left.append(i)
                        return
            finally:
                left.append("closed")
        return StreamingResponse(parts(), media_type="text/event-stream")

    return app


def test_an_asgi_call_gives_the_apps_status_headers_and_body():
    async def run():
        return [part async for part in run_call(_echo_app([]), _call("/echo", b'{"x": 1}'))]

    start, *body = asyncio.run(run())
    assert isinstance(start, ResponseStart) and start.status == 200
    assert (b"content-type", b"application/json") in start.headers
    assert json.loads(b"".join(body)) == {"body": '{"x": 1}', "query": "a=1"}


def test_an_asgi_call_closed_early_tells_the_app_its_client_left():
    """The relay stops reading (its client went away): the app sees a disconnect and stops, as under uvicorn."""
    left: list = []

    async def run():
        parts = run_call(_echo_app(left), _call("/stream", method="GET"))
        got = [await parts.__anext__() for _ in range(4)]
        await parts.aclose()
        return got

    began = time.monotonic()
    got = asyncio.run(run())
    assert got[0].status == 200 and got[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert left[-1] == "closed"  # the app's stream ended, long before its 1000 parts,
    assert time.monotonic() - began < 4  # on the disconnect, not on run_call's cancelling after 5 s


def test_the_routing_text_of_a_chat_extends_with_its_next_turn():
    first = {"messages": [{"role": "system", "content": "S" * 100}, {"role": "user", "content": "hi"}]}
    second = {"messages": first["messages"] + [{"role": "assistant", "content": "hello"},
                                               {"role": "user", "content": "more"}]}
    a = routing_text("/v1/chat/completions", json.dumps(first).encode())
    b = routing_text("/v1/chat/completions", json.dumps(second).encode())
    assert a and b.startswith(a) and len(b) > len(a)
    assert routing_text("/v1/completions", b'{"prompt": "def f():"}') == "def f():"
    assert routing_text("/v1/models", b"") == routing_text("/v1/completions", b"not json") == ""


def test_the_prefix_index_finds_the_replica_sent_the_longest_prefix():
    index = PrefixIndex()
    shared = "x" * (3 * BLOCK_CHARS)
    index.add("a", shared + "A" * BLOCK_CHARS)
    index.add("b", shared[:BLOCK_CHARS] + "B" * (2 * BLOCK_CHARS))
    assert index.longest(shared + "A" * BLOCK_CHARS + "more", ["a", "b"]) == ("a", 4 * BLOCK_CHARS)
    assert index.longest(shared[:BLOCK_CHARS] + "B" * BLOCK_CHARS, ["a", "b"]) == ("b", 2 * BLOCK_CHARS)
    assert index.longest(shared + "A" * BLOCK_CHARS, ["b"]) == ("b", BLOCK_CHARS)  # only the candidates count
    assert index.longest("y" * (4 * BLOCK_CHARS), ["a", "b"]) == (None, 0)
    assert index.longest("x" * (BLOCK_CHARS - 1), ["a", "b"]) == (None, 0)  # under one block: nothing to go by
    index.forget("a")
    assert index.longest(shared + "A" * BLOCK_CHARS, ["a", "b"]) == ("b", BLOCK_CHARS)


def test_the_prefix_index_forgets_the_least_recent_blocks_past_its_bound():
    index = PrefixIndex(max_blocks=4)
    index.add("a", "p" * (2 * BLOCK_CHARS))
    index.add("b", "q" * (3 * BLOCK_CHARS))  # 5 blocks: a's first goes
    assert len(index) == 4
    assert index.longest("p" * (2 * BLOCK_CHARS), ["a", "b"]) == (None, 0)  # (its chain starts at the lost block)
    assert index.longest("q" * (3 * BLOCK_CHARS), ["a", "b"]) == ("b", 3 * BLOCK_CHARS)


def test_merged_metrics_sum_counters_and_histograms_and_label_gauges_by_replica():
    one, two = ServeMetrics(), ServeMetrics()
    one.passes.inc(3)
    two.passes.inc(4)
    one.batch.observe(2)
    two.batch.observe(5)
    one.set_load(running=2, waiting=1)
    two.set_load(running=3, waiting=0)
    merged = merge_metrics({"r1": one.render()[0].decode(), "r2": two.render()[0].decode()}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(merged) for s in family.samples}
    assert samples[("draftwise_verification_passes_total", ())] == 7
    assert samples[("draftwise_batch_size_count", ())] == 2
    assert samples[("draftwise_batch_size_sum", ())] == 7
    assert samples[("draftwise_batch_size_bucket", (("le", "2.0"),))] == 1
    assert samples[("draftwise_running_requests", (("replica", "r1"),))] == 2
    assert samples[("draftwise_running_requests", (("replica", "r2"),))] == 3
    assert not any(name.endswith("_created") for name, _ in samples)


def test_a_single_process_server_never_imports_ray():
    code = ("import sys, draftwise.cli, draftwise.serve.command, draftwise.serve.app; "
            "draftwise.cli.build_parser().parse_args(['serve']); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_replicas_without_ray_say_how_to_install_it():
    code = ("import sys; sys.modules['ray'] = None\n"  # (as if not installed)
            "from draftwise.errors import DraftwiseError\n"
            "try:\n    import draftwise.serve.replicas\nexcept DraftwiseError as err:\n    print(err)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'draftwise[ray]'" in out.stdout, out.stderr
