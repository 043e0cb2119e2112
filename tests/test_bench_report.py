"""The model-free half of `draftwise bench`: raw runs -> summary rows -> report.md and PNG plots.

The runs below are made by hand so that every summary number can be worked out on paper (see the comments).
"""
from __future__ import annotations

import copy

import pytest

from draftwise.bench.plots import speedup_reference, write_plots
from draftwise.bench.report import below_none, md_table, split_by_dtype, write_report
from draftwise.bench.summary import (paired_ratios, paired_speedup, per_position_acceptance, predicted_speedup,
                                     summarize, throughput, trees_beside_chains)
from draftwise.metrics import Stats, leviathan_over_rounds, leviathan_speedup

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROOFLINE = {
    "target": {"1": 100.0, "2": 104.0, "4": 110.0, "8": 150.0, "16": 300.0},
    "draft": {"1": 10.0, "2": 10.5, "4": 11.0, "8": 14.0, "16": 25.0},
}


def run(method, category, qid, repeat, decode_s, **fields):
    base = {
        "method": method, "category": category, "question_id": qid, "repeat": repeat, "new_tokens": 10,
        "decode_s": decode_s, "tokens_per_s": 10 / decode_s, "target_forwards": 10, "proposed": None,
        "accepted": None, "nodes": None, "rounds": None, "proposed_at": None, "accepted_at": None, "draft_s": None,
        "verify_s": None, "identical": None,
    }
    base.update(fields)
    return base


def coding_draft(qid, repeat, decode_s, identical=True):
    # 4 rounds of k=4: 6 of 16 kept (3, 2, 1, 0 at positions 1..4), 6 + 4 target tokens = 10; 0.6 s drafting
    return run("draft", "coding", qid, repeat, decode_s, target_forwards=4, proposed=16, accepted=6, nodes=16, rounds=4,
               proposed_at=[4, 4, 4, 4], accepted_at=[3, 2, 1, 0], draft_s=0.6, verify_s=0.2, identical=identical)


def summary_draft(repeat):
    # 2 rounds of k=4, everything kept: 8 + 2 = 10 tokens; 0.2 s drafting
    return run("draft", "summary", 3, repeat, 0.5, target_forwards=2, proposed=8, accepted=8, nodes=8, rounds=2,
               proposed_at=[2, 2, 2, 2], accepted_at=[2, 2, 2, 2], draft_s=0.2, verify_s=0.1, identical=True)


def make_runs():
    """2 categories (coding: prompts 1 and 2; summary: prompt 3), 3 methods, 2 repeats, 10 new tokens each."""
    return [
        # none: coding medians 2.0 and 1.0 -> 20 / 3 tok/s; summary 10 tok/s; all 30 / 4 = 7.5
        run("none", "coding", 1, 0, 1.0), run("none", "coding", 1, 1, 3.0),
        run("none", "coding", 2, 0, 1.0), run("none", "coding", 2, 1, 1.0),
        run("none", "summary", 3, 0, 1.0), run("none", "summary", 3, 1, 1.0),
        # draft: coding medians 1.0 and 1.0 -> 10 tok/s; summary 20 tok/s; all 30 / 2.5 = 12
        coding_draft(1, 0, 0.5), coding_draft(1, 1, 1.5, identical=False),
        coding_draft(2, 0, 1.0), coding_draft(2, 1, 1.0),
        summary_draft(0), summary_draft(1),
        # hf-plain: coding 20 / 5 = 4 tok/s; summary 5 tok/s; all 30 / 7
        run("hf-plain", "coding", 1, 0, 2.5, identical=True), run("hf-plain", "coding", 1, 1, 2.5, identical=True),
        run("hf-plain", "coding", 2, 0, 2.5, identical=True), run("hf-plain", "coding", 2, 1, 2.5, identical=True),
        run("hf-plain", "summary", 3, 0, 2.0, identical=True), run("hf-plain", "summary", 3, 1, 2.0, identical=True),
    ]


