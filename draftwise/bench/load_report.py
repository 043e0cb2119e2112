"""A load run's results as written: results.json, report.md (the tables) and loadgen.png (the plots)."""
from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from draftwise.bench.load_plan import OFF, LoadPlan
from draftwise.bench.load_server import DRAFTWISE, ServerKind
from draftwise.bench.load_stats import THROTTLE_FLOOR, rivals
from draftwise.files import write_whole


def write_results(out: Path, plan: LoadPlan, records: list, rows: list[dict], command: str = "",
                  server: ServerKind | None = None) -> None:
    """server: what was measured (None: a run that stopped before it was asked)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"url": plan.url, "server": server and server.name, "server_kind": server and server.kind,
            "endpoint": plan.path, "command": command,
            "max_tokens": plan.max_tokens, "temperature": plan.temperature,
            "top_p": plan.top_p if plan.sampled else None, "seed": plan.seed if plan.sampled else None,
            "methods": list(plan.methods), "repeats": plan.repeats, "slices": plan.slices, "prompts": len(plan.prompts),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    results = {"meta": meta, "summary": rows, "requests": [asdict(r) for r in records]}
    write_whole(out / "results.json", lambda p: p.write_text(json.dumps(results, indent=1) + "\n"))
    write_whole(out / "report.md", lambda p: p.write_text(report_markdown(meta, rows)))
    plot(rows, out / "loadgen.png")


def fmt(value, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def cell_name(row: dict) -> str:
    """'speculation on, hybrid': a row's mode and the method it asked for (the server's own when it named none)."""
    if row["mode"] == OFF:
        return "speculation off" + (f", beside {row['method']}" if row["method"] else "")
    return f"speculation {row['mode']}, {method_name(row)}"


def method_name(row: dict) -> str:
    """The method a row asked for: 'none' for off, the server's own (as it reported it) where it named none."""
    if row.get("mode") == OFF:
        return f"none (beside {row['method']})" if row.get("method") else "none"
    return row["method"] or "/".join(row.get("server_methods") or []) or "(server's)"


def _rate_cell(row: dict) -> str:
    """'20.1' for one run, '20.1 (19.5-20.8)' for several: the median and the range of the repeats."""
    ran = [v for v in row["runs_tokens_per_s"] if v is not None]
    text = fmt(row["tokens_per_s"], 1)
    return text if len(ran) < 2 else f"{text} ({row['tokens_per_s_low']:.1f}-{row['tokens_per_s_high']:.1f})"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | speculation | concurrency | requests (failed) | aggregate tok/s | vs c1 off "
             "| TTFT p50 / p95 s | TBT p50 / p95 ms | TPOT p50 / p95 ms | acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mode"] == OFF, method_name(r), r["concurrency"], r["mode"])):
        ratio = "-" if r["vs_c1_off"] is None else f"{r['vs_c1_off']:.2f}x"
        lines.append(f"| {method_name(r)} | {r['mode']} | {r['concurrency']} | {r['requests']} ({r['failed']}) "
                     f"| {_rate_cell(r)} | {ratio} | {fmt(r['ttft_p50_s'])} / {fmt(r['ttft_p95_s'])} "
                     f"| {fmt(r['tbt_p50_s'], 1, 1000)} / {fmt(r['tbt_p95_s'], 1, 1000)} "
                     f"| {fmt(r.get('tpot_p50_s'), 1, 1000)} / {fmt(r.get('tpot_p95_s'), 1, 1000)} "
                     f"| {fmt(r['acceptance'])} |")
    return "\n".join(lines)


