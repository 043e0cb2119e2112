"""The A/B of two checkouts (bench/ab.py): the worker protocol against fake checkouts, and the summary's arithmetic."""
from __future__ import annotations

import textwrap

import pytest

from draftwise.bench.ab import ArmRun, Worker, format_rows, geo_mean_interval, run_ab, summarize

# A checkout whose draftwise is a stand-in Engine: tokens/s set by the checkout, ids = the prompt's length + method.
FAKE_PACKAGE = '''
from types import SimpleNamespace

SPEED = {speed}

class Engine:
    speed_paths = {{"dtype": "float32"}}

    @classmethod
    def from_pretrained(cls, **options):
        assert options["method"] == "draft", options
        return cls()

    def generate(self, prompt, *, chat, method, max_new_tokens, num_draft_tokens, ignore_eos):
        ids = [len(prompt)] * max_new_tokens if method == "none" else [len(prompt) + {shift}] * max_new_tokens
        return SimpleNamespace(token_ids=ids, stats=SimpleNamespace(tokens_per_s=SPEED, accepted=1, proposed=2))
'''


def fake_checkout(tmp_path, name: str, speed: float, shift: int = 0):
    root = tmp_path / name
    (root / "draftwise").mkdir(parents=True)
    (root / "draftwise" / "__init__.py").write_text(textwrap.dedent(FAKE_PACKAGE.format(speed=speed, shift=shift)))
    return root


SPEC = {"target": "t", "draft": "d", "method": "draft", "dtype": "auto"}


def test_two_checkouts_are_run_in_turn_and_compared(tmp_path):
    arms = {"A": Worker(fake_checkout(tmp_path, "a", 10.0), SPEC),
            "B": Worker(fake_checkout(tmp_path, "b", 12.0, shift=1), SPEC)}
    try:
        assert arms["A"].speed_paths == {"dtype": "float32"}
        runs = run_ab(arms, ["one", "three"], ["none", "draft"], repeats=2, max_new_tokens=3, k=4, log=lambda _: None)
    finally:
        for arm in arms.values():
            arm.close()
    assert len(runs[("A", "none", 0)]) == 2 and len(runs[("B", "draft", 1)]) == 2
    rows = {r["method"]: r for r in summarize(runs, ["A", "B"], ["none", "draft"], 2)}
    assert rows["none"]["A_tok_s"] == 10.0 and rows["none"]["B_tok_s"] == 12.0
    assert rows["none"]["ratio"] == pytest.approx(1.2)
    assert rows["none"]["same_in_both"] == 2  # none's ids are the prompt's alone in both
    assert rows["draft"]["same_in_both"] == 0  # B's draft shifts its ids: a difference is counted, not hidden
    assert rows["draft"]["A_same_as_none"] == 2 and rows["draft"]["B_same_as_none"] == 0
    assert "| draft | 10.0 | 12.0 | 1.200" in format_rows(list(rows.values()), ["A", "B"], 2)


def test_a_worker_that_cannot_start_says_so(tmp_path):
    broken = tmp_path / "broken" / "draftwise"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no engine here')\n")
    with pytest.raises(RuntimeError, match="exited"):
        Worker(broken.parent, SPEC)


def test_the_interval_brackets_the_geometric_mean_and_is_a_point_without_spread():
    mean, low, high = geo_mean_interval([0.9, 1.0, 1.1, 1.2])
    assert low <= mean <= high and low < high
    assert geo_mean_interval([1.05] * 5) == pytest.approx((1.05, 1.05, 1.05))


def test_arm_runs_keep_ids_as_tuples_for_comparison():
    assert ArmRun(1.0, (1, 2)) == ArmRun(1.0, (1, 2))
