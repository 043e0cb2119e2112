"""The dashboard: its history's arithmetic, its routes, and the page itself in a real browser (Debian's headless
Chromium against a live uvicorn on 127.0.0.1, tiny models). Without /usr/bin/chromium the browser test skips,
except where the environment variable CI is set (.ci/run installs Chromium): there it fails.

Every wait is bounded: requests are short, clients and the browser time out, polls have a deadline.
"""
from __future__ import annotations

import os
import subprocess
import time
from html.parser import HTMLParser

import httpx
import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.serve.app import create_app
from draftwise.serve.command import serve_in_thread
from draftwise.serve.dashboard import MetricsHistory
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.scheduler import Scheduler

CHROMIUM = "/usr/bin/chromium"
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHARTS = ["acceptance", "tokens", "ttft", "tbt", "batch", "events", "cache"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # long enough for the prompt cache to keep


def noisy_copy_of_the_target():
    """A draft close to the target but not equal to it: acceptance falls with the position, as a real draft's."""
    draft = tiny_model("llama", 0)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.abs().mean())
    return draft


def start(interval_s: float = 0.2, api_key: str | None = KEY):
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=noisy_copy_of_the_target(),
                                method="draft")
    engine.enable_prompt_cache(16 << 20)
    metrics = ServeMetrics()
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=8, metrics=metrics)
    scheduler.start()
    app = create_app(scheduler, "tiny", metrics, api_key)
    app.state.dashboard.interval_s = interval_s  # the page's charts fill in a second, not a minute
    url, stop = serve_in_thread(app)
    return url, app, scheduler, stop


@pytest.fixture(scope="module")
def server():
    url, app, scheduler, stop = start()
    yield url, app
    stop()
    scheduler.drain(5)


def complete(url: str, prompt: str, max_tokens: int = 16) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "speculation": {"method": "draft", "num_draft_tokens": 4, "adaptive": False}}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def data(url: str) -> dict:
    return httpx.get(f"{url}/dashboard/data", headers=AUTH, timeout=10).json()


def wait_for_samples_after(url: str, moment: float, seconds: float = 10.0) -> dict:
    """/dashboard/data once it has at least two points and one taken after `moment` (wall clock)."""
    deadline = time.monotonic() + seconds
    while True:
        got = data(url)
        t = got["series"]["t"]
        if len(t) >= 2 and t[-1] > moment:
            return got
        assert time.monotonic() < deadline, f"no history sample after the requests within {seconds} s: {t}"
        time.sleep(0.05)


# -- the history -----------------------------------------------------------------------------------------
def test_a_point_holds_rates_and_means_of_what_happened_between_two_readings():
    metrics = ServeMetrics()
    history = MetricsHistory(metrics.registry, interval_s=1.0)
    history.sample()
    assert not history.points  # one reading is no interval yet
    metrics.observe_emitted(30)
    metrics.ttft.labels("").observe(0.1)
    metrics.ttft.labels("").observe(0.3)
    metrics.observe_step(2, 0.0, 0.0, 0.0)
    metrics.observe_step(4, 0.0, 0.0, 0.0)
    metrics.observe_round("draft", 3, 2)
    metrics.observe_round("draft", 2, 0)
    metrics.observe_prompt_cache(0)
    metrics.observe_prompt_cache(12)
    history.sample()
    history.sample()  # nothing happened in this one
    series = history.series()
    assert series["tokens_per_s"][0] > 0 and series["tokens_per_s"][1] == 0
    assert series["ttft_s"] == [pytest.approx(0.2), None] and series["tbt_s"] == [None, None]
    assert series["batch_size"] == [3.0, None]
    assert series["prompt_cache_hit_rate"] == [0.5, 0.5] and series["fallbacks"] == [0, 0]
    assert [(a["position"], a["accepted"], a["proposed"]) for a in history.acceptance()] == [(0, 1, 2), (1, 1, 2),
                                                                                              (2, 0, 1)]


def test_the_history_keeps_only_its_last_points():
    history = MetricsHistory(ServeMetrics().registry, interval_s=1.0, maxlen=3)
    for _ in range(10):
        history.sample()
    assert len(history.series()["t"]) == 3


