"""Served throughput against llama.cpp's llama-server: the same prompts, sampled at one temperature, at a few
concurrencies, driven by loadgen against each server in turn, one table of aggregate tok/s and the ratios.

Each arm is a server started on 127.0.0.1, measured, and stopped before the next starts (two on 2 cores would
measure each other). The arms run one after another, so a shared machine's drift between them lands in the
ratios: run it on a quiet machine, and again to see how far it moves.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from draftwise.bench.llamacpp_server import LlamaServer, ServerSpec, free_port, stop_process
from draftwise.bench.load_plan import LoadPlan
from draftwise.bench.load_report import fmt, write_results
from draftwise.bench.load_stats import summarise
from draftwise.bench.loadgen import run_load
from draftwise.errors import DraftwiseError

SLOTS = 4  # llama-server's -np and draftwise's --max-batch: the most requests decoded together
SPEC_TYPES = "ngram-mod,draft-simple"  # llama.cpp's n-gram drafts where they match, the draft model elsewhere
START_TIMEOUT_S = 600.0  # draftwise compiles its kernel on first use and loads two models: minutes on 2 cores


@dataclass(frozen=True)
class Arm:
    """One server to measure: `name` in the table; `start` returns a running server with .url and .close()."""

    name: str
    start: object  # () -> a started server


def llama_arms(target: Path, draft: Path, context: int = 8192) -> list[Arm]:
    """llama-server with the draft loaded (its n-gram drafts first, the draft model elsewhere), and plain."""
    spec = ServerSpec(target, context=context, slots=SLOTS, prompt_cache=True)
    drafted = replace(spec, draft=draft, spec_type=SPEC_TYPES)
    return [Arm(f"llama-server -md, {SPEC_TYPES}", lambda: _started(LlamaServer(drafted))),
            Arm("llama-server plain", lambda: _started(LlamaServer(spec)))]


def _started(server: LlamaServer) -> LlamaServer:
    server.start()
    return server


def draftwise_arm(target: str, draft: str, method: str = "hybrid", backend: str = "quant") -> Arm:
    argv = ["--target", target, "--draft", draft, "--method", method, "--backend", backend,
            "--max-batch", str(SLOTS)]
    return Arm(f"draftwise serve --method {method}", lambda: DraftwiseServer(argv).start())


class DraftwiseServer:
    """`draftwise serve` in a child process on a free loopback port, its output in a log; close() drains it."""

    def __init__(self, argv: list[str], host: str = "127.0.0.1"):
        self.argv, self.host, self.port = argv, host, free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="draftwise-serve-", suffix=".log", delete=False)
        self._process: subprocess.Popen | None = None

    def start(self) -> DraftwiseServer:
        command = [sys.executable, "-m", "draftwise", "serve", *self.argv, "--host", self.host,
                   "--port", str(self.port)]
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self._process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.close()
                raise DraftwiseError(f"draftwise serve did not become ready on {self.url}:\n{tail}")
            time.sleep(0.5)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        stop_process(self._process, grace_s=30)  # drains: nothing is running by now
        self._process = None
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def run_arms(arms: list[Arm], plan: LoadPlan, out: Path, log=print) -> dict[str, list[dict]]:
    """Each arm in turn: start it, run the plan against it (loadgen's results under out/<n>), stop it. The
    summary rows by arm name; an arm that fails stops the comparison with what ran kept on disk."""
    rows: dict[str, list[dict]] = {}
    for n, arm in enumerate(arms):
        log(f"compare: starting {arm.name}")
        server = arm.start()
        try:
            records: list = []
            found: dict = {}
            asyncio.run(run_load(replace(plan, url=server.url), records=records, found=found))
            rows[arm.name] = summarise(records)
            write_results(out / f"arm{n}", replace(plan, url=server.url), records, rows[arm.name],
                          command=f"(served_compare) {arm.name}", server=found.get("server"))
        finally:
            server.close()
    return rows


def comparison_table(rows: dict[str, list[dict]], ours: str) -> str:
    """Aggregate tok/s of each arm per concurrency, and `ours` over each other arm."""
    names = list(rows)
    others = [n for n in names if n != ours]
    rate = {(n, r["concurrency"]): r["tokens_per_s"] for n in names for r in rows[n]}
    failed = {(n, r["concurrency"]): r["failed"] for n in names for r in rows[n]}
    levels = sorted({level for _, level in rate})
    head = ["concurrency", *(f"{n} tok/s" for n in names), *(f"{ours} / {n}" for n in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for level in levels:
        cells = [str(level)]
        for n in names:
            lost = failed.get((n, level))
            cells.append(fmt(rate.get((n, level)), 1) + (f" ({lost} failed)" if lost else ""))
        for n in others:
            mine, theirs = rate.get((ours, level)), rate.get((n, level))
            cells.append(f"{mine / theirs:.2f}x" if mine is not None and theirs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
