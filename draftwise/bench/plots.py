"""Two PNG plots of a bench's summary per dtype: speedup by category, and acceptance by draft position.

Uses matplotlib's object API (`Figure` + `savefig`), which needs no backend and touches no global pyplot state.
"""
from __future__ import annotations

from pathlib import Path

from draftwise.bench.report import display_order, split_by_dtype
from draftwise.bench.summary import ALL, REFERENCE_OWN, REFERENCE_PEER, summarize

DPI = 120


def _subtitle(meta: dict) -> str:
    models = f"target {meta.get('target', '?')}"
    if meta.get("draft"):
        models += f", draft {meta['draft']}"
    return f"{meta.get('dtype', '?')} · {models}"


def _summary_and_order(results: dict) -> tuple[list[dict], list[str], list[str]]:
    meta = results.get("meta", {})
    summary = results.get("summary") or summarize(results.get("runs", []), results.get("roofline"))
    return summary, *display_order(meta, summary)


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # imported here: `draftwise bench --help` should not wait for matplotlib

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def speedup_reference(summary: list[dict]) -> tuple[str, str] | None:
    """(row field, y-axis baseline) of the speedup plot: vs hf-plain, else vs draftwise's none, else None."""
    present = {row["method"] for row in summary}
    if REFERENCE_PEER in present:
        return "speedup_vs_hf_plain", REFERENCE_PEER
    if REFERENCE_OWN in present:
        return "speedup_vs_none", f"draftwise {REFERENCE_OWN} (hf-plain not run)"
    return None


def plot_speedup_by_category(results: dict, path: Path) -> bool:
    """Grouped bars, speedup vs hf-plain (vs none when hf-plain is absent); False and no file when nothing to draw."""
    summary, methods, categories = _summary_and_order(results)
    reference = speedup_reference(summary)
    if reference is None:
        return False
    field, baseline = reference
    rows = {(row["method"], row["category"]): row for row in summary}
    values = {m: [(rows.get((m, c)) or {}).get(field) for c in categories] for m in methods}
    values = {m: v for m, v in values.items() if any(x is not None for x in v)}
    if not values:
        return False

    fig = _figure(min(16.0, max(7.0, 3 + 0.45 * len(categories) * len(values))), 4.8)
    ax = fig.add_subplot()
    width = 0.8 / len(values)
    for i, (method, speedups) in enumerate(values.items()):
        xs = [j + (i - (len(values) - 1) / 2) * width for j in range(len(categories))]
        heights = [0.0 if s is None else s for s in speedups]
        bars = ax.bar(xs, heights, width, label=method)
        ax.bar_label(bars, labels=["" if s is None else f"{s:.2f}" for s in speedups], fontsize=7, padding=2)
    ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(categories)), categories, rotation=30 if len(categories) > 6 else 0, ha="center")
    ax.set_ylabel(f"speedup vs {baseline}", fontsize=10)
    ax.set_ylim(0, max(1.1, max(h for v in values.values() for h in v if h is not None) * 1.15))
    ax.set_title(f"Speedup by category\n{_subtitle(results.get('meta', {}))}", fontsize=11)
    ax.legend(fontsize=9, ncols=min(len(values), 3), loc="best")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    return True


def plot_acceptance_by_position(results: dict, path: Path) -> bool:
    """One line per method that has per-position acceptance in its "all" row; False and no file when none has."""
    summary, methods, _ = _summary_and_order(results)
    rows = {(row["method"], row["category"]): row for row in summary}
    lines = {m: rows[(m, ALL)].get("per_position_acceptance") for m in methods if (m, ALL) in rows}
    lines = {m: v for m, v in lines.items() if v and any(x is not None for x in v)}
    if not lines:
        return False

    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()
    for method, rates in lines.items():
        points = [(i + 1, r) for i, r in enumerate(rates) if r is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    width = max(len(v) for v in lines.values())
    ax.set_xticks(range(1, width + 1))
    ax.set_xlim(0.5, width + 0.5)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position", fontsize=10)
    ax.set_ylabel("acceptance (kept / offered)", fontsize=10)
    ax.set_title(f"Acceptance by draft position, all categories\n{_subtitle(results.get('meta', {}))}", fontsize=11)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return True


PLOTS = {
    "speedup_by_category": plot_speedup_by_category,
    "acceptance_by_position": plot_acceptance_by_position,
}


def write_plots(results: dict, out_dir: Path) -> dict[str, dict[str, str]]:
    """Write, per dtype, the plots that have something to draw into out_dir; returns {dtype: {name: filename
    relative to out_dir}}. With several dtypes the file names end in the dtype: name_bfloat16.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = split_by_dtype(results)
    written = {}
    for dtype, part in parts.items():
        suffix = f"_{dtype}" if len(parts) > 1 else ""
        written[dtype] = {}
        for name, plot in PLOTS.items():
            filename = f"{name}{suffix}.png"
            if plot(part, out_dir / filename):
                written[dtype][name] = filename
    return written