def test_the_sampler_runs_with_the_server_and_stops_with_it():
    url, app, scheduler, stop = start(interval_s=0.05, api_key=None)
    try:
        history = app.state.dashboard
        deadline = time.monotonic() + 10
        while len(history.points) < 3:
            assert time.monotonic() < deadline, "the sampler did not sample"
            time.sleep(0.02)
    finally:
        stop()
        scheduler.drain(5)
    after_stop = len(history.points)
    time.sleep(0.3)
    assert len(history.points) == after_stop


# -- the routes ------------------------------------------------------------------------------------------
def test_the_data_needs_the_key_and_the_page_and_uplot_do_not(server):
    url = server[0]
    assert httpx.get(f"{url}/dashboard/data").status_code == 401
    assert httpx.get(f"{url}/dashboard/data", headers=AUTH).json()["interval_s"] == 0.2
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert all(f'id="chart-{chart}"' in page.text for chart in CHARTS)
    script = httpx.get(f"{url}/dashboard/static/uPlot.iife.min.js")
    assert script.status_code == 200 and "uPlot" in script.text
    assert httpx.get(f"{url}/dashboard/static/../app.py").status_code == 404
    assert httpx.get(f"{url}/dashboard/static/dashboard.py").status_code == 404


# -- the page, in a browser ------------------------------------------------------------------------------
class Charts(HTMLParser):
    """From the browser's DOM: each chart's attributes, the acceptance table's positions, uPlot's plots, the status
    line."""

    def __init__(self):
        super().__init__()
        self.charts: dict[str, dict] = {}
        self.table_positions: list[str] = []
        self.plots = 0
        self.status: list[str] = []
        self._in_status = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if (attrs.get("id") or "").startswith("chart-"):
            self.charts[attrs["id"].removeprefix("chart-")] = attrs
        if "data-position" in attrs:
            self.table_positions.append(attrs["data-position"])
        if "uplot" in (attrs.get("class") or "").split():
            self.plots += 1
        if attrs.get("id") == "status":
            self._in_status = True

    def handle_endtag(self, tag):
        self._in_status = False

    def handle_data(self, data):
        if self._in_status:
            self.status.append(data)


def browse(chromium: str, url: str, profile, *extra: str) -> subprocess.CompletedProcess:
    """Headless Chromium, loopback only: no first-run, sync, update or background traffic."""
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-proxy-server", f"--user-data-dir={profile}", "--virtual-time-budget=8000", *extra, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture
def chromium():
    """Chromium's path; ahead of the server in a test's arguments, so a skip starts no server."""
    if not os.path.exists(CHROMIUM):
        message = f"{CHROMIUM} is missing (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it (.ci/run does)")
        pytest.skip(message)
    return CHROMIUM


def test_every_chart_holds_data_in_a_real_browser(chromium, server, tmp_path):
    url = server[0]
    complete(url, LONG_PROMPT)
    complete(url, LONG_PROMPT)  # the same prompt again: a prompt cache hit
    complete(url, "def quicksort(arr):\n", max_tokens=24)
    got = wait_for_samples_after(url, time.time())
    assert [a["position"] for a in got["acceptance"]] == [0, 1, 2, 3]

    # The key goes in the URL: the page sends it as the bearer header, as a browser cannot on a page load.
    run = browse(chromium, f"{url}/dashboard?key={KEY}", tmp_path / "profile", "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    dom = Charts()
    dom.feed(run.stdout)
    assert "samples" in "".join(dom.status), "".join(dom.status)  # not an error message
    assert sorted(dom.charts) == sorted(CHARTS) and dom.plots == len(CHARTS)
    points = {chart: int(attrs["data-points"]) for chart, attrs in dom.charts.items()}
    assert all(n > 0 for n in points.values()), points
    assert dom.charts["acceptance"]["data-positions"] == "0,1,2,3" and points["acceptance"] == 4
    assert dom.table_positions == ["0", "1", "2", "3"]
