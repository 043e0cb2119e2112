"""Raw bench runs -> one flat, JSON-serializable summary row per (method, category), plus one "all" row per method.

Pure and model-free. Every quantity is a small named function so that the report and the tests name the same thing.
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence

from draftwise.methods import BASELINE, tree_chains
from draftwise.metrics import leviathan_over_rounds, leviathan_speedup

ALL = "all"
REFERENCE_PEER = "hf-plain"
REFERENCE_OWN = BASELINE
TREE_CHAINS = tree_chains()  # a tree method -> its chain (methods.py)
BOOTSTRAP_DRAWS = 2000
INTERVAL_PROMPTS = 3  # fewer prompts give no interval: resampling one or two says nothing of the others


def _ordered_unique(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is zero."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def _fields_sum(runs: Sequence[dict], key: str) -> float | None:
    """Sum of a field over runs, or None when any run lacks it (a partial sum would mislead)."""
    values = [run.get(key) for run in runs]
    if not values or any(v is None for v in values):
        return None
    return sum(values)


def prompt_key(run: dict) -> tuple:
    """A prompt is identified by its category and question id (ids may repeat across categories)."""
    return (run["category"], run["question_id"])


def group_by_prompt(runs: Iterable[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(prompt_key(run), []).append(run)
    return groups


def throughput(runs: Sequence[dict]) -> float | None:
    """Tokens/s over the prompts: sum of new tokens / sum of each prompt's MEDIAN decode time over its repeats."""
    tokens = seconds = 0.0
    for repeats in group_by_prompt(runs).values():
        tokens += statistics.median(r["new_tokens"] for r in repeats)
        seconds += statistics.median(r["decode_s"] for r in repeats)
    return ratio(tokens, seconds)


def acceptance_rate(runs: Sequence[dict]) -> float | None:
    """Accepted / proposed draft tokens over all runs; None without proposals."""
    return ratio(_fields_sum(runs, "accepted"), _fields_sum(runs, "proposed"))


def mean_accepted_length(runs: Sequence[dict]) -> float | None:
    """Tokens emitted per target pass (the target's own token included): 1.0 for plain decoding."""
    return ratio(_fields_sum(runs, "new_tokens"), _fields_sum(runs, "target_forwards"))


def mean_draft_length(runs: Sequence[dict]) -> float | None:
    """k: draft tokens offered per verification round."""
    return ratio(_fields_sum(runs, "proposed"), _fields_sum(runs, "rounds"))


def offered_and_kept(runs: Sequence[dict]) -> tuple[list[int], list[int]] | None:
    """([i], [i]): the rounds over all runs that offered, and that kept, an (i+1)-th draft token (runs' lists may
    differ in length); None when no run counted them."""
    pairs = [(r.get("proposed_at"), r.get("accepted_at")) for r in runs]
    pairs = [(p, a) for p, a in pairs if p is not None and a is not None]
    if not pairs:
        return None
    length = max(len(p) for p, _ in pairs)
    offered = [0] * length
    kept = [0] * length
    for proposed_at, accepted_at in pairs:
        for i, n in enumerate(proposed_at):
            offered[i] += n
        for i, n in enumerate(accepted_at):
            kept[i] += n
    return offered, kept


def per_position_acceptance(runs: Sequence[dict]) -> list[float | None] | None:
    """[i]: kept / offered i-th draft tokens over runs; None without lists, or with nothing offered."""
    counts = offered_and_kept(runs)
    if counts is None or not counts[0]:
        return None
    offered, kept = counts
    return [ratio(kept[i], offered[i]) for i in range(len(offered))]


def tree_size(runs: Sequence[dict]) -> float | None:
    """Draft tokens scored per verification round: a chain's length, every node of a token tree."""
    return ratio(_fields_sum(runs, "nodes"), _fields_sum(runs, "rounds"))


def seconds_per_draft_token(runs: Sequence[dict]) -> float | None:
    return ratio(_fields_sum(runs, "draft_s"), _fields_sum(runs, "proposed"))


def seconds_per_target_step(none_runs: Sequence[dict], roofline: dict | None) -> float | None:
    """One plain target step: the "none" runs' decode seconds per token, else the roofline's 1-token forward."""
    measured = ratio(_fields_sum(none_runs, "decode_s"), _fields_sum(none_runs, "new_tokens")) if none_runs else None
    if measured is not None:
        return measured
    target = (roofline or {}).get("target") or {}
    one_ms = target.get("1", target.get(1))
    return None if one_ms is None else one_ms / 1000


def cost_ratio(runs: Sequence[dict], none_runs: Sequence[dict], roofline: dict | None) -> float | None:
    """Leviathan's c: seconds per draft token over seconds per plain target step."""
    return ratio(seconds_per_draft_token(runs), seconds_per_target_step(none_runs, roofline))


def predicted_speedup(runs: Sequence[dict], a: float | None, k: float | None, c: float | None) -> float | None:
    """Leviathan et al.'s prediction over the runs' rounds as drafted (metrics.leviathan_over_rounds); for runs
    that did not count their offers by position (transformers' assisted generation), every round at the mean k."""
    offered = offered_and_kept(runs)
    if offered is None:
        return leviathan_speedup(a, k, c)
    return leviathan_over_rounds(a, c, _fields_sum(runs, "rounds"), offered[0])


def identical_prompts(runs: Sequence[dict]) -> int | None:
    """Prompts whose every repeat reproduced the reference output; None when no run was compared."""
    if all(r.get("identical") is None for r in runs):
        return None
    return sum(all(r.get("identical") is True for r in repeats) for repeats in group_by_prompt(runs).values())


