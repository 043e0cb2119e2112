"""Interleaved A/B of two checkouts of draftwise: the same prompts, methods and models, one worker process per
checkout, runs alternating between them so that a slow spell of the machine falls on both.

Why two processes: a change to the library cannot be compared with itself in one interpreter, and two runs one
after the other would compare the machine's moods as much as the code. Each worker loads the models once through
the public API only (Engine.from_pretrained, generate), so any checkout old or new can serve as either arm.

Reported per method: each arm's median decode tokens/s over the prompts, the geometric mean of the per-prompt
ratio B/A of median tokens/s with a bootstrap 95% interval, and how many prompts gave the same token ids in both
arms and the same as `none` within each arm.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The worker speaks JSON lines on stdin/stdout and touches nothing but the public API.
WORKER = r"""
import json, sys
from draftwise import Engine
spec = json.loads(sys.stdin.readline())
engine = Engine.from_pretrained(target=spec["target"], draft=spec["draft"], method=spec["method"],
                                dtype=spec["dtype"], backend=spec.get("backend", "hf"), progress=False)
print(json.dumps({"ready": True, "speed_paths": engine.speed_paths}, default=str), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    result = engine.generate(job["prompt"], chat=True, method=job["method"], max_new_tokens=job["max_new_tokens"],
                             num_draft_tokens=job["k"], ignore_eos=True)
    s = result.stats
    print(json.dumps({"tokens_per_s": s.tokens_per_s, "token_ids": result.token_ids, "accepted": s.accepted,
                      "proposed": s.proposed}), flush=True)
"""


@dataclass(frozen=True)
class ArmRun:
    tokens_per_s: float
    token_ids: tuple[int, ...]


class Worker:
    """One checkout's engine in its own process."""

    def __init__(self, checkout: Path, spec: dict):
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=checkout, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send(spec)
        ready = self._receive()
        if not ready.get("ready"):
            raise RuntimeError(f"the worker for {checkout} did not start")
        self.speed_paths = ready.get("speed_paths", {})  # what its load chose (dtype, kernels): a timed choice

    def run(self, prompt: str, method: str, max_new_tokens: int, k: int) -> ArmRun:
        self._send({"prompt": prompt, "method": method, "max_new_tokens": max_new_tokens, "k": k})
        out = self._receive()
        return ArmRun(out["tokens_per_s"], tuple(out["token_ids"]))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker exited (code {self.proc.wait()})")
        return json.loads(line)


def geo_mean_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of ratios and a bootstrap 95% interval over the prompts."""
    rng = random.Random(seed)
    means = sorted(statistics.geometric_mean(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.geometric_mean(ratios), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def run_ab(arms: dict[str, Worker], prompts: list[str], methods: list[str], repeats: int, max_new_tokens: int,
           k: int, log=print) -> dict:
    """{(arm, method, prompt index): [ArmRun, ...]}, every (method, prompt) run on each arm in turn, the order
    flipped every time so that neither arm always runs first."""
    names = list(arms)
    runs: dict[tuple[str, str, int], list[ArmRun]] = {}
    turn = 0
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            for method in methods:
                order = names if turn % 2 == 0 else names[::-1]
                turn += 1
                for name in order:
                    runs.setdefault((name, method, i), []).append(
                        arms[name].run(prompt, method, max_new_tokens, k))
        log(f"repeat {rep + 1} of {repeats} done")
    return runs


def summarize(runs: dict, names: list[str], methods: list[str], n_prompts: int) -> list[dict]:
    """One row per method: median tokens/s of each arm, B/A with its interval, identical outputs."""
    a, b = names
    median = lambda arm, m, i: statistics.median(r.tokens_per_s for r in runs[(arm, m, i)])
    ids = lambda arm, m, i: runs[(arm, m, i)][0].token_ids
    rows = []
    for m in methods:
        ratios = [median(b, m, i) / median(a, m, i) for i in range(n_prompts)]
        mean, low, high = geo_mean_interval(ratios)
        row = {"method": m, f"{a}_tok_s": statistics.median(median(a, m, i) for i in range(n_prompts)),
               f"{b}_tok_s": statistics.median(median(b, m, i) for i in range(n_prompts)),
               "ratio": mean, "ratio_low": low, "ratio_high": high,
               "same_in_both": sum(ids(a, m, i) == ids(b, m, i) for i in range(n_prompts))}
        if "none" in methods:
            for arm in names:
                row[f"{arm}_same_as_none"] = sum(ids(arm, m, i) == ids(arm, "none", i) for i in range(n_prompts))
        rows.append(row)
    return rows


def format_rows(rows: list[dict], names: list[str], n_prompts: int) -> str:
    a, b = names
    lines = [f"| method | {a} tok/s | {b} tok/s | {b}/{a} (95% interval) | same ids in both | same as none ({a}, {b}) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        same_none = (f"{r.get(f'{a}_same_as_none', '-')}/{n_prompts}, {r.get(f'{b}_same_as_none', '-')}/{n_prompts}")
        lines.append(f"| {r['method']} | {r[f'{a}_tok_s']:.1f} | {r[f'{b}_tok_s']:.1f} | {r['ratio']:.3f} "
                     f"({r['ratio_low']:.3f}-{r['ratio_high']:.3f}) | {r['same_in_both']}/{n_prompts} | {same_none} |")
    return "\n".join(lines)
