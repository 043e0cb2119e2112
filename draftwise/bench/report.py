"""results.json -> report.md: the setup, the methods slower than `none`, how steady the machine was, then per
dtype each plain step beside the machine's bandwidth bound, four tables, a reading of the roofline, and the plots."""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

from draftwise.estimates import interpolate
from draftwise.types import common_prefix
from draftwise.bench.summary import ALL, REFERENCE_OWN, REFERENCE_PEER, ratio, summarize, trees_beside_chains

ROOFLINE_TOKENS = (1, 2, 4, 8, 16)
# Below this share of `none`'s tokens/s a method loses time rather than saves it; the 5% is room for noise.
PROMISE_FLOOR = 0.95
# Repeats of one prompt's plain step further apart than this mean the machine's speed moved during the run.
STEADY_SPREAD = 1.15
PLOT_TITLES = {
    "speedup_by_category": "Speedup by category",
    "acceptance_by_position": "Acceptance by draft position",
}


# -- formatting: None is "-" everywhere --------------------------------------------------------------------------

def fmt_num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def fmt_identical(identical: int | None, prompts: int) -> str:
    return "-" if identical is None else f"{identical}/{prompts}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align_left: int = 1) -> str:
    """A GitHub markdown table; the first `align_left` columns are left-aligned, the rest right-aligned."""
    rule = [":---" if i < align_left else "---:" for i in range(len(header))]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


# -- helpers -----------------------------------------------------------------------------------------------------

def _rows_by_key(summary: list[dict]) -> dict[tuple[str, str], dict]:
    return {(row["method"], row["category"]): row for row in summary}


def display_order(meta: dict, summary: list[dict]) -> tuple[list[str], list[str]]:
    """Methods and categories (with "all" last) in the meta's order, then any the summary adds."""
    methods = list(dict.fromkeys([*meta.get("methods", []), *(row["method"] for row in summary)]))
    categories = list(dict.fromkeys([*meta.get("categories", []), *(row["category"] for row in summary)]))
    categories = [c for c in categories if c != ALL] + [ALL]
    present = {row["method"] for row in summary}
    return [m for m in methods if m in present], categories


def split_by_dtype(results: dict) -> dict[str, dict]:
    """{dtype: that dtype's results alone (meta with its dtype, roofline, runs, summary)}, in the order they ran.

    Runs and rows without a dtype (results written before the bench took several) belong to the meta's dtype.
    """
    meta = results.get("meta", {})
    default = meta.get("dtype") or next(iter(meta.get("dtypes") or []), "?")
    runs, summary = results.get("runs", []), results.get("summary")
    dtype_of = lambda row: row.get("dtype", default)  # noqa: E731
    dtypes = list(dict.fromkeys([*map(dtype_of, runs), *map(dtype_of, summary or [])])) or [default]
    parts = {}
    for dtype in dtypes:
        roofline = _roofline_of(results.get("roofline"), dtype)
        own_runs = [run for run in runs if dtype_of(run) == dtype]
        parts[dtype] = {
            "meta": {**meta, "dtype": dtype},
            "roofline": roofline,
            "runs": own_runs,
            "summary": [row for row in summary if dtype_of(row) == dtype] if summary else summarize(own_runs, roofline),
            "engines": (results.get("engines") or {}).get(dtype),
            "bounds": ((results.get("bandwidth") or {}).get("bounds") or {}).get(dtype),
            "read": (results.get("bandwidth") or {}).get("read"),
        }
    return parts


def _roofline_of(roofline: dict | None, dtype: str) -> dict | None:
    """results["roofline"] is {dtype: roofline}; a single roofline (older results) is every dtype's."""
    if roofline and "target" in roofline:
        return roofline
    return (roofline or {}).get(dtype)


def below_none(summary: list[dict], floor: float = PROMISE_FLOOR) -> list[dict]:
    """The rows whose tokens/s is below floor x draftwise `none`'s in the same category."""
    return [row for row in summary if row["method"] != REFERENCE_OWN
            and row.get("speedup_vs_none") is not None and row["speedup_vs_none"] < floor]


def _roofline_ms(table: dict | None, n: int) -> float | None:
    if not table:
        return None
    return table.get(str(n), table.get(n))