def _row(method: str, category: str, runs: list[dict], none_runs: list[dict], roofline: dict | None) -> dict:
    a = acceptance_rate(runs)
    k = mean_draft_length(runs)
    c = cost_ratio(runs, none_runs, roofline)
    return {
        "method": method,
        "category": category,
        "prompts": len(group_by_prompt(runs)),
        "tokens_per_s": throughput(runs),
        "speedup_vs_hf_plain": None,  # filled in once every row's throughput is known
        "speedup_vs_none": None,
        "acceptance_rate": a,
        "mean_accepted_length": mean_accepted_length(runs),
        "per_position_acceptance": per_position_acceptance(runs),
        "mean_draft_length": k,
        "tree_size": tree_size(runs),
        "cost_ratio": c,
        "predicted_speedup": predicted_speedup(runs, a, k, c),
        "measured_over_predicted": None,
        "identical": identical_prompts(runs),
    }


def timed_prompts(runs: list[dict]) -> list[dict]:
    """The runs of the prompts whose every repeat timed some decoding: a peer that emitted every token in its prefill
    step (a short max_new_tokens) has none, and its prompt is left out of every figure of its method's rows."""
    untimed = {prompt_key(r) for r in runs if r["decode_s"] is None}
    return [r for r in runs if prompt_key(r) not in untimed]


def summarize(runs: list[dict], roofline: dict | None = None) -> list[dict]:
    """One row per (method, category) in order methods x categories (first appearance), then "all" per method."""
    methods = _ordered_unique(r["method"] for r in runs)
    categories = _ordered_unique(r["category"] for r in runs)
    none_by_prompt = group_by_prompt(r for r in runs if r["method"] == REFERENCE_OWN)

    rows = []
    for method in methods:
        own = timed_prompts([r for r in runs if r["method"] == method])
        groups = [(c, [r for r in own if r["category"] == c]) for c in categories] + [(ALL, own)]
        for category, selected in groups:
            if not selected:
                continue
            none_runs = [n for key in group_by_prompt(selected) for n in none_by_prompt.get(key, [])]
            rows.append(_row(method, category, selected, none_runs, roofline))

    tps = {(row["method"], row["category"]): row["tokens_per_s"] for row in rows}
    for row in rows:
        row["speedup_vs_hf_plain"] = ratio(row["tokens_per_s"], tps.get((REFERENCE_PEER, row["category"])))
        row["speedup_vs_none"] = ratio(row["tokens_per_s"], tps.get((REFERENCE_OWN, row["category"])))
        row["measured_over_predicted"] = ratio(row["speedup_vs_none"], row["predicted_speedup"])
    return rows


def seconds_per_token(repeats: Sequence[dict]) -> float | None:
    """One prompt's median decode seconds per new token over its repeats; None unless every repeat emitted tokens
    in measured time (a one-token run of a peer has no decode time apart from its prefill)."""
    if any(not r.get("new_tokens") or not r.get("decode_s") for r in repeats):
        return None
    return statistics.median(r["decode_s"] / r["new_tokens"] for r in repeats)


def paired_ratios(runs: Sequence[dict], method: str, baseline: str) -> list[float]:
    """Per prompt that both methods ran: the baseline's median seconds per token over the method's (above 1: the
    method is faster). Both ran the prompt interleaved in one process, so the machine's slow spells fall on both."""
    own, base = (_seconds_by_prompt(runs, m) for m in (method, baseline))
    return [base[key] / seconds for key, seconds in own.items() if seconds is not None and base.get(key) is not None]


def _seconds_by_prompt(runs: Sequence[dict], method: str) -> dict[tuple, float | None]:
    return {key: seconds_per_token(repeats)
            for key, repeats in group_by_prompt(r for r in runs if r["method"] == method).items()}


def paired_speedup(ratios: Sequence[float], draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> dict:
    """The geometric mean of per-prompt ratios, its 95% interval by a percentile bootstrap over the prompts (how far
    it moves when other prompts of the same kind are drawn: with three a category it is wide, and says so; each
    prompt's own repeats are in its median, not in the interval), and on how many prompts the method was ahead.
    Under INTERVAL_PROMPTS prompts, no interval (low and high None)."""
    logs = [math.log(r) for r in ratios]
    low = high = None
    if len(logs) >= INTERVAL_PROMPTS:
        rng = random.Random(seed)  # a report says the same thing each time it is written
        means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
        low, high = math.exp(means[int(0.025 * draws)]), math.exp(means[int(0.975 * draws) - 1])
    return {"prompts": len(ratios), "ratio": math.exp(statistics.fmean(logs)), "low": low, "high": high,
            "ahead": sum(r > 1.0 for r in ratios)}


def trees_beside_chains(runs: Sequence[dict]) -> list[dict]:
    """Each tree method run beside its chain: per category, then over all, the paired speedup (paired_speedup)."""
    methods = set(r["method"] for r in runs)
    categories = _ordered_unique(r["category"] for r in runs)
    rows = []
    for tree, chain in TREE_CHAINS.items():
        if tree not in methods or chain not in methods:
            continue
        for category in [*categories, ALL]:
            picked = [r for r in runs if category == ALL or r["category"] == category]
            ratios = paired_ratios(picked, tree, chain)
            if ratios:
                rows.append({"tree": tree, "chain": chain, "category": category, **paired_speedup(ratios)})
    return rows
