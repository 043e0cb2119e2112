"""One thread owns the engine: every call into the engine's and its target backend's methods, made while a server
serves requests and puts a draft on trial, comes from the model loop's thread (DESIGN.md, "Invariants that bite")."""
from __future__ import annotations

import functools
import inspect
import random
import threading
import time

import httpx
import pytest

from conftest import near_model, tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.errors import DraftwiseError

KEY = "admin-key"
LOOP = "draftwise-scheduler"  # the name of the thread Scheduler.start() runs the model loop on
PROMPTS = ["The quick brown fox", "def quicksort(arr):\n", "Summaries copy spans of", "for i in range(10):"]


def record_threads(obj, label: str, calls: list) -> None:
    """Make each method of obj (the instance's own, shadowing its class's) record (label.name, thread name)."""
    for name in dir(type(obj)):
        static = inspect.getattr_static(obj, name)
        if name.startswith("__") or isinstance(static, (staticmethod, classmethod, property)) or not callable(static):
            continue
        setattr(obj, name, _recorded(getattr(obj, name), f"{label}.{name}", calls))


def _recorded(method, name: str, calls: list):
    @functools.wraps(method)
    def call(*args, **kwargs):
        calls.append((name, threading.current_thread().name))
        return method(*args, **kwargs)
    return call


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def recorded_server():
    from draftwise.serve.app import create_app
    from draftwise.serve.command import serve_in_thread
    from draftwise.serve.metrics import ServeMetrics
    from draftwise.serve.rollout import Rollouts
    from draftwise.serve.scheduler import Scheduler

    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=near_model("llama"), method="draft")
    calls: list[tuple[str, str]] = []
    record_threads(eng, "engine", calls)
    record_threads(eng.target, "target", calls)
    eng.draft_maker = _recorded(eng.draft_maker, "engine.draft_maker", calls)  # (builds a draft's backend)

    def check(name):
        if name != "tiny@v1":
            raise DraftwiseError(f"no draft version {name}")

    # A damaged draft (random weights), judged after a few requests of each arm: rolled back, or (by chance of the
    # timings) promoted; either way the decision changes the engine's drafts.
    rollouts = Rollouts(eng, load=lambda name: tiny_model("llama", 5), check=check, rng=random.Random(0),
                        min_requests=2, max_requests=3)
    metrics = ServeMetrics()
    scheduler = Scheduler(eng, max_batch=4, prefill_chunk=8, metrics=metrics)
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, "tiny", metrics, KEY, {"adaptive": False}, rollouts=rollouts))
    try:
        yield url, rollouts, calls
    finally:
        stop()
        scheduler.drain(5)


def test_every_engine_and_backend_call_of_a_serving_server_and_a_rollout_is_on_the_model_loop(recorded_server):
    url, rollouts, calls = recorded_server
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert http.post("/admin/drafts", json={"draft": "tiny@v1"}).status_code == 202
    wait_for(lambda: rollouts.trials[-1].state != "loading")
    assert rollouts.trials[-1].state == "testing", rollouts.trials[-1].reason

    # Refusals that come from the engine's own checks, run on the loop, answer as they did from the HTTP side.
    too_long = http.post("/v1/completions", json={"model": "tiny", "prompt": "word " * 600})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert too_long.json()["error"]["param"] == "prompt"
    no_draft = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                                                   "speculation": {"method": "lookup", "draft": "tiny@v1"}})
    assert no_draft.status_code == 400 and "method 'lookup' drafts with no draft model" in no_draft.json()["error"][
        "message"]

    stream = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, "stream": True,
                                                      "messages": [{"role": "user", "content": PROMPTS[1]}]})
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    sent = 0
    while rollouts.trials[-1].state == "testing" and sent < 80:
        out = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[sent % len(PROMPTS)],
                                                  "max_tokens": 16, "temperature": 0})
        assert out.status_code == 200
        sent += 1
    assert rollouts.trials[-1].state in ("promoted", "rolled back"), rollouts.trials[-1].summary()

    names = {name for name, _ in calls}
    # The control that the recording saw what matters: each kind of call the server makes of the engine.
    assert {"engine.check_limits", "engine.check_open", "engine.open_sequence", "engine.prefill", "engine.step",
            "engine.close_sequence", "engine.add_draft", "engine.draft_maker", "target.forward_batch"} <= names
    assert names & {"engine.promote_draft", "engine.remove_draft"}
    off_loop = sorted({(name, thread) for name, thread in calls if thread != LOOP})
    assert not off_loop, f"engine or backend methods called off the model loop: {off_loop}"