def make_results(runs=None, roofline=ROOFLINE, with_summary=True):
    runs = make_runs() if runs is None else runs
    methods = list(dict.fromkeys(r["method"] for r in runs))
    results = {
        "meta": {
            "target": "Qwen/Qwen2.5-0.5B-Instruct", "draft": "tiny-draft", "dtype": "float32", "device": "cpu",
            "max_new_tokens": 10, "num_draft_tokens": 4, "repeats": 2, "methods": methods,
            "categories": ["coding", "summary"], "machine": "2 cores, no GPU, Linux x86_64, torch 2.13.0",
            "command": "draftwise bench --target x --draft y", "started": "2025-01-01T00:00:00",
        },
        "roofline": roofline,
        "runs": runs,
    }
    if with_summary:
        results["summary"] = summarize(runs, roofline)
    return results


def rows_of(runs, roofline=ROOFLINE):
    return {(row["method"], row["category"]): row for row in summarize(runs, roofline)}


# -- summary -----------------------------------------------------------------------------------------------------

def test_rows_come_methods_by_categories_with_all_after_each_method():
    keys = [(row["method"], row["category"]) for row in summarize(make_runs(), ROOFLINE)]
    assert keys == [
        ("none", "coding"), ("none", "summary"), ("none", "all"),
        ("draft", "coding"), ("draft", "summary"), ("draft", "all"),
        ("hf-plain", "coding"), ("hf-plain", "summary"), ("hf-plain", "all"),
    ]


def test_throughput_is_tokens_over_summed_median_times():
    rows = rows_of(make_runs())
    # none/coding: prompt medians 2.0 s and 1.0 s -> 20 / 3; the mean of per-prompt tok/s would be 7.5
    assert rows["none", "coding"]["tokens_per_s"] == pytest.approx(20 / 3)
    assert rows["none", "all"]["tokens_per_s"] == pytest.approx(7.5)
    assert rows["draft", "coding"]["tokens_per_s"] == pytest.approx(10.0)
    assert rows["draft", "summary"]["tokens_per_s"] == pytest.approx(20.0)
    assert rows["draft", "all"]["tokens_per_s"] == pytest.approx(12.0)
    assert rows["hf-plain", "all"]["tokens_per_s"] == pytest.approx(30 / 7)
    assert [rows[m, "all"]["prompts"] for m in ("none", "draft", "hf-plain")] == [3, 3, 3]
    assert rows["draft", "coding"]["prompts"] == 2


def test_median_over_repeats_not_mean_or_min():
    runs = [run("none", "coding", 1, i, s) for i, s in enumerate([1.0, 10.0, 1.5])]
    assert throughput(runs) == pytest.approx(10 / 1.5)  # mean would give 2.4, min 10.0


def test_speedups_against_hf_plain_and_none():
    rows = rows_of(make_runs())
    assert rows["draft", "coding"]["speedup_vs_none"] == pytest.approx(1.5)
    assert rows["draft", "coding"]["speedup_vs_hf_plain"] == pytest.approx(2.5)
    assert rows["draft", "summary"]["speedup_vs_hf_plain"] == pytest.approx(4.0)
    assert rows["draft", "all"]["speedup_vs_none"] == pytest.approx(1.6)
    assert rows["draft", "all"]["speedup_vs_hf_plain"] == pytest.approx(2.8)
    assert rows["hf-plain", "summary"]["speedup_vs_none"] == pytest.approx(0.5)
    assert rows["none", "coding"]["speedup_vs_hf_plain"] == pytest.approx(5 / 3)
    assert rows["none", "all"]["speedup_vs_none"] == 1.0


