"""draftwise bench end to end on tiny models: every method, the raw runs, identity, the outputs, the CLI.

Speed is never asserted here: only what the bench counts and writes.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
from conftest import tiny_model, tiny_tokenizer

from draftwise import cli
from draftwise.bench import command
from draftwise.bench import runners as runner_module
from draftwise.bench.run import DEFAULT_METHODS, BenchConfig, run_bench
from draftwise.errors import DraftwiseError
from draftwise.bench.runners import Runners, StepMark, _peer_record
from draftwise.adaptive import DraftLengthPolicy
from draftwise.bench.summary import summarize
from draftwise.config import DTYPES
from draftwise.hardware import resolve_dtype

N = 12
PROMPTS = [
    {"question_id": 1, "category": "prose", "turns": ["The quick brown fox jumps over the lazy dog.", "more"]},
    {"question_id": 2, "category": "code", "turns": ["def quicksort(arr):\n    if len(arr) <= 1:"]},
    {"question_id": 3, "category": "prose", "turns": ["Summaries copy spans of the article."]},
    {"question_id": 4, "category": "code", "turns": ["for i in range(10):\n    print(i"]},
]


@functools.cache
def _models(draft_seed: int = 0):
    """Target and draft, tiny; seed 0 makes the draft the target's twin (every draft token accepted)."""
    return tiny_model("llama", seed=0), tiny_tokenizer(), tiny_model("llama", seed=draft_seed)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def _config(tmp_path, prompts_file, **overrides) -> BenchConfig:
    options = dict(target="tiny", draft="tiny", prompts_file=str(prompts_file), per_category=None,
                   max_new_tokens=N, repeats=2, out=str(tmp_path / "out"), progress=False)
    return BenchConfig(**{**options, **overrides})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    path = tmp / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    return run_bench(_config(tmp, path), command="test", models=_models(draft_seed=1)), tmp / "out"


def test_every_method_runs_every_prompt_and_repeat(results):
    res, _ = results
    runs = res["runs"]
    assert len(runs) == len(PROMPTS) * 2 * len(DEFAULT_METHODS)
    assert {(r["method"], r["question_id"], r["repeat"]) for r in runs} == {
        (m, p["question_id"], rep) for m in DEFAULT_METHODS for p in PROMPTS for rep in range(2)
    }
    assert all(r["new_tokens"] == N and len(r["token_ids"]) == N for r in runs)
    assert all(r["decode_s"] > 0 for r in runs)


def test_methods_are_interleaved_each_repeat_mirroring_the_one_before(results):
    runs = results[0]["runs"]
    methods = list(DEFAULT_METHODS)
    # Repeat 0 runs the methods in order; repeat 1 backwards, so neighbours change and a steady drift weighs on all.
    assert [r["method"] for r in runs[: len(methods)]] == methods
    block = [r["method"] for r in runs[len(methods): 2 * len(methods)]]
    assert block == list(reversed(methods))
    followers = {(a, b) for a, b in zip(block, block[1:])}
    assert not followers & set(zip(methods, methods[1:]))  # no method follows the one it followed before


def test_every_method_reproduces_the_target_greedy_output(results):
    # float32, greedy: speculative or not, ours or transformers', the tokens are the target's own.
    rows = {(r["method"], r["category"]): r for r in results[0]["summary"]}
    for method in DEFAULT_METHODS:
        assert rows[(method, "all")]["identical"] == len(PROMPTS), method
    assert all(r["identical"] for r in results[0]["runs"])


def test_counts_of_speculative_methods(results):
    runs = results[0]["runs"]
    for run in runs:
        if run["method"] in ("draft", "lookup", "hf-assisted"):
            # Each target pass emits the kept draft tokens plus one of its own.
            assert run["new_tokens"] == run["accepted"] + run["rounds"], run["method"]
            assert 0 <= run["accepted"] <= run["proposed"]
        if run["method"] in ("none", "hf-plain"):
            assert run["target_forwards"] == N and run["proposed"] is None


