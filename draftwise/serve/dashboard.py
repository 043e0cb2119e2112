"""The numbers behind GET /dashboard: live charts of the server's own metrics, drawn in the browser with no outside
service (the routes: routes/dashboard.py).

A sampler reads the metrics registry every few seconds into a bounded history; rates and means come from the
difference between two readings (as Prometheus's rate() would compute them). The page (static/dashboard.html)
polls /dashboard/data and draws it with uPlot, vendored in static/ so that it works offline.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

DEFAULT_INTERVAL_S = 2.0
HISTORY_POINTS = 300  # ten minutes at the default interval
SERIES = ("t", "tokens_per_s", "ttft_s", "tbt_s", "batch_size", "fallbacks", "guard_blocks", "prompt_cache_hit_rate")
STATIC = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain"}

Values = dict[str, dict[tuple, float]]  # sample name -> its labels (sorted pairs) -> value


@dataclass
class Reading:
    """Every sample of the registry at one moment."""
    wall: float  # time.time(): the charts' x axis
    mono: float  # time.monotonic(): the length of an interval
    values: Values

    def total(self, name: str) -> float:
        """A sample summed over its labels (a labelled counter's total; 0 before anything was counted)."""
        return sum(self.values.get(name, {}).values())

    def by_position(self, name: str) -> dict[int, float]:
        """A per-position counter, summed over any other labels it has."""
        out: dict[int, float] = {}
        for labels, value in self.values.get(name, {}).items():
            position = int(dict(labels)["position"])
            out[position] = out.get(position, 0.0) + value
        return out


def read(registry: CollectorRegistry) -> Reading:
    values: Values = {}
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):  # creation timestamps, not measurements
                values.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return Reading(time.time(), time.monotonic(), values)


def point(prev: Reading, cur: Reading) -> dict:
    """One point of every chart: what happened between two readings. None where nothing was measured (no
    request started, no step ran), so the chart shows a gap rather than a made-up zero."""
    seconds = cur.mono - prev.mono

    def moved(name: str) -> float:
        return cur.total(name) - prev.total(name)

    def mean(histogram: str) -> float | None:
        count = moved(f"{histogram}_count")
        return moved(f"{histogram}_sum") / count if count else None

    lookups = cur.total("draftwise_prompt_cache_lookups_total")
    return {
        "t": cur.wall,
        "tokens_per_s": moved("draftwise_emitted_tokens_total") / seconds if seconds > 0 else None,
        "ttft_s": mean("draftwise_time_to_first_token_seconds"),
        "tbt_s": mean("draftwise_time_between_tokens_seconds"),
        "batch_size": mean("draftwise_batch_size"),
        "fallbacks": cur.total("draftwise_proposer_fallbacks_total"),
        "guard_blocks": cur.total("draftwise_guard_blocks_total"),
        "prompt_cache_hit_rate": cur.total("draftwise_prompt_cache_hits_total") / lookups if lookups else None,
    }


class MetricsHistory:
    """The last `maxlen` intervals of the server's metrics, one point per interval_s seconds."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = DEFAULT_INTERVAL_S,
                 maxlen: int = HISTORY_POINTS):
        """registry: a server's (ServeMetrics.registry), or the merged metrics of many replicas (replicas.py)."""
        if interval_s <= 0:
            raise ValueError(f"the dashboard's sampling interval must be > 0 seconds, got {interval_s}")
        self.registry = registry
        self.interval_s = interval_s
        self.points: deque[dict] = deque(maxlen=maxlen)
        self._last: Reading | None = None

    def sample(self) -> None:
        reading = read(self.registry)
        if self._last is not None:
            self.points.append(point(self._last, reading))
        self._last = reading

    def series(self) -> dict[str, list]:
        """Column per series, the shape uPlot draws."""
        return {name: [p[name] for p in self.points] for name in SERIES}

    def acceptance(self) -> list[dict]:
        """Acceptance by draft position since the server started, read now."""
        now = read(self.registry)
        proposed = now.by_position("draftwise_proposed_tokens_by_position_total")
        accepted = now.by_position("draftwise_accepted_tokens_by_position_total")
        return [{"position": i, "proposed": n, "accepted": accepted.get(i, 0.0), "rate": accepted.get(i, 0.0) / n}
                for i, n in sorted(proposed.items()) if n]

    @contextlib.asynccontextmanager
    async def sampling(self):
        """Samples in a task of the server's event loop while the block runs (the app's lifespan), so it ends
        when the server stops; no thread outlives a server started and stopped in-process."""
        task = asyncio.create_task(self._sample_forever(), name="draftwise-dashboard")
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # a sampler bug must not fail the shutdown

    async def _sample_forever(self) -> None:
        while True:
            self.sample()  # a registry read: well under a millisecond, fine on the event loop
            await asyncio.sleep(self.interval_s)


def dashboard_data(history: MetricsHistory, drafts=None) -> dict:
    """The body of /dashboard/data."""
    return {"interval_s": history.interval_s, "series": history.series(), "acceptance": history.acceptance(),
            "drafts": None if drafts is None else drafts()}