def throttle_table(rows: list[dict]) -> str:
    """The throttle's verdicts, one line per method and level that has one; empty when none ran."""
    judged = [r for r in rows if r["mode"] == "on" and r.get("on_vs_best") is not None]
    if not judged:
        return ""
    lines = ["| method | concurrency | on tok/s | always tok/s | off tok/s | on / best of always, off (range) "
             f"| >= {THROTTLE_FLOOR} |", "|---|---|---|---|---|---|---|"]
    for on in sorted(judged, key=lambda r: (method_name(r), r["concurrency"])):
        rival = {r["mode"]: r["tokens_per_s"] for r in rivals(rows, on)}
        low, high = on["on_vs_best_low"], on["on_vs_best_high"]
        spread = "" if low == high else f" ({low:.2f}-{high:.2f})"
        lines.append(f"| {method_name(on)} | {on['concurrency']} | {fmt(on['tokens_per_s'], 1)} "
                     f"| {fmt(rival.get('always'), 1)} | {fmt(rival.get(OFF), 1)} | {on['on_vs_best']:.2f}x{spread} "
                     f"| {'yes' if on['throttle_holds'] else '**no**'} |")
    return "\n".join(lines)


def _in_slices(meta: dict) -> str:
    slices = meta.get("slices", 1)
    return f", each cell in {slices} slices, a method's modes taking turns slice by slice" if slices > 1 else ""


def sampling_words(meta: dict) -> str:
    """'temperature 0 (greedy)' or 'temperature 0.7, top_p 1, seed 0 + the request's index'."""
    temperature = meta.get("temperature") or 0
    if not temperature:
        return "temperature 0 (greedy)"
    return (f"temperature {temperature:g}, top_p {meta.get('top_p', 1):g}, seed {meta.get('seed')} + the request's "
            f"index (sampled: texts differ from run to run where the server does not honour seeds)")


def _speculation_words(meta: dict, methods: str) -> str:
    if meta.get("server_kind", DRAFTWISE) in (DRAFTWISE, None):
        return f"speculation on and always: {methods}; off: `{{\"method\": \"none\"}}`"
    return "speculation as the server was started (no `speculation` field sent: it is not draftwise)"


def report_markdown(meta: dict, rows: list[dict]) -> str:
    methods = ", ".join(m or "the server's default" for m in meta["methods"])
    verdicts = throttle_table(rows)
    server = f", {meta['server']}" if meta.get("server") else ""
    return (
        f"# Load test of {meta['url']}{server}\n\n"
        f"{meta['date']}, `{meta['command']}`\n\n"
        f"POST {meta['endpoint']}, streamed, {sampling_words(meta)}, max_tokens {meta['max_tokens']}, "
        f"{meta['prompts']} prompts, {meta['repeats']} repeat(s) interleaved{_in_slices(meta)}; "
        f"{_speculation_words(meta, methods)}.\n\n"
        f"{markdown_table(rows)}\n\n"
        "Aggregate tok/s: completion tokens of the requests that succeeded over the run's wall time (with slices, "
        "the sum of its slices'); with repeats, "
        "the median and (the range). vs c1 off: that over concurrency 1 with speculation off. TTFT: time to the "
        "first chunk with text. TBT: gaps between one request's consecutive chunks with text, pooled; a server "
        "may send a verified draft's tokens in one chunk or as chunks in one burst (llama-server does), which "
        "leaves TBT near 0 within a burst. TPOT: each request's time from its first chunk with text to its last, "
        "over its tokens after the first (tokens as the server's usage says), whatever the chunking. "
        "Acceptance: accepted over proposed draft tokens, as the server reports them.\n"
        + (f"\n## Throttle\n\n{verdicts}\n\nOn (adaptive) over the better of always and off, repeat by repeat: "
           f"the median and (the range); it should be at least {THROTTLE_FLOOR}.\n" if verdicts else "")
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in threads and on servers
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for cell in dict.fromkeys(cell_name(r) for r in rows):
        mine = sorted((r for r in rows if cell_name(r) == cell), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [r["tokens_per_s"] or 0 for r in mine], marker="o", label=cell)
        tbt = [(r["tbt_p50_s"] * 1000 if r["tbt_p50_s"] is not None else float("nan")) for r in mine]
        right.plot(xs, tbt, marker="o", label=cell)
    left.set(xlabel="concurrency", ylabel="aggregate tokens/s", title="Throughput")
    right.set(xlabel="concurrency", ylabel="p50 time between tokens (ms)", title="Time between tokens")
    levels = sorted({r["concurrency"] for r in rows})
    for ax in (left, right):
        ax.set_xticks(levels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