def _interpolated_ms(table: dict | None, n: float) -> float | None:
    """The forward time of n new tokens, linearly interpolated between the measured sizes."""
    points = {size: _roofline_ms(table, size) for size in ROOFLINE_TOKENS}
    points = {size: ms for size, ms in points.items() if ms is not None}
    return interpolate(points, n) if points else None


# -- sections ----------------------------------------------------------------------------------------------------

def _when(meta: dict) -> str:
    """When the bench ran, and for how long (the loading, runs and roofline of this process only: a resumed
    bench's earlier runs took their own time)."""
    parts = []
    if meta.get("started"):
        parts.append(f"Started {meta['started']}")
    if meta.get("finished"):
        parts.append(f"finished {meta['finished']}" if parts else f"Finished {meta['finished']}")
    if meta.get("wall_seconds") is not None:
        minutes = meta["wall_seconds"] / 60
        parts.append(f"{minutes:.0f} min")
    return ", ".join(parts) + "." if parts else ""


def _pass_name(dtype: str, meta: dict) -> str:
    """A pass as the header names it: gguf is the quant backend; the pass 'auto' chose says so."""
    name = "gguf (the quant backend)" if dtype == "gguf" else dtype
    return name + (" (auto's choice)" if dtype == meta.get("auto_choice") else "")


def _auto_line(meta: dict) -> str | None:
    chosen = meta.get("auto_choice")
    if chosen is None:
        return None
    backend = ("the quant backend (the GGUF files' own blocks on draftwise's integer kernel)" if chosen == "gguf"
               else f"hf (transformers' weights) in {chosen}")
    return (f"Backend: {backend}, what `generate` and `serve` run by default here (`--backend auto`): "
            "`--dtype auto` benches what users run.")


def _sampling_line(meta: dict) -> str:
    temperature = meta.get("temperature") or 0
    if not temperature:
        return "Greedy: every method's text is compared with `none`'s (the identical column)."
    return (f"Sampled at temperature {temperature:g}, seed {meta.get('seed')}, every method alike (ours, "
            "transformers' and llama.cpp's, from the whole vocabulary): each of ours draws from the seed's shared "
            "noise, so its text is compared with `none`'s (the identical column); the peers' samplers draw "
            "otherwise, and theirs are not (identical reads -).")


def _header(meta: dict, dtypes: list[str]) -> str:
    models = f"target `{meta.get('target', '?')}`"
    if meta.get("draft"):
        models += f", draft `{meta['draft']}`"
    setup = (
        f"{meta.get('machine', 'unknown machine')} · {', '.join(_pass_name(d, meta) for d in dtypes)} · {models} · "
        f"max_new_tokens {meta.get('max_new_tokens', '?')} · k {meta.get('num_draft_tokens', '?')} · "
        f"repeats {meta.get('repeats', '?')}"
    )
    lines = ["# draftwise bench", "", setup, "", _sampling_line(meta)]
    auto = _auto_line(meta)
    if auto:
        lines += ["", auto]
    when = _when(meta)
    if when:
        lines += ["", when]
    if meta.get("command"):
        lines += ["", f"Command: `{meta['command']}`"]
    if meta.get("code"):
        lines += ["", f"Code: {meta['code']}."]
    resumed = {dtype: n for dtype, n in (meta.get("resumed_prompts") or {}).items() if n}
    if resumed:
        counts = ", ".join(f"{n} of {meta.get('prompts', '?')} in {dtype}" for dtype, n in resumed.items())
        lines += ["", f"Resumed (--resume): the runs of {counts} prompts come from an earlier, interrupted "
                      "process; every prompt's methods still ran together, in one process."]
    return "\n".join(lines)


def _promise_section(parts: dict[str, dict], floor: float = PROMISE_FLOOR) -> str:
    """Every (method, category) whose tokens/s is below floor x `none`'s, in the same dtype; or a plain all-clear."""
    title = f"## Methods slower than `{REFERENCE_OWN}`"
    if not any(row["method"] == REFERENCE_OWN for part in parts.values() for row in part["summary"]):
        return f"{title}\n\n`{REFERENCE_OWN}` was not run, so no method was compared with it."
    flagged = [(dtype, row) for dtype, part in parts.items() for row in below_none(part["summary"], floor)]
    if not flagged:
        return f"{title}\n\nNo method is below {floor:.2f}x of `{REFERENCE_OWN}`'s tokens/s in any category."
    several = len(parts) > 1
    header = ["dtype"] * several + ["method", "category", "tok/s", f"vs {REFERENCE_OWN}"]
    body = [[dtype] * several + [row["method"], row["category"], fmt_num(row["tokens_per_s"]),
                                 f"{row['speedup_vs_none']:.3f}x"] for dtype, row in flagged]
    intro = (f"Below {floor:.2f}x of `{REFERENCE_OWN}`'s tokens/s (the target alone through the same backend, "
             f"in the same dtype and category):")
    return f"{title}\n\n{intro}\n\n" + md_table(header, body, align_left=len(header) - 2)


