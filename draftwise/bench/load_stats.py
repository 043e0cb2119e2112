"""The summary of a load run's records, pure: per cell and level, tokens/s over the repeats, percentiles of the
times, acceptance, and the throttle's verdict (on against the better of always and off)."""
from __future__ import annotations

from draftwise.bench.load_plan import OFF
from draftwise.bench.load_record import RequestRecord, draft_counts, time_per_token

# What the throttle promises: adaptive speculation at least this share of the better of always and off.
THROTTLE_FLOOR = 0.95


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the nearest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(records: list[RequestRecord]) -> list[dict]:
    """One row per cell and level (mode, method, concurrency), in the order they first ran. Only the requests that
    succeeded count towards tokens, times and acceptance. tokens_per_s is the median of the cell's runs (one per
    repeat; runs_tokens_per_s, by repeat, and its low and high); vs_c1_off compares with concurrency 1, speculation
    off (one user, the target alone) when that level ran; the on rows carry the throttle's verdict (judge_throttle)."""
    groups: dict[tuple, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault((r.mode, r.method, r.concurrency), []).append(r)
    rows = [_summary_row(mode, method, level, group) for (mode, method, level), group in groups.items()]
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == OFF and r["concurrency"] == 1), None)
    for row in rows:
        row["vs_c1_off"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] is not None else None
    judge_throttle(rows)
    return rows


def _summary_row(mode: str, method: str | None, level: int, group: list[RequestRecord]) -> dict:
    ok = [r for r in group if r.error is None]
    runs = _runs_tokens_per_s(group)
    rates = [rate for rate in runs if rate is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]  # pooled: a long request weighs by its number of tokens
    tpots = [t for t in map(time_per_token, ok) if t is not None]
    methods = sorted({r.stats["method"] for r in ok if r.stats and r.stats.get("method")})
    return {
        "mode": mode, "method": method, "concurrency": level, "requests": len(group), "failed": len(group) - len(ok),
        "tokens": sum(r.completion_tokens for r in ok), "wall_s": sum(_run_walls(group).values()) or None,
        "tokens_per_s": percentile(rates, 50), "tokens_per_s_low": min(rates, default=None),
        "tokens_per_s_high": max(rates, default=None), "runs_tokens_per_s": runs,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "tbt_p50_s": percentile(gaps, 50), "tbt_p95_s": percentile(gaps, 95),
        "tpot_p50_s": percentile(tpots, 50), "tpot_p95_s": percentile(tpots, 95),
        "acceptance": acceptance(ok), "mean_accepted_length": _mean(r.stats.get("mean_accepted_length")
                                                                    for r in ok if r.stats),
        "server_methods": methods,
    }


def _run_walls(group: list[RequestRecord]) -> dict[int, float]:
    """Each repeat's wall time: the sum of its slices' runs' (every request of a run carries its run's)."""
    runs: dict[tuple[int, int], float] = {}
    for r in group:
        if r.level_wall_s is not None:
            runs[r.repeat, r.part] = max(runs.get((r.repeat, r.part), 0.0), r.level_wall_s)
    walls: dict[int, float] = {}
    for (repeat, _), wall in runs.items():
        walls[repeat] = walls.get(repeat, 0.0) + wall
    return walls


def _runs_tokens_per_s(group: list[RequestRecord]) -> list[float | None]:
    """Aggregate tokens/s of each repeat's run, by repeat (None for a repeat that did not run)."""
    walls = _run_walls(group)
    rates: list[float | None] = [None] * (max(r.repeat for r in group) + 1)
    for repeat, wall in walls.items():
        tokens = sum(r.completion_tokens for r in group if r.repeat == repeat and r.error is None)
        rates[repeat] = tokens / wall if wall else None
    return rates


def judge_throttle(rows: list[dict]) -> None:
    """To each row of mode on, beside always or off at its level: on over the better of the two, repeat by repeat (a
    repeat's cells ran back to back, so each ratio compares like with like), its median and range (on_vs_best,
    _low, _high), and whether the median holds THROTTLE_FLOOR (throttle_holds); None where neither ran."""
    for on in (r for r in rows if r["mode"] == "on"):
        judged_against = rivals(rows, on)
        ratios = []
        for repeat, rate in enumerate(on["runs_tokens_per_s"]):
            best = max((_at(r, repeat) or 0.0 for r in judged_against), default=0.0)
            if rate is not None and best:
                ratios.append(rate / best)
        median = percentile(ratios, 50)
        on.update(on_vs_best=median, on_vs_best_low=min(ratios, default=None),
                  on_vs_best_high=max(ratios, default=None),
                  throttle_holds=None if median is None else median >= THROTTLE_FLOOR)


def rivals(rows: list[dict], on: dict) -> list[dict]:
    """The rows an on row is judged against, at its level: always with its method, and the off run beside them (any
    off, for records of a run that ran off once)."""
    level = [r for r in rows if r["concurrency"] == on["concurrency"]]
    offs = [r for r in level if r["mode"] == OFF]
    beside = [r for r in offs if r["method"] == on["method"]] or offs
    return [r for r in level if r["mode"] == "always" and r["method"] == on["method"]] + beside


def _at(row: dict, repeat: int) -> float | None:
    runs = row["runs_tokens_per_s"]
    return runs[repeat] if repeat < len(runs) else None


def acceptance(records: list[RequestRecord]) -> float | None:
    """Accepted over proposed draft tokens, pooled over the requests, when the server reports both counts;
    else the mean of the requests' own rates; None when no request reported any (speculation off)."""
    counted = [c for c in map(draft_counts, records) if c is not None]
    if counted:
        return sum(accepted for _, accepted in counted) / sum(proposed for proposed, _ in counted)
    return _mean(r.acceptance for r in records)


def _mean(values) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None