def test_summary_rows_cover_methods_by_category_and_all(results):
    summary = results[0]["summary"]
    assert [(r["method"], r["category"]) for r in summary] == [
        (m, c) for m in DEFAULT_METHODS for c in ("prose", "code", "all")
    ]
    for row in summary:
        assert row["prompts"] == (4 if row["category"] == "all" else 2)
        assert row["tokens_per_s"] > 0
    none_all = next(r for r in summary if r["method"] == "none" and r["category"] == "all")
    assert none_all["speedup_vs_none"] == pytest.approx(1.0) and none_all["mean_accepted_length"] == 1.0


def test_outputs_are_written(results):
    res, out = results
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["summary"] == json.loads(json.dumps(res["summary"]))
    roofline = on_disk["roofline"]["float32"]
    assert set(roofline["target"]) == set(roofline["target_as_loaded"]) == {"1", "2", "4", "8", "16"}
    assert on_disk["meta"]["machine"] and on_disk["meta"]["dtypes"] == ["float32"]
    # started is taken before loading and finished after the report's inputs: not both at the end
    assert on_disk["meta"]["started"] <= on_disk["meta"]["finished"] and on_disk["meta"]["wall_seconds"] > 0
    assert {r["dtype"] for r in on_disk["runs"] + on_disk["summary"]} == {"float32"}
    report = (out / "report.md").read_text()
    assert on_disk["meta"]["code"] and f"Code: {on_disk['meta']['code']}." in report  # which code printed it
    assert "target as loaded ms" in report
    assert "hf-assisted" in report and "speedup_by_category.png" in report
    for png in ("speedup_by_category.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_model_draft_is_fully_accepted(tmp_path, prompts_file):
    # fixed_k: the draft-length policy would rightly draft little or nothing with a twin that costs what the
    # target does (on a slow machine nothing at all); drafting 4 every round, every position must be kept.
    res = run_bench(_config(tmp_path, prompts_file, methods=("none", "draft"), repeats=1, roofline=False,
                            fixed_k=True), models=_models(draft_seed=0))
    rows = {(r["method"], r["category"]): r for r in res["summary"]}
    assert rows[("draft", "all")]["acceptance_rate"] == 1.0
    assert rows[("draft", "all")]["per_position_acceptance"] == [1.0] * 4


def test_eos_is_ignored_by_every_method(tmp_path, prompts_file):
    # Make a token the target emits its EOS: every method must still emit exactly N tokens, the same ones.
    target, tokenizer, draft = tiny_model("llama", seed=0), tiny_tokenizer(), tiny_model("llama", seed=0)
    res = run_bench(_config(tmp_path, prompts_file, methods=("none", "hf-plain"), repeats=1, roofline=False),
                    models=(target, tokenizer, draft))
    emitted = res["runs"][0]["token_ids"][3]
    target.generation_config.eos_token_id = emitted
    res = run_bench(_config(tmp_path, prompts_file, methods=("none", "lookup", "hf-plain", "hf-lookup"),
                            repeats=1, roofline=False), models=(target, tokenizer, draft))
    assert all(r["new_tokens"] == N and r["identical"] for r in res["runs"])


# ---------------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture
def fake_load(monkeypatch):
    calls = []

    def load(cfg):
        calls.append(cfg)
        return _models(draft_seed=1)

    monkeypatch.setattr(command, "load_bench_models", load)
    # --dtype auto on hf, as the tiny models (no GGUF files) would have it.
    monkeypatch.setattr(command, "choose_auto", lambda cfg: resolve_dtype("auto", cfg.device))
    return calls


def test_cli_bench_writes_outputs_and_prints_the_report_path(tmp_path, prompts_file, fake_load, capsys):
    out = tmp_path / "res"
    code = cli.main(["bench", "--prompts", str(prompts_file), "--methods", "none,lookup,hf-plain", "--repeats", "1",
                     "--max-new-tokens", "6", "--out", str(out), "--no-roofline", "-q"])
    assert code == 0
    assert capsys.readouterr().out.strip() == f"{out}/report.md"
    assert (out / "results.json").exists() and (out / "report.md").exists()
    assert fake_load[0].methods == ("none", "lookup", "hf-plain")
    # The default dtype: what this machine computes natively.
    assert [cfg.dtype for cfg in fake_load] == [resolve_dtype("auto")]


def test_the_command_recorded_names_the_kernel_path_the_environment_forced(tmp_path, prompts_file, fake_load,
                                                                            monkeypatch):
    """A bench with DRAFTWISE_KERNEL_ISA set reruns only with it set: the report's command carries it."""
    monkeypatch.setenv("DRAFTWISE_KERNEL_ISA", "avx2")
    monkeypatch.delenv("DRAFTWISE_KERNEL_PREFETCH", raising=False)
    out = tmp_path / "res"
    args = ["bench", "--prompts", str(prompts_file), "--methods", "none", "--repeats", "1", "--max-new-tokens", "4",
            "--out", str(out), "--no-roofline", "-q"]
    monkeypatch.setattr(sys, "argv", ["draftwise", *args])  # what the command line records
    assert cli.main(args) == 0
    command = json.loads((out / "results.json").read_text())["meta"]["command"]
    assert command.startswith("DRAFTWISE_KERNEL_ISA=avx2 draftwise bench --prompts ")
    monkeypatch.delenv("DRAFTWISE_KERNEL_ISA")
    assert cli.main(args) == 0
    assert json.loads((out / "results.json").read_text())["meta"]["command"].startswith("draftwise bench --prompts ")


def test_cli_bench_json_prints_the_summary(tmp_path, prompts_file, fake_load, capsys):
    code = cli.main(["bench", "--prompts", str(prompts_file), "--methods", "none,draft", "--repeats", "1",
                     "--max-new-tokens", "6", "--out", str(tmp_path / "o"), "--no-roofline", "--json",
                     "--categories", "code"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["method"], r["category"]) for r in rows] == [("none", "code"), ("none", "all"), ("draft", "code"),
                                                            ("draft", "all")]


@pytest.mark.parametrize("args, message", [
    (["--methods", "none,turbo"], "unknown bench method 'turbo'; choose from: none, draft, draft-tree, lookup"),
    (["--repeats", "0"], "repeats must be at least 1, got 0"),
    (["-k", "65"], "num-draft-tokens must be between 1 and 64, got 65"),
    (["--categories", "poetry"], "unknown category poetry; available: all, prose, code"),
    (["--per-category", "0"], "per_category must be an integer >= 1"),
    (["--dtype", "float32,float16"], f"dtype must be one of {', '.join(DTYPES)}, got 'float16'"),
    (["--dtype", ","], f"give at least one of {', '.join(DTYPES)}"),
])
def test_cli_bench_rejects_bad_options_before_loading(tmp_path, prompts_file, fake_load, capsys, args, message):
    code = cli.main(["bench", "--prompts", str(prompts_file), "--out", str(tmp_path / "o"), *args])
    assert code == 1
    assert message in capsys.readouterr().err
    assert fake_load == []


def test_cli_bench_missing_prompt_file_and_out_that_is_a_file(tmp_path, prompts_file, fake_load, capsys):
    assert cli.main(["bench", "--prompts", str(tmp_path / "nope.jsonl")]) == 1
    assert "nope.jsonl" in capsys.readouterr().err
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert cli.main(["bench", "--prompts", str(prompts_file), "--out", str(a_file)]) == 1
    assert "is a file" in capsys.readouterr().err
    assert cli.main(["bench", "--prompts", str(prompts_file), "--out", str(a_file / "under")]) == 1
    assert f"--out {a_file / 'under'}: cannot make the folder (Not a directory)" in capsys.readouterr().err
    assert fake_load == []


def _bench_cli(prompts_file, out, *extra):
    return cli.main(["bench", "--prompts", str(prompts_file), "--methods", "none,draft", "--repeats", "1",
                     "--max-new-tokens", "6", "--categories", "code", "--out", str(out), "-q", *extra])


def test_cli_bench_runs_once_per_dtype_and_reports_each(tmp_path, prompts_file, fake_load, monkeypatch):
    # The draft drafts every round, so that each dtype has per-position acceptance to plot: with tiny models a draft
    # forward costs what a target step does, and adaptive k would draft only the first round and rare probes.
    monkeypatch.setattr(DraftLengthPolicy, "choose", lambda self, rates, k_max, *args, **kwargs: k_max)
    out = tmp_path / "res"
    assert _bench_cli(prompts_file, out, "--dtype", "float32,bfloat16") == 0
    # Models loaded once per dtype, in the order given.
    assert [cfg.dtype for cfg in fake_load] == ["float32", "bfloat16"]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["dtypes"] == ["float32", "bfloat16"]
    assert set(results["roofline"]) == {"float32", "bfloat16"}
    runs_per_dtype = 2 * 2  # two code prompts, two methods, one repeat
    assert [r["dtype"] for r in results["runs"]] == ["float32"] * runs_per_dtype + ["bfloat16"] * runs_per_dtype
    assert [(r["dtype"], r["method"], r["category"]) for r in results["summary"]] == [
        (d, m, c) for d in ("float32", "bfloat16") for m in ("none", "draft") for c in ("code", "all")]
    assert all(r["identical"] for r in results["runs"] if r["method"] == "draft")  # vs its own dtype's none
    report = (out / "report.md").read_text()
    assert "\n## float32\n" in report and "\n## bfloat16\n" in report
    for dtype in ("float32", "bfloat16"):
        for plot in ("speedup_by_category", "acceptance_by_position"):
            assert (out / f"{plot}_{dtype}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"({plot}_{dtype}.png)" in report
    assert not (out / "speedup_by_category.png").exists()


def test_cli_bench_runs_a_dtype_once_however_it_is_named(tmp_path, prompts_file, fake_load):
    # auto is float32 or bfloat16 here; asking for both and auto must not run either twice.
    assert _bench_cli(prompts_file, tmp_path / "res", "--dtype", "auto,float32,bfloat16,float32") == 0
    assert sorted(cfg.dtype for cfg in fake_load) == ["bfloat16", "float32"]
    assert fake_load[0].dtype == resolve_dtype("auto")
    results = json.loads((tmp_path / "res" / "results.json").read_text())
    assert results["meta"]["dtypes"] == [cfg.dtype for cfg in fake_load]


# ---------------------------------------------------------------------------------------------------------
# How the peers are timed


def test_a_peer_is_timed_from_its_first_step_end_at_that_rate_for_every_token():
    # Prompt of 5; the prefill step emits 1 token (ends at 10 s), then 3 more steps emit 1 + 2 + 1 (end at 16 s).
    marks = [StepMark(10.0, 6, 1, 1), StepMark(12.0, 7, 2, 3), StepMark(14.0, 9, 3, 5), StepMark(16.0, 10, 4, 6)]
    target, draft = [5.0, 1.5, 1.5, 1.5], [0.1, 0.2, 0.2, 0.2, 0.2, 0.2]
    record = _peer_record("hf-assisted", 5, marks, target, draft)
    # 4 tokens in the 6 s after the prefill step: 1.5 s a token, for all 5.
    assert record["decode_s"] == pytest.approx(7.5) and record["tokens_per_s"] == pytest.approx(5 / 7.5)
    # Each model's calls at their rate after the first step, for every call: the draft's c is per proposal.
    assert record["verify_s"] == pytest.approx(4 * 1.5) and record["draft_s"] == pytest.approx(6 * 0.2)
    assert (record["target_forwards"], record["rounds"], record["proposed"], record["accepted"]) == (4, 4, 6, 1)


def test_a_peer_that_emitted_every_token_in_its_first_step_has_no_decode_time_and_is_left_out():
    alone = _peer_record("hf-assisted", 4, [StepMark(10.0, 9, 1, 4)], [5.0], [0.1] * 4)
    assert alone["decode_s"] is None and alone["tokens_per_s"] is None and alone["draft_s"] is None
    base = {"method": "hf-assisted", "category": "code", "repeat": 0, "identical": True}
    untimed = {**alone, **base, "question_id": 1}  # 3 of 4 proposals kept
    timed = {**alone, **base, "question_id": 2, "decode_s": 2.0, "tokens_per_s": 2.0, "accepted": 1,
             "draft_s": 0.4, "verify_s": 1.6}  # 1 of 4 kept
    plain = [{"method": "none", "category": "code", "repeat": 0, "question_id": q, "new_tokens": 4, "decode_s": 4.0,
              "target_forwards": 4, "identical": True} for q in (1, 2)]
    row = next(r for r in summarize([untimed, timed, *plain]) if (r["method"], r["category"]) == ("hf-assisted", "all"))
    # Every figure of the row is the timed prompt's alone: its tokens/s, its acceptance, and a c (a sum of draft
    # seconds over both prompts would have none).
    assert row["prompts"] == 1 and row["tokens_per_s"] == pytest.approx(2.0)
    assert row["acceptance_rate"] == pytest.approx(0.25)
    assert row["cost_ratio"] == pytest.approx((0.4 / 4) / (4.0 / 4))


@pytest.mark.parametrize("method", ["hf-plain", "hf-assisted", "hf-lookup"])
def test_peer_step_marks_follow_generate_steps(method):
    target, tokenizer, draft = _models(draft_seed=1)
    runners = Runners(target, tokenizer, draft)
    seen = []
    real = runner_module._peer_record
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "_peer_record", lambda *args: seen.append(args) or real(*args))
        record, token_ids = runners.run(method, [1, 2, 3, 4, 5], N)
    _, _, marks, target_calls, draft_calls = seen[0]
    # One mark a step, the first after the prompt's prefill; the text grows every step, to prompt + N.
    lengths = [m.length for m in marks]
    assert lengths[0] >= 6 and lengths[-1] == 5 + N and lengths == sorted(set(lengths))
    # One target pass a step, and no other marks: the assistant's own generate adds none.
    assert [m.target_calls for m in marks] == list(range(1, len(target_calls) + 1))
    assert marks[-1].draft_calls == len(draft_calls)
    if method == "hf-plain":
        assert lengths == list(range(6, 6 + N))
    assert len(token_ids) == N and record["target_forwards"] == len(marks)


def test_peers_decode_greedily_whatever_the_models_generation_configs_add(tmp_path, prompts_file):
    # A generation_config.json may carry processors ours do not apply: the peers leave them out too, or their
    # text (and cost a step) would not be the target's plain greedy one.
    target, tokenizer, draft = tiny_model("llama", seed=0), tiny_tokenizer(), tiny_model("llama", seed=1)
    for model in (target, draft):
        model.generation_config.repetition_penalty = 3.0
        model.generation_config.no_repeat_ngram_size = 1
    res = run_bench(_config(tmp_path, prompts_file, methods=("none", "hf-plain", "hf-lookup", "hf-assisted"),
                            repeats=1, roofline=False), models=(target, tokenizer, draft))
    assert all(r["identical"] for r in res["runs"])
    assert [m.generation_config.repetition_penalty for m in (target, draft)] == [3.0, 3.0]  # given back


def test_the_code_is_named_by_its_commit_in_a_checkout_and_by_its_digest_elsewhere(tmp_path, monkeypatch):
    from draftwise.bench import journal

    package = tmp_path / "draftwise"
    package.mkdir()
    (package / "engine.py").write_text("x = 1\n")
    monkeypatch.setattr(journal, "files", lambda name: package)
    assert journal.code_version().startswith("draftwise sources sha256 ")  # not a checkout
    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True)
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "empty")
    git("add", "draftwise")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code")
    commit = git("rev-parse", "--short", "HEAD").stdout.strip()
    assert journal.code_version() == commit
    (package / "engine.py").write_text("x = 2\n")
    assert journal.code_version() == f"{commit} with local changes to draftwise/"


def test_ours_run_a_prompt_with_a_schema_under_it_and_transformers_refuse_it():
    target, tokenizer, draft = _models(draft_seed=1)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    prompt = tokenizer("The quick brown fox")["input_ids"]
    outputs = {}
    for jump_forward in (True, False):
        runners = Runners(target, tokenizer, draft, jump_forward=jump_forward)
        for method in ("none", "draft"):
            record, outputs[method, jump_forward] = runners.run(method, prompt, 60, schema)
            assert record["new_tokens"] == len(outputs[method, jump_forward])
    assert len(set(map(tuple, outputs.values()))) == 1  # the target alone under the schema, whichever ran
    text = tokenizer.decode(outputs["none", True], skip_special_tokens=True)
    assert json.loads(text)["n"] in (1, 2, 3)  # ended at the schema's end, not at 60 tokens
    with pytest.raises(DraftwiseError, match="hf-plain cannot run a prompt with a schema"):
        runners.run("hf-plain", prompt, 8, schema)
