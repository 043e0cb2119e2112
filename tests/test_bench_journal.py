"""draftwise bench --resume: a bench cut short keeps its finished prompts, and resuming runs only the rest.

Tiny models; what is checked is which runs happen and what results.json holds, never speed.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import tiny_model, tiny_tokenizer

from draftwise import cli
from draftwise.bench import command
from draftwise.bench.journal import JOURNAL_NAME
from draftwise.bench.run import BenchConfig, run_bench
from draftwise.bench.runners import Runners
from draftwise.errors import DraftwiseError

N = 6
METHODS = ("none", "lookup")
REPEATS = 2
PER_PROMPT = len(METHODS) * REPEATS
PROMPTS = [
    {"question_id": 1, "category": "prose", "turns": ["The quick brown fox jumps over the lazy dog."]},
    {"question_id": 2, "category": "code", "turns": ["def quicksort(arr):\n    if len(arr) <= 1:"]},
    {"question_id": 3, "category": "prose", "turns": ["Summaries copy spans of the article."]},
    {"question_id": 4, "category": "code", "turns": ["for i in range(10):\n    print(i"]},
]
MODELS = (tiny_model("llama", seed=0), tiny_tokenizer(), None)


class Interrupted(Exception):
    """Stands for the crash or killed session that --resume recovers from."""


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


@pytest.fixture
def timed_runs(monkeypatch):
    """The timed runs, as (question_id, method); fail_after: interrupt the bench when that many have run."""
    calls, real_run = [], Runners.run
    state = {"fail_after": None}

    def run(self, method, prompt_ids, max_new_tokens, schema=None):
        if max_new_tokens == N:  # not the warm-up
            if state["fail_after"] is not None and len(calls) == state["fail_after"]:
                raise Interrupted
            calls.append(method)
        return real_run(self, method, prompt_ids, max_new_tokens)

    monkeypatch.setattr(Runners, "run", run)
    return calls, state


def _config(tmp_path, prompts_file, **overrides) -> BenchConfig:
    options = dict(target="tiny", prompts_file=str(prompts_file), per_category=None, methods=METHODS,
                   max_new_tokens=N, repeats=REPEATS, out=str(tmp_path / "out"), progress=False, roofline=False)
    return BenchConfig(**{**options, **overrides})


def _interrupt(tmp_path, prompts_file, timed_runs, after: int, **overrides) -> None:
    """Run the bench until `after` timed runs have happened, then interrupt it."""
    calls, state = timed_runs
    state["fail_after"] = after
    with pytest.raises(Interrupted):
        run_bench(_config(tmp_path, prompts_file, **overrides), models=MODELS)
    state["fail_after"] = None
    calls.clear()


def test_resume_runs_only_the_prompts_that_had_not_finished(tmp_path, prompts_file, timed_runs):
    calls, _ = timed_runs
    # Two prompts finished, the third cut off halfway through its runs.
    _interrupt(tmp_path, prompts_file, timed_runs, after=2 * PER_PROMPT + PER_PROMPT // 2)
    journal = tmp_path / "out" / JOURNAL_NAME
    assert len(journal.read_text().splitlines()) == 1 + 2  # the settings, then one line per finished prompt

    res = run_bench(_config(tmp_path, prompts_file, resume=True), models=MODELS)
    # The cut-off prompt runs again whole, so its methods are compared within one process.
    assert len(calls) == 2 * PER_PROMPT
    assert len(res["runs"]) == len(PROMPTS) * PER_PROMPT
    assert [r["question_id"] for r in res["runs"][::PER_PROMPT]] == [1, 2, 3, 4]
    assert all(r["identical"] for r in res["runs"])
    assert res["meta"]["resumed_prompts"] == {"float32": 2}
    assert "Resumed (--resume): the runs of 2 of 4 in float32 prompts" in (tmp_path / "out" / "report.md").read_text()
    assert not journal.exists()  # results.json holds every run now


def test_without_resume_a_bench_starts_over(tmp_path, prompts_file, timed_runs):
    calls, _ = timed_runs
    _interrupt(tmp_path, prompts_file, timed_runs, after=PER_PROMPT)
    res = run_bench(_config(tmp_path, prompts_file), models=MODELS)
    assert len(calls) == len(PROMPTS) * PER_PROMPT
    assert res["meta"]["resumed_prompts"] == {"float32": 0}


def test_resume_with_no_journal_runs_everything(tmp_path, prompts_file, timed_runs):
    calls, _ = timed_runs
    run_bench(_config(tmp_path, prompts_file, resume=True), models=MODELS)
    assert len(calls) == len(PROMPTS) * PER_PROMPT


def test_a_line_cut_off_by_a_crash_runs_again_and_the_journal_stays_readable(tmp_path, prompts_file, timed_runs):
    calls, _ = timed_runs
    _interrupt(tmp_path, prompts_file, timed_runs, after=2 * PER_PROMPT)
    journal = tmp_path / "out" / JOURNAL_NAME
    text = journal.read_text()
    journal.write_text(text[: len(text) - 40])  # the second prompt's line, torn mid-write

    # Resumes, runs prompt 2 again and finishes it, then stops.
    _interrupt(tmp_path, prompts_file, timed_runs, after=PER_PROMPT, resume=True)
    lines = journal.read_text().splitlines()
    assert [json.loads(line)["runs"][0]["question_id"] for line in lines[1:]] == [1, 2]

    res = run_bench(_config(tmp_path, prompts_file, resume=True), models=MODELS)
    assert len(calls) == 2 * PER_PROMPT and res["meta"]["resumed_prompts"] == {"float32": 2}


def test_a_line_that_is_not_an_entry_runs_its_prompt_again(tmp_path, prompts_file, timed_runs):
    calls, _ = timed_runs
    _interrupt(tmp_path, prompts_file, timed_runs, after=PER_PROMPT)
    journal = tmp_path / "out" / JOURNAL_NAME
    journal.write_text(journal.read_text() + '{"dtype": "float32"}\n{"runs": []}\n')  # parse, but hold no runs
    res = run_bench(_config(tmp_path, prompts_file, resume=True), models=MODELS)
    assert res["meta"]["resumed_prompts"] == {"float32": 1}


def test_resume_refuses_a_journal_of_another_machine_or_model_files(tmp_path, prompts_file, timed_runs,
                                                                     monkeypatch):
    _interrupt(tmp_path, prompts_file, timed_runs, after=PER_PROMPT)
    monkeypatch.setattr("draftwise.bench.run.machine_description", lambda: "another machine")
    with pytest.raises(DraftwiseError, match=r"differs in: machine\)"):
        run_bench(_config(tmp_path, prompts_file, resume=True), models=MODELS)
    monkeypatch.undo()
    target = tmp_path / "my-model"  # a local folder, retrained between the crash and the resume
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"old")
    cfg = _config(tmp_path / "local", prompts_file)
    from draftwise.bench.run import model_files

    before = model_files(replace(cfg, target=str(target)))
    (target / "model.safetensors").write_bytes(b"newer")
    after = model_files(replace(cfg, target=str(target)))
    assert before["target"] != after["target"] and before["target"][0][:2] == ["model.safetensors", 3]
    assert model_files(replace(cfg, target="qwen2.5-coder-1.5b-instruct"))["target"] is None  # the store's: by name


def test_resume_refuses_a_journal_of_other_settings(tmp_path, prompts_file, timed_runs):
    _interrupt(tmp_path, prompts_file, timed_runs, after=PER_PROMPT)
    with pytest.raises(DraftwiseError, match=r"other settings or code \(differs in: max_new_tokens\)"):
        run_bench(_config(tmp_path, prompts_file, resume=True, max_new_tokens=N + 1), models=MODELS)
    # What was refused is kept: resuming with the first settings still finds the finished prompt.
    assert len((tmp_path / "out" / JOURNAL_NAME).read_text().splitlines()) == 2


def _cli_bench(prompts_file, out, methods, *extra):
    return cli.main(["bench", "--prompts", str(prompts_file), "--methods", methods, "--repeats", str(REPEATS),
                     "--max-new-tokens", str(N), "--dtype", "float32", "--out", str(out), "--no-roofline", "-q",
                     *extra])


def test_cli_resume_fails_on_other_settings_before_loading(tmp_path, prompts_file, timed_runs, monkeypatch, capsys):
    calls, state = timed_runs
    loads = []
    monkeypatch.setattr(command, "load_bench_models", lambda cfg: loads.append(cfg) or MODELS)
    state["fail_after"] = PER_PROMPT
    with pytest.raises(Interrupted):
        _cli_bench(prompts_file, tmp_path / "out", ",".join(METHODS))
    state["fail_after"] = None
    loads.clear()

    assert _cli_bench(prompts_file, tmp_path / "out", "none", "--resume") == 1
    assert "was written by a bench with other settings or code (differs in: methods)" in capsys.readouterr().err
    assert loads == []
    # The same options resume it.
    assert _cli_bench(prompts_file, tmp_path / "out", ",".join(METHODS), "--resume") == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["meta"]["resumed_prompts"] == {"float32": 1} and len(results["runs"]) == len(PROMPTS) * PER_PROMPT
