"""The bench's journal: each finished prompt's runs, kept on disk while the bench is under way, so that
`draftwise bench --resume` after a crash or a killed session runs only the prompts that had not finished.

A prompt is the unit: its line is written only once every method has run it every repeat, so the ratios
between methods on one prompt always come from one process, interleaved, on the same machine state. A
prompt cut short is run again whole. The first line names the settings; a journal written by other settings
or other code is refused rather than mixed in. results.json replaces the journal when the bench completes.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from draftwise.bench.summary import prompt_key
from draftwise.errors import DraftwiseError

JOURNAL_NAME = "runs.jsonl"
# Settings that do not change what a run measures: where it is written, how it is shown, whether it resumes,
# and the roofline, which is measured again at the end of every bench.
NOT_MEASURED = ("out", "progress", "roofline", "resume", "chosen_by_auto")


def settings_of(configs: Sequence, prompts: Sequence, machine: str, models: dict) -> dict:
    """What a run's numbers depend on: the bench's settings, the exact prompts, the code that ran them, the machine
    (processor, threads, torch and transformers: run.machine_description) and the model files (run.model_files)."""
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(configs[0]).items() if k not in NOT_MEASURED and k != "dtype"}
    settings["methods"] = list(settings["methods"])
    settings["dtypes"] = [cfg.dtype for cfg in configs]
    text = json.dumps([[p.category, p.question_id, p.text] for p in prompts])
    settings["prompts_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    settings["code_sha256"] = _code_digest()
    settings["machine"], settings["models"] = machine, models
    return settings


def code_version() -> str:
    """The code a bench ran, for its report (a figure is only as good as knowing which code printed it): the git
    commit of a checkout, marked where draftwise's sources differ from it, else the digest of those sources."""
    package = Path(str(files("draftwise")))
    root = package.parent
    if (root / ".git").exists():  # (a checkout; a .git file in a worktree)
        try:
            commit = _git(root, "rev-parse", "--short", "HEAD")
            changed = _git(root, "status", "--porcelain", "--", package.name)
            return commit + (" with local changes to draftwise/" if changed else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return f"draftwise sources sha256 {_code_digest()[:16]}"


def _git(root: Path, *args: str) -> str:
    """git on the checkout at root (never one an inherited GIT_DIR or GIT_WORK_TREE names)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("GIT_")}
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=True,
                          env=env).stdout.strip()


def _code_digest() -> str:
    """SHA-256 over draftwise's own sources: a journal from other code measured something else."""
    digest = hashlib.sha256()
    package = files("draftwise")
    for path in sorted(Path(str(package)).rglob("*.py")):
        digest.update(path.relative_to(str(package)).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class Journal:
    """Append-only record of finished prompts under an --out folder."""

    def __init__(self, path: Path, finished: dict[tuple, list[dict]]):
        self.path = path
        self.finished = finished  # {(dtype, category, question_id): that prompt's runs}

    @classmethod
    def open(cls, out: Path, settings: dict, resume: bool) -> Journal:
        """Resume: keep the finished prompts of a journal with the same settings (none if there is no journal).
        Otherwise start a fresh journal, replacing any earlier one."""
        path = out / JOURNAL_NAME
        finished = read_finished(out, settings) if resume else {}
        # Written afresh either way: a line a crash cut off must not run into the next one appended.
        lines = [{"settings": settings}, *({"dtype": key[0], "runs": runs} for key, runs in finished.items())]
        partial = path.with_suffix(".partial")
        with partial.open("w") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())  # on disk before it replaces the journal: a power cut must not leave it empty
        partial.replace(path)
        return cls(path, finished)

    def runs_of(self, dtype: str, run_key: tuple) -> list[dict] | None:
        """The journaled runs of one prompt (run_key as summary.prompt_key gives it) in dtype, or None."""
        return self.finished.get((dtype, *run_key))

    def record(self, dtype: str, runs: list[dict]) -> None:
        """Append one finished prompt's runs; flushed to disk so a crash right after keeps them."""
        with self.path.open("a") as f:
            f.write(json.dumps({"dtype": dtype, "runs": runs}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        """The bench completed and results.json holds every run: the journal has done its job."""
        self.path.unlink(missing_ok=True)


def read_finished(out: Path, settings: dict) -> dict[tuple, list[dict]]:
    """The finished prompts of the journal under out ({} if there is none); other settings fail clearly."""
    path = out / JOURNAL_NAME
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0])["settings"] if lines else None
    except (json.JSONDecodeError, KeyError, TypeError):
        header = None
    if header != settings:
        differs = sorted(k for k in set(settings) | set(header or {}) if (header or {}).get(k) != settings.get(k))
        raise DraftwiseError(
            f"--resume: {path} was written by a bench with other settings or code (differs in: "
            f"{', '.join(differs)}); give the options it ran with, or run without --resume to start over")
    finished = {}
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            runs = entry["runs"]
            finished[(entry["dtype"], *prompt_key(runs[0]))] = runs
        except (json.JSONDecodeError, KeyError, TypeError, IndexError):
            continue  # the line a crash cut off (or one that is not an entry): that prompt runs again
    return finished