def _steadiness_section(parts: dict[str, dict], limit: float = STEADY_SPREAD) -> str | None:
    """How steady the machine was: `none`'s seconds per target pass, compared between repeats of one prompt (the
    same shapes, so only the machine moved). A shared VM can run at two speeds for tens of seconds at a time (a
    step's time rising by a third and back within one prompt's runs), and a category of few prompts
    carries that noise into every ratio of its row."""
    spreads = []  # (max over min of a prompt's repeats, dtype, category, question id)
    for dtype, part in parts.items():
        per_pass: dict[tuple, list[float]] = {}
        for run in part["runs"]:
            if run["method"] == REFERENCE_OWN and run.get("verify_s") and run.get("target_forwards"):
                key = (run["category"], run["question_id"])
                per_pass.setdefault(key, []).append(run["verify_s"] / run["target_forwards"])
        spreads += [(max(s) / min(s), dtype, *key) for key, s in per_pass.items() if len(s) > 1 and min(s) > 0]
    if not spreads:
        return None
    spreads.sort()
    median = spreads[len(spreads) // 2][0]
    worst, dtype, category, qid = spreads[-1]
    where = f"{category} #{qid}" + (f" in {dtype}" if len(parts) > 1 else "")
    text = (f"`{REFERENCE_OWN}`'s seconds per target pass differed between repeats of the same prompt by "
            f"{100 * (median - 1):.0f}% at the median and {100 * (worst - 1):.0f}% at most ({where}), over "
            f"{len(spreads)} prompts.")
    if worst > limit:
        text += (" The machine's speed changed during the run (another process on the cores, a throttled CPU, a "
                 "busy host): a category of few prompts carries that much noise in every ratio of its row; more "
                 "prompts (`--per-category`) and repeats average it out.")
    return "## Machine steadiness\n\n" + text


def _table_bandwidth(bounds: dict | None, read: dict | None) -> str | None:
    """Each engine's plain step beside the bound that the machine's read rate puts on it: a step far above its
    bound (a bad build, a VM's slow memory, a busy machine) shows here, before any ratio between engines is read."""
    if not bounds or not read:
        return None
    body = []
    for method, b in bounds.items():
        size = b.get("bytes_per_token")
        body.append([method, b.get("of", "?"), "-" if size is None else fmt_num(size / 1e6),
                     fmt_num(b.get("bound_ms"), 2), fmt_num(b.get("step_ms"), 2), fmt_ratio(b.get("step_over_bound")),
                     fmt_num(b.get("pass_ms"), 2), fmt_ratio(b.get("pass_over_bound"))])
    readings = read.get("readings") or []
    when = (", the better of " + " and ".join(f"{r / 1e9:.1f}" for r in readings) + " GB/s, read before the runs and "
            "after them" if len(readings) > 1 else "")
    intro = (f"The machine reads memory at {read['bytes_per_s'] / 1e9:.1f} GB/s ({read.get('how', '')}){when}; a "
             "plain step reads every weight once, so it takes at least bytes / rate.")
    legend = ("MB a token: the tensor bytes a decoding step reads (every weight but the token embedding's other "
              "rows; the KV cache left out); bound: those bytes at the read rate; step: the method's plain decoding "
              "step over all categories (1 / tokens/s), with all its work; pass: the roofline's one-token forward "
              "alone (ours). Far above 1x: the engine leaves bandwidth unused (its kernels, a bad build), or the "
              "machine was busy; the read rate is a best of a few repeats and moves with the machine's load too.")
    header = ["method", "weights", "MB a token", "bound ms", "step ms", "step / bound", "pass ms", "pass / bound"]
    return ("## Plain step and bandwidth bound\n\n" + intro + "\n\n" + md_table(header, body, align_left=2) + "\n\n"
            + legend)


def _table_by_category(summary: list[dict], methods: list[str], categories: list[str]) -> str:
    rows = _rows_by_key(summary)
    has_peer = any(row["method"] == REFERENCE_PEER for row in summary)
    body = []
    for method in methods:
        cells = [method]
        for category in categories:
            row = rows.get((method, category))
            if row is None:
                cells.append("-")
                continue
            cell = fmt_num(row["tokens_per_s"])
            if has_peer:
                cell += f" ({fmt_ratio(row['speedup_vs_hf_plain'])})"
            cells.append(cell)
        body.append(cells)
    note = " (speedup vs hf-plain in parentheses)" if has_peer else ""
    return f"## Tokens/s by category{note}\n\n" + md_table(["method", *categories], body)


def _table_detail(summary: list[dict], methods: list[str], categories: list[str]) -> str:
    header = [
        "method", "category", "prompts", "tok/s", "vs hf-plain", "vs none", "acceptance", "mean accepted length",
        "k", "nodes", "c", "predicted", "measured/predicted", "identical",
    ]
    rows = _rows_by_key(summary)
    body = []
    for method in methods:
        for category in categories:
            row = rows.get((method, category))
            if row is None:
                continue
            body.append([
                method, category, str(row["prompts"]), fmt_num(row["tokens_per_s"]),
                fmt_ratio(row["speedup_vs_hf_plain"]), fmt_ratio(row["speedup_vs_none"]),
                fmt_pct(row["acceptance_rate"]), fmt_num(row["mean_accepted_length"], 2),
                fmt_num(row["mean_draft_length"], 2), fmt_num(row.get("tree_size"), 2), fmt_num(row["cost_ratio"], 3),
                fmt_ratio(row["predicted_speedup"]), fmt_ratio(row["measured_over_predicted"]),
                fmt_identical(row["identical"], row["prompts"]),
            ])
    legend = (
        "k: draft positions offered per round (a token tree's depth); nodes: draft tokens scored per round (a "
        "tree's every node; k for a chain); c: seconds per draft position over seconds per plain target step; "
        "predicted: Leviathan et al. (1 - a^(k+1)) / ((1 - a)(k c + 1)) from the measured acceptance a and c, its "
        "tokens and costs summed over the rounds by the k each offered (a plain step offers none; transformers' "
        "assisted generation, which does not count its offers by position, at its mean k); "
        "identical: prompts whose every repeat matched the reference greedy output."
    )
    return "## Per method and category\n\n" + md_table(header, body, align_left=2) + "\n\n" + legend


def _table_trees(runs: list[dict]) -> str | None:
    """Each tree method against its chain, prompt by prompt: is the tree slower, beyond what the prompts vary by?"""
    rows = trees_beside_chains(runs)
    if not rows:
        return None
    body = [[row["tree"], row["chain"], row["category"], str(row["prompts"]), f"{row['ratio']:.3f}x",
             _interval(row), f"{row['ahead']} of {row['prompts']}"] for row in rows]
    legend = ("ratio: the geometric mean over prompts of the chain's median seconds per token over the tree's "
              "(above 1: the tree is faster), each prompt's runs interleaved in this process; interval: 95%, a "
              "bootstrap over the prompts (none under three); \"below\" where all of it is under 1, a loss beyond "
              "what other prompts of the kind would move.")
    header = ["tree", "chain", "category", "prompts", "tree vs chain", "95% interval", "tree ahead on"]
    return "## Trees beside their chains\n\n" + md_table(header, body, align_left=3) + "\n\n" + legend


def _interval(row: dict) -> str:
    if row["low"] is None:
        return "-"
    return f"{row['low']:.2f}-{row['high']:.2f}" + (" below" if row["high"] < 1.0 else "")


def _table_positions(summary: list[dict], methods: list[str]) -> str | None:
    rows = _rows_by_key(summary)
    lists = [(m, rows[(m, ALL)]["per_position_acceptance"]) for m in methods if (m, ALL) in rows]
    lists = [(m, values) for m, values in lists if values]
    if not lists:
        return None
    width = max(len(values) for _, values in lists)
    body = [[m, *(fmt_pct(v) for v in values), *["-"] * (width - len(values))] for m, values in lists]
    header = ["method", *(f"pos {i}" for i in range(1, width + 1))]
    text = "Among rounds that offered an i-th draft token, the share that kept it (all categories)."
    return "## Acceptance by draft position\n\n" + text + "\n\n" + md_table(header, body)


def _table_roofline(roofline: dict | None, meta: dict) -> str | None:
    if not roofline or not roofline.get("target"):
        return None
    target, draft, loaded = roofline.get("target"), roofline.get("draft"), roofline.get("target_as_loaded")
    header = ["new tokens", "target ms", "target x of 1 token"]
    if loaded:
        header += ["target as loaded ms", "as loaded x of 1 token"]
    if draft:
        header += ["draft ms", "draft x of 1 token"]
    body = []
    for n in ROOFLINE_TOKENS:
        t = _roofline_ms(target, n)
        cells = [str(n), fmt_num(t, 2), fmt_ratio(ratio(t, _roofline_ms(target, 1)))]
        if loaded:
            lt = _roofline_ms(loaded, n)
            cells += [fmt_num(lt, 2), fmt_ratio(ratio(lt, _roofline_ms(loaded, 1)))]
        if draft:
            d = _roofline_ms(draft, n)
            cells += [fmt_num(d, 2), fmt_ratio(ratio(d, _roofline_ms(draft, 1)))]
        body.append(cells)
    intro = ("Median time of one forward of n new tokens after a 200-token prefill, over 7 rounds that each run every "
             "width once. The target and draft as our "
             "methods run them (kernels chosen at load, compact draft)" + ("; the target as loaded is what "
             "transformers' methods run." if loaded else "."))
    return "## Roofline\n\n" + intro + "\n\n" + md_table(header, body) + "\n\n" + _roofline_reading(target, draft, meta)


def _roofline_reading(target: dict, draft: dict | None, meta: dict) -> str:
    """One paragraph: what verification and drafting cost in plain target steps, and the break-even this implies."""
    step = _roofline_ms(target, 1)
    k = meta.get("num_draft_tokens")
    if step is None or not k:
        return "Too few measurements for a reading."
    verify = _interpolated_ms(target, k + 1)
    measured = k + 1 in ROOFLINE_TOKENS
    verify_x = verify / step
    if verify_x < 1.5:
        shape = "nearly as cheap as one step: the forward is memory-bound here, which is where speculation pays"
    elif verify_x > 0.6 * (k + 1):
        shape = "nearly k + 1 steps: the forward is compute-bound here, which leaves speculation little room"
    else:
        shape = "more than one step but well under k + 1 steps"
    parts = [
        f"One plain target step takes {step:.2f} ms; verifying k + 1 = {k + 1} tokens costs "
        f"{verify_x:.2f}x one plain step ({'' if measured else 'interpolated, '}{verify:.2f} ms), {shape}."
    ]
    round_ms = verify
    draft_step = _roofline_ms(draft, 1)
    if draft_step is not None:
        parts.append(
            f"One draft forward takes {draft_step:.2f} ms, {draft_step / step:.3f} of a target step "
            f"(the roofline's c; the model forward only, without the engine's bookkeeping)."
        )
        round_ms += k * draft_step
    parts.append(
        f"A round of {k} draft tokens and one verification therefore costs about {round_ms / step:.2f} plain steps, "
        f"so it pays off only when it emits more tokens than that on average (mean accepted length above "
        f"{round_ms / step:.2f})."
    )
    return " ".join(parts)


def agreement(runs: list[dict], method: str) -> float | None:
    """The share of method's tokens, over prompts (first repeats), that come before its first difference from the
    reference greedy output (`none`'s, else hf-plain's): where a peer on other weights or kernels parts from it."""
    reference = next((m for m in (REFERENCE_OWN, REFERENCE_PEER) if any(r["method"] == m for r in runs)), None)
    firsts = lambda m: {(r["category"], r["question_id"]): r.get("token_ids") for r in runs  # noqa: E731
                        if r["method"] == m and r["repeat"] == 0}
    expected, own = firsts(reference), firsts(method)
    pairs = [(ids, expected.get(key)) for key, ids in own.items()]
    pairs = [(ids, ref) for ids, ref in pairs if ids and ref is not None]
    if reference is None or not pairs:
        return None
    return sum(common_prefix(ids, ref) for ids, ref in pairs) / sum(len(ids) for ids, _ in pairs)


def _table_engines(engines: dict | None, runs: list[dict], methods: list[str], sampled: bool = False) -> str | None:
    """Which engine and kernels each method ran on, and how far its output follows the reference's (greedy only:
    sampled texts are not compared)."""
    if not engines:
        return None
    body = [[m, engines.get(m, "?").replace("|", "\\|"), "-" if sampled else fmt_pct(agreement(runs, m))]
            for m in methods]
    legend = ("same first tokens: the share of its tokens before its first difference from the reference greedy "
              f"output (`{REFERENCE_OWN}`'s), over the prompts' first repeats; a method on other weights (llama.cpp "
              "on the 4-bit file) or another dtype parts from it where two tokens' scores are near a tie.")
    return ("## Engines\n\n" + md_table(["method", "engine and kernels", "same first tokens"], body, align_left=2)
            + "\n\n" + legend)


def token_digest(ids: Sequence[int]) -> str:
    """A greedy output's token ids in 16 hex digits: two reports (two machines, two kernel paths) compare by it."""
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()[:16]


def _table_digests(runs: list[dict], methods: list[str], sampled: bool = False) -> str | None:
    """Per prompt, the digest of `none`'s tokens (first repeat) and which methods gave the same ones: the record
    another machine's report is checked against."""
    firsts = {(r["method"], r["question_id"]): r.get("token_ids") for r in runs if r["repeat"] == 0}
    prompts = list(dict.fromkeys(q for m, q in firsts if m == REFERENCE_OWN and firsts[(m, q)]))
    if sampled or not prompts:
        return None
    body = []
    for qid in prompts:
        want = firsts[(REFERENCE_OWN, qid)]
        others = [m for m in methods if m != REFERENCE_OWN and (m, qid) in firsts]
        same = [m for m in others if firsts[(m, qid)] == want]
        body.append([str(qid), str(len(want)), f"`{token_digest(want)}`", f"{len(same)} of {len(others)}",
                     ", ".join(m for m in others if m not in same) or "-"])
    legend = (f"digest: the first 16 hex digits of the SHA-256 of `{REFERENCE_OWN}`'s token ids, comma-joined "
              "(draftwise.bench.report.token_digest): the same digest in another machine's report means the same "
              "tokens. same: the methods whose tokens are these.")
    return ("## Token digests\n\n" + md_table(["prompt", "tokens", "digest", "same", "other tokens"], body)
            + "\n\n" + legend)


def _plots_section(plots: dict[str, str] | None, out_dir: Path) -> str | None:
    if not plots:
        return None
    lines = ["## Plots"]
    for name, filename in plots.items():
        link = Path(os.path.relpath(filename, out_dir)).as_posix() if os.path.isabs(filename) else filename
        lines += ["", f"![{PLOT_TITLES.get(name, name)}]({link})"]
    return "\n".join(lines)


def _dtype_sections(part: dict, plots: dict[str, str] | None, out_dir: Path) -> list[str | None]:
    """The tables, roofline and plots of one dtype's results."""
    meta, summary = part["meta"], part["summary"]
    methods, categories = display_order(meta, summary)
    return [
        _table_bandwidth(part.get("bounds"), part.get("read")),
        _table_by_category(summary, methods, categories),
        _table_detail(summary, methods, categories),
        _table_trees(part["runs"]),
        _table_positions(summary, methods),
        _table_roofline(part["roofline"], meta),
        _table_engines(part.get("engines"), part["runs"], methods, bool(meta.get("temperature"))),
        _table_digests(part["runs"], methods, bool(meta.get("temperature"))),
        _plots_section(plots, out_dir),
    ]


def _under_heading(title: str, sections: list[str | None]) -> list[str]:
    # Each section's own headings move one level down, below the title's.
    return [f"## {title}", *(re.sub(r"^#", "##", s, flags=re.MULTILINE) for s in sections if s)]


def write_report(results: dict, out_dir: Path, plots: dict[str, dict[str, str]] | None) -> Path:
    """Write out_dir/report.md from results.json's dict (summaries computed when absent); returns its path.

    plots: {dtype: {plot name: filename}} as write_plots returns it. With several dtypes each has a heading.
    """
    out_dir = Path(out_dir)
    parts = split_by_dtype(results)
    sections = [_header(results.get("meta", {}), list(parts)), _promise_section(parts), _steadiness_section(parts)]
    for dtype, part in parts.items():
        own = _dtype_sections(part, (plots or {}).get(dtype), out_dir)
        sections += _under_heading(dtype, own) if len(parts) > 1 else own
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.md"
    path.write_text("\n\n".join(s for s in sections if s) + "\n", encoding="utf-8")
    return path