def test_acceptance_lengths_and_per_position():
    rows = rows_of(make_runs())
    draft = rows["draft", "coding"]
    assert draft["acceptance_rate"] == pytest.approx(24 / 64)
    assert draft["mean_accepted_length"] == pytest.approx(40 / 16)
    assert draft["mean_draft_length"] == pytest.approx(4.0)
    assert draft["per_position_acceptance"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert rows["draft", "summary"]["acceptance_rate"] == 1.0
    assert rows["draft", "all"]["acceptance_rate"] == pytest.approx(0.5)
    assert rows["draft", "all"]["mean_accepted_length"] == pytest.approx(3.0)
    assert rows["draft", "all"]["per_position_acceptance"] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    for method in ("none", "hf-plain"):
        row = rows[method, "all"]
        assert row["mean_accepted_length"] == 1.0
        assert row["acceptance_rate"] is row["mean_draft_length"] is row["per_position_acceptance"] is None


def test_per_position_acceptance_with_lists_of_different_lengths():
    runs = [{"proposed_at": [2, 2, 1], "accepted_at": [2, 1, 0]}, {"proposed_at": [3], "accepted_at": [3]}]
    assert per_position_acceptance(runs) == pytest.approx([1.0, 0.5, 0.0])
    assert per_position_acceptance([{"proposed_at": None, "accepted_at": None}]) is None


def test_cost_ratio_and_leviathan_prediction():
    rows = rows_of(make_runs())
    # coding: 2.4 s / 64 draft tokens = 0.0375 s over none's 6 s / 40 tokens = 0.15 s per step
    assert rows["draft", "coding"]["cost_ratio"] == pytest.approx(0.25)
    assert rows["draft", "coding"]["predicted_speedup"] == pytest.approx(32525 / 40960)  # (1-.375^5)/(.625*2)
    assert rows["draft", "coding"]["measured_over_predicted"] == pytest.approx(1.5 / (32525 / 40960))
    # summary: a == 1 -> (k + 1) / (k c + 1) = 5 / 2
    assert rows["draft", "summary"]["cost_ratio"] == pytest.approx(0.25)
    assert rows["draft", "summary"]["predicted_speedup"] == pytest.approx(2.5)
    assert rows["draft", "summary"]["measured_over_predicted"] == pytest.approx(0.8)
    # all: 2.8 s / 80 = 0.035 s over 8 s / 60 tokens -> c = 0.2625; (1 - 1/32) / (0.5 * 2.05)
    assert rows["draft", "all"]["cost_ratio"] == pytest.approx(0.2625)
    assert rows["draft", "all"]["predicted_speedup"] == pytest.approx(0.96875 / 1.025)
    for method in ("none", "hf-plain"):
        assert rows[method, "all"]["cost_ratio"] is rows[method, "all"]["predicted_speedup"] is None
        assert rows[method, "all"]["measured_over_predicted"] is None


def test_predicted_speedup_edge_cases():
    assert leviathan_speedup(1.0, 4, 0.0) == 5.0
    assert leviathan_speedup(0.0, 4, 0.0) == 1.0
    assert leviathan_speedup(0.5, 1, 1.0) == pytest.approx(0.75)
    assert leviathan_speedup(None, 4, 0.1) is None and leviathan_speedup(0.5, 4, None) is None


def test_the_prediction_sums_rounds_of_different_lengths_instead_of_averaging_k():
    # Every round offering k: the formula itself.
    assert leviathan_over_rounds(0.6, 0.2, 10, [10] * 4) == pytest.approx(leviathan_speedup(0.6, 4, 0.2))
    # Half the rounds offer 4, half are plain steps (k = 2 on average): (2 + .6 + .36 + .216 + .1296) / 2 tokens a
    # round, (1 + 4 * 0.2) / 2 + 1 / 2 steps; the mean k in the formula would say (1 + .6 + .36) / 1.4.
    mixed = leviathan_over_rounds(0.6, 0.2, 10, [5] * 4)
    assert mixed == pytest.approx(((2 + 0.6 + 0.36 + 0.216 + 0.1296) / 2) / 1.4)
    assert mixed < leviathan_speedup(0.6, 2, 0.2)
    assert leviathan_over_rounds(None, 0.2, 10, [5]) is None and leviathan_over_rounds(0.6, 0.2, 0, []) is None
    # The bench's rows and a run's own stats give the same figure.
    stats = Stats("draft", 4, new_tokens=9, verify_s=1.0, draft_s=0.4)
    for offered, kept in ((4, 2), (0, 0), (4, 4), (0, 0)):
        stats.observe_draft(offered, kept)
    row = {"proposed": stats.proposed, "accepted": stats.accepted, "rounds": stats.rounds,
           "proposed_at": stats.proposed_at, "accepted_at": stats.accepted_at}
    c = stats.cost_ratio
    assert predicted_speedup([row], 0.75, 2.0, c) == pytest.approx(stats.predicted_speedup)
    assert stats.predicted_speedup == pytest.approx((4 + 2 * (0.75 + 0.75**2 + 0.75**3 + 0.75**4)) / (4 + 8 * c))
    # Runs that did not count offers by position (transformers' assisted generation): the mean k.
    assert predicted_speedup([{"rounds": 4, "proposed_at": None}], 0.75, 2.0, c) == leviathan_speedup(0.75, 2.0, c)


def test_identical_counts_prompts_whose_every_repeat_matched():
    rows = rows_of(make_runs())
    assert rows["draft", "coding"]["identical"] == 1  # prompt 1's second repeat differed
    assert rows["draft", "summary"]["identical"] == 1
    assert rows["draft", "all"]["identical"] == 2
    assert rows["hf-plain", "all"]["identical"] == 3
    assert rows["none", "all"]["identical"] is None  # the reference itself is never compared


def test_without_hf_plain_its_speedups_are_none():
    rows = rows_of([r for r in make_runs() if r["method"] != "hf-plain"])
    assert all(row["speedup_vs_hf_plain"] is None for row in rows.values())
    assert rows["draft", "all"]["speedup_vs_none"] == pytest.approx(1.6)


def test_without_none_c_falls_back_to_the_roofline_then_to_none():
    runs = [r for r in make_runs() if r["method"] != "none"]
    rows = rows_of(runs)
    assert all(row["speedup_vs_none"] is None and row["measured_over_predicted"] is None for row in rows.values())
    # 0.0375 s per draft token over the roofline's 100 ms target step
    assert rows["draft", "coding"]["cost_ratio"] == pytest.approx(0.375)
    assert rows["draft", "coding"]["predicted_speedup"] == pytest.approx((32525 / 32768) / (0.625 * 2.5))
    no_roofline = rows_of(runs, roofline=None)
    assert no_roofline["draft", "coding"]["cost_ratio"] is None
    assert no_roofline["draft", "coding"]["predicted_speedup"] is None
    assert no_roofline["draft", "coding"]["acceptance_rate"] == pytest.approx(0.375)


def test_missing_target_forwards_gives_no_mean_accepted_length():
    runs = [run("hf-plain", "coding", 1, 0, 1.0, target_forwards=None)]
    assert summarize(runs)[0]["mean_accepted_length"] is None


# -- report ------------------------------------------------------------------------------------------------------

def test_md_table():
    assert md_table(["a", "b"], [["x", "1"]]) == "| a | b |\n| :--- | ---: |\n| x | 1 |"


def test_report_has_setup_and_tables_with_formatted_cells(tmp_path):
    results = make_results()
    path = write_report(results, tmp_path, {"float32": {"speedup_by_category": "speedup_by_category.png"}})
    assert path == tmp_path / "report.md"
    text = path.read_text()
    assert text.startswith("# draftwise bench")
    for fragment in ("2 cores, no GPU", "float32", "Qwen/Qwen2.5-0.5B-Instruct", "tiny-draft", "max_new_tokens 10",
                     "repeats 2", "`draftwise bench --target x --draft y`"):
        assert fragment in text
    # table 1
    assert "| method | coding | summary | all |" in text
    assert "| draft | 10.0 (2.50x) | 20.0 (4.00x) | 12.0 (2.80x) |" in text
    assert "| hf-plain | 4.0 (1.00x) | 5.0 (1.00x) | 4.3 (1.00x) |" in text
    # table 2
    assert ("| draft | coding | 2 | 10.0 | 2.50x | 1.50x | 37.5% | 2.50 | 4.00 | 4.00 | 0.250 | 0.79x | 1.89x | 1/2 |"
            in text)
    assert "| draft | summary | 1 | 20.0 | 4.00x | 2.00x | 100.0% | 5.00 | 4.00 | 4.00 | 0.250 | 2.50x | 0.80x | 1/1 |" in text
    assert "| none | all | 3 | 7.5 | 1.75x | 1.00x | - | 1.00 | - | - | - | - | - | - |" in text
    assert "| hf-plain | all | 3 | 4.3 | 1.00x | 0.57x | - | 1.00 | - | - | - | - | - | 3/3 |" in text
    # table 3: only draft has per-position acceptance
    assert "| method | pos 1 | pos 2 | pos 3 | pos 4 |" in text
    assert "| draft | 80.0% | 60.0% | 40.0% | 20.0% |" in text
    assert "| none | -" not in text.split("## Acceptance by draft position")[1].split("##")[0]
    # table 4 and its reading: 5 tokens interpolated between 4 (110 ms) and 8 (150 ms) -> 120 ms = 1.20x
    assert "| new tokens | target ms | target x of 1 token | draft ms | draft x of 1 token |" in text
    assert "| 8 | 150.00 | 1.50x | 14.00 | 1.40x |" in text
    assert "verifying k + 1 = 5 tokens costs 1.20x one plain step" in text
    assert "memory-bound" in text
    # 4 draft forwards (40 ms) + a 120 ms verification = 1.60 plain steps
    assert "costs about 1.60 plain steps" in text
    # plots: relative links to what was passed
    assert "![Speedup by category](speedup_by_category.png)" in text
    assert "acceptance_by_position.png" not in text


def test_report_without_hf_plain_or_roofline_or_summary(tmp_path):
    runs = [r for r in make_runs() if r["method"] != "hf-plain"]
    text = write_report(make_results(runs, roofline=None, with_summary=False), tmp_path, None).read_text()
    assert "| draft | 10.0 | 20.0 | 12.0 |" in text  # no parentheses without hf-plain
    assert "| draft | coding | 2 | 10.0 | - | 1.50x |" in text  # summary computed from the runs
    assert "## Roofline" not in text and "## Plots" not in text and "![" not in text


# -- the promise: no method slower than none ---------------------------------------------------------------------

def summary_row(method, category, tokens_per_s, none_tokens_per_s, dtype="float32"):
    """A summary row as summarize makes it, with only the fields the guard reads filled in."""
    fields = ("prompts", "speedup_vs_hf_plain", "acceptance_rate", "mean_accepted_length", "per_position_acceptance",
              "mean_draft_length", "cost_ratio", "predicted_speedup", "measured_over_predicted", "identical")
    return {**dict.fromkeys(fields), "dtype": dtype, "method": method, "category": category, "prompts": 1,
            "tokens_per_s": tokens_per_s, "speedup_vs_none": tokens_per_s / none_tokens_per_s}


def guarded_results(rows):
    return {"meta": {"methods": ["none", "draft", "lookup"], "categories": ["code", "qa"], "dtypes": ["float32"]},
            "summary": rows}


def promise_section(text):
    return text.split("## Methods slower than `none`")[1].split("\n## ")[0]


def test_methods_below_095x_of_none_are_flagged_with_category_and_ratio(tmp_path):
    rows = [
        summary_row("none", "code", 10.0, 10.0), summary_row("none", "qa", 8.0, 8.0),
        summary_row("none", "all", 9.0, 9.0),
        summary_row("draft", "code", 20.0, 10.0), summary_row("draft", "qa", 7.2, 8.0),  # 0.90x
        summary_row("draft", "all", 13.0, 9.0),
        summary_row("lookup", "code", 9.5, 10.0), summary_row("lookup", "qa", 7.8, 8.0),  # 0.95x: not below
        summary_row("lookup", "all", 8.1, 9.0),  # 0.90x
    ]
    assert [(r["method"], r["category"]) for r in below_none(rows)] == [("draft", "qa"), ("lookup", "all")]
    section = promise_section(write_report(guarded_results(rows), tmp_path, None).read_text())
    assert "| draft | qa | 7.2 | 0.900x |" in section
    assert "| lookup | all | 8.1 | 0.900x |" in section
    assert "| lookup | code" not in section and "| none |" not in section
    assert "No method" not in section


def test_the_promise_section_says_so_when_no_method_is_below(tmp_path):
    rows = [summary_row("none", "code", 10.0, 10.0), summary_row("draft", "code", 9.5, 10.0),
            summary_row("lookup", "code", 30.0, 10.0)]
    assert below_none(rows) == []
    section = promise_section(write_report(guarded_results(rows), tmp_path, None).read_text())
    assert "No method is below 0.95x of `none`'s tokens/s in any category." in section
    assert "|" not in section


def test_header_says_when_the_bench_ran_and_for_how_long(tmp_path):
    results = make_results()
    results["meta"].update(started="2026-11-24 21:45:02", finished="2026-11-24 22:57:59", wall_seconds=4377.0)
    assert "Started 2026-11-24 21:45:02, finished 2026-11-24 22:57:59, 73 min." in \
        write_report(results, tmp_path, None).read_text()
    # results written before the finish was recorded keep their one timestamp
    del results["meta"]["finished"], results["meta"]["wall_seconds"]
    assert "Started 2026-11-24 21:45:02." in write_report(results, tmp_path, None).read_text()


def test_without_none_the_promise_section_says_nothing_was_compared(tmp_path):
    rows = [r for r in make_results()["summary"] if r["method"] != "none"]
    section = promise_section(write_report({"meta": {}, "summary": rows}, tmp_path, None).read_text())
    assert "`none` was not run" in section


# -- several dtypes ----------------------------------------------------------------------------------------------

def two_dtype_results():
    """make_runs() in float32, and again in bfloat16 with draft twice as fast; each with its own roofline."""
    f32 = [{**r, "dtype": "float32"} for r in make_runs()]
    bf16 = [{**r, "dtype": "bfloat16", "decode_s": r["decode_s"] / (2 if r["method"] == "draft" else 1)}
            for r in make_runs()]
    results = make_results(f32 + bf16, roofline={"float32": ROOFLINE, "bfloat16": None}, with_summary=False)
    results["meta"]["dtypes"] = ["float32", "bfloat16"]
    del results["meta"]["dtype"]
    return results


def test_split_by_dtype_keeps_each_dtype_apart():
    parts = split_by_dtype(two_dtype_results())
    assert list(parts) == ["float32", "bfloat16"]
    assert parts["float32"]["roofline"] == ROOFLINE and parts["bfloat16"]["roofline"] is None
    assert parts["bfloat16"]["meta"]["dtype"] == "bfloat16"
    assert all(run["dtype"] == "bfloat16" for run in parts["bfloat16"]["runs"])
    rows = {dtype: {(r["method"], r["category"]): r for r in part["summary"]} for dtype, part in parts.items()}
    # Each dtype is compared with its own none: draft/coding 1.5x in float32, 3.0x in bfloat16.
    assert rows["float32"]["draft", "coding"]["speedup_vs_none"] == pytest.approx(1.5)
    assert rows["bfloat16"]["draft", "coding"]["speedup_vs_none"] == pytest.approx(3.0)
    # Results from before dtypes were recorded per row come back whole, under the meta's dtype.
    assert list(split_by_dtype(make_results())) == ["float32"]


def test_report_and_plots_per_dtype(tmp_path):
    results = two_dtype_results()
    plots = write_plots(results, tmp_path)
    assert plots == {
        dtype: {"speedup_by_category": f"speedup_by_category_{dtype}.png",
                "acceptance_by_position": f"acceptance_by_position_{dtype}.png"}
        for dtype in ("float32", "bfloat16")
    }
    assert all((tmp_path / f).read_bytes()[:8] == PNG_SIGNATURE for p in plots.values() for f in p.values())
    text = write_report(results, tmp_path, plots).read_text()
    assert "float32, bfloat16" in text.split("\n## ")[0]  # the setup line names both
    f32, bf16 = text.split("\n## float32\n")[1].split("\n## bfloat16\n")
    assert "### Tokens/s by category" in f32 and "### Tokens/s by category" in bf16
    assert "| draft | 10.0 (2.50x) | 20.0 (4.00x) | 12.0 (2.80x) |" in f32
    assert "| draft | 20.0 (5.00x) | 40.0 (8.00x) | 24.0 (5.60x) |" in bf16
    assert "### Roofline" in f32 and "Roofline" not in bf16
    assert "(speedup_by_category_float32.png)" in f32 and "(speedup_by_category_bfloat16.png)" in bf16
    # The guard names the dtype of each flagged row when there are several.
    assert "| bfloat16 | hf-plain | coding | 4.0 | 0.600x |" in promise_section(text)


# -- plots -------------------------------------------------------------------------------------------------------

def test_plots_are_valid_pngs(tmp_path):
    written = write_plots(make_results(), tmp_path)["float32"]
    assert written == {
        "speedup_by_category": "speedup_by_category.png",
        "acceptance_by_position": "acceptance_by_position.png",
    }
    for filename in written.values():
        data = (tmp_path / filename).read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000


def test_plots_skipped_when_there_is_nothing_to_draw(tmp_path):
    # no method with per-position acceptance -> no acceptance plot
    plain = [r for r in make_runs() if r["method"] != "draft"]
    assert write_plots(make_results(plain), tmp_path / "a") == {
        "float32": {"speedup_by_category": "speedup_by_category.png"}}
    assert not (tmp_path / "a" / "acceptance_by_position.png").exists()
    # neither hf-plain nor none to compare with -> no speedup plot
    draft_only = [r for r in make_runs() if r["method"] == "draft"]
    assert write_plots(make_results(draft_only), tmp_path / "b") == {
        "float32": {"acceptance_by_position": "acceptance_by_position.png"}}
    assert not (tmp_path / "b" / "speedup_by_category.png").exists()


def test_speedup_plot_reference_falls_back_to_none_and_says_so():
    summary = make_results()["summary"]
    assert speedup_reference(summary) == ("speedup_vs_hf_plain", "hf-plain")
    without_peer = [row for row in copy.deepcopy(summary) if row["method"] != "hf-plain"]
    field, label = speedup_reference(without_peer)
    assert field == "speedup_vs_none" and "none" in label and "hf-plain not run" in label
    assert speedup_reference([row for row in summary if row["method"] == "draft"]) is None


def _plain_runs(seconds_per_pass):
    """`none` runs of 10 passes each: {(category, qid): [seconds per pass of each repeat]}."""
    return [run("none", category, qid, repeat, 10 * s, verify_s=10 * s)
            for (category, qid), repeats in seconds_per_pass.items() for repeat, s in enumerate(repeats)]


def test_steadiness_names_the_spread_between_repeats_and_warns_when_the_machine_moved(tmp_path):
    # Prompt 1's repeats ran at 60 and 85 ms a pass (1.42x); the others within 2%: the median spread is 2%.
    runs = _plain_runs({("qa", 1): [0.060, 0.085], ("qa", 2): [0.060, 0.0612], ("code", 3): [0.070, 0.0714]})
    text = write_report({"meta": {"methods": ["none"]}, "runs": runs}, tmp_path, None).read_text()
    section = text.split("## Machine steadiness\n\n")[1].split("\n\n")[0]
    assert "by 2% at the median and 42% at most (qa #1), over 3 prompts" in section
    assert "speed changed during the run" in section


def test_steadiness_says_no_more_when_repeats_agree_and_is_absent_without_repeats(tmp_path):
    steady = _plain_runs({("qa", 1): [0.060, 0.061], ("qa", 2): [0.060, 0.0612]})
    text = write_report({"meta": {"methods": ["none"]}, "runs": steady}, tmp_path, None).read_text()
    assert "at most (qa #" in text and "speed changed" not in text
    single = _plain_runs({("qa", 1): [0.060], ("qa", 2): [0.090]})  # different prompts are not compared
    text = write_report({"meta": {"methods": ["none"]}, "runs": single}, tmp_path, None).read_text()
    assert "Machine steadiness" not in text


# -- trees beside their chains -------------------------------------------------------------------------------------

def _paired_runs(seconds: dict[tuple[str, int], list[float]]) -> list[dict]:
    """{(method, prompt): decode seconds of its repeats} -> runs of 10 new tokens, all in category qa."""
    return [run(method, "qa", qid, repeat, s) for (method, qid), repeats in seconds.items()
            for repeat, s in enumerate(repeats)]


def test_a_tree_is_compared_with_its_chain_prompt_by_prompt():
    runs = _paired_runs({("draft", 1): [1.0, 3.0], ("draft-tree", 1): [1.0, 1.0],  # medians 2.0 and 1.0: 2x
                         ("draft", 2): [1.0, 1.0], ("draft-tree", 2): [2.0, 2.0],  # 0.5x
                         ("draft-tree", 3): [1.0, 1.0],  # (a prompt the chain did not run is left out,
                         ("draft", 4): [1.0, 1.0], ("draft-tree", 4): [1.0, 1.0]})
    runs[-1]["decode_s"] = 0.0  # and so is one with a run of no decode time)
    assert paired_ratios(runs, "draft-tree", "draft") == [2.0, 0.5]
    assert paired_speedup([2.0, 0.5]) == {"prompts": 2, "ratio": pytest.approx(1.0), "low": None, "high": None,
                                          "ahead": 1}  # two prompts: no interval
    three = paired_speedup([2.0, 0.5, 1.0])
    # The resampled triples give means from 0.5 to 2: the interval spans most of them, the geometric mean is 1.
    assert three["ratio"] == pytest.approx(1.0) and 0.5 <= three["low"] < 1.0 < three["high"] <= 2.0
    assert paired_speedup([1.1, 1.2, 1.05])["low"] > 1.0  # ahead on every prompt: the interval is above 1
    rows = trees_beside_chains(runs)
    assert [(row["tree"], row["category"], row["prompts"]) for row in rows] == [("draft-tree", "qa", 2),
                                                                               ("draft-tree", "all", 2)]
    assert trees_beside_chains([r for r in runs if r["method"] != "draft"]) == []  # no chain, no comparison


def test_the_report_marks_a_tree_slower_than_its_chain_beyond_the_noise(tmp_path):
    runs = _paired_runs({**{("lookup", q): [1.0, 1.0] for q in (1, 2, 3)},
                         **{("lookup-tree", q): [1.2, 1.25] for q in (1, 2, 3)},
                         **{("draft", q): [1.0, 1.0] for q in (1, 2, 3)},
                         ("draft-tree", 1): [0.9, 0.9], ("draft-tree", 2): [1.1, 1.1], ("draft-tree", 3): [1.0, 1.0]})
    text = write_report({"meta": {"methods": ["draft", "draft-tree", "lookup", "lookup-tree"]}, "runs": runs},
                        tmp_path, None).read_text()
    section = text.split("## Trees beside their chains\n\n")[1].split("\n\n")[0]
    assert "| draft-tree | draft | qa | 3 | 1.003x | 0.91-1.11 | 1 of 3 |" in section  # mixed: within the noise
    assert "| lookup-tree | lookup | qa | 3 | 0.816x | 0.82-0.82 below | 0 of 3 |" in section  # 1.225 s against 1
    plain = write_report({"meta": {"methods": ["none"]}, "runs": _plain_runs({("qa", 1): [0.06]})}, tmp_path, None)
    assert "Trees beside" not in plain.read_text()
    one = write_report({"meta": {"methods": ["lookup", "lookup-tree"]}, "runs": [r for r in runs if r["question_id"] == 1
                                                                              and "lookup" in r["method"]]},
                       tmp_path, None).read_text()
    assert "| lookup-tree | lookup | qa | 1 | 0.816x | - | 0 of 1 |" in one  # one prompt: slower, but no interval


def test_token_digests_name_nones_tokens_and_the_methods_that_gave_other_ones(tmp_path):
    from draftwise.bench.report import token_digest

    ids = [5, 17, 3]
    runs = [run("none", "coding", "p1", 0, 1.0, token_ids=ids), run("none", "coding", "p1", 1, 1.0, token_ids=ids),
            run("lookup", "coding", "p1", 0, 1.0, token_ids=ids),
            run("draft", "coding", "p1", 0, 1.0, token_ids=[5, 17, 4]),  # parts at the last token
            run("none", "coding", "p2", 0, 1.0, token_ids=[9]), run("lookup", "coding", "p2", 0, 1.0, token_ids=[9])]
    text = write_report(make_results(runs), tmp_path, None).read_text()
    section = text.split("## Token digests")[1].split("\n## ")[0]
    assert f"| p1 | 3 | `{token_digest(ids)}` | 1 of 2 | draft |" in section
    assert f"| p2 | 1 | `{token_digest([9])}` | 1 of 1 | - |" in section
    # the digest is of the ids alone, and tells apart outputs that differ in one token or in their order
    assert token_digest(ids) == token_digest((5, 17, 3)) != token_digest([5, 17, 4]) != token_digest([17, 5, 3])
    assert len(token_digest(ids)) == 16
    # sampled runs are not compared
    sampled = make_results(runs)
    sampled["meta"]["temperature"] = 0.7
    assert "## Token digests" not in write_report(sampled, tmp_path / "s", None).read_text()
