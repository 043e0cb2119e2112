"""`make loop`: the closed loop in one command, on a simulated service's traffic.

It serves the default pair with a proposal log, plays the earlier traffic (a code assistant over the third-party
packages installed here, or with --service docs a documentation assistant over their READMEs: `draftwise traffic`),
distills a draft version from the log, puts it on trial without a restart (`POST /admin/drafts`), then on the later
traffic (other packages: no file in common) measures both drafts in the one server, interleaved and repeated
(`draftwise loadgen --methods M,M:NAME@vN`), and plays that traffic until the trial decides. It prints, before and
after: the draft's agreement with the target on the later traffic (the share of the target's tokens the draft's
greedy choice matches, teacher-forced), the acceptance the server reported and the tokens/s of each method, and the
trial's decision with its reason.

Everything goes through draftwise's own commands and routes, as a user would run them; the work folder keeps every
step's output (loop.json, loop.md, the logs and loadgen reports).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from draftwise.config import DEFAULT_DRAFT_TOKENS as CHAIN  # draft tokens a round, where guesses kept are counted
from draftwise.train.traffic import SERVICES

DRAFTWISE = [sys.executable, "-m", "draftwise"]
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--work", default="loop-run", metavar="DIR", help="the work folder (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=400, metavar="N",
                        help="simulated requests in all, a quarter of them the later traffic (default: %(default)s)")
    parser.add_argument("--service", choices=sorted(SERVICES), default="code",
                        help="the simulated service (`draftwise traffic --service`; default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N", help="per request (default: %(default)s)")
    parser.add_argument("--train-concurrency", type=int, default=8, metavar="N",
                        help="requests in flight while the earlier traffic plays (default: %(default)s)")
    parser.add_argument("--methods", default="lookup,draft,hybrid", metavar="M,...",
                        help="measured on the later traffic; those that draft with the draft model run with each "
                             "draft (default: %(default)s)")
    parser.add_argument("--measure-per-kind", type=int, default=3, metavar="N",
                        help="later requests of each kind in the interleaved measurement (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, metavar="N", help="of the measurement (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8766, help="(default: %(default)s)")
    parser.add_argument("--backend", default="auto", help="the server's backend (default: %(default)s)")
    parser.add_argument("--capture-features", action="store_true",
                        help="the server also keeps the target's features (WORK/captured), for draftwise train-head "
                             "--captured")
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    loop = Loop(work, args)
    try:
        report = loop.run()
    finally:
        loop.stop_server()
    (work / "loop.json").write_text(json.dumps(report, indent=1))
    (work / "loop.md").write_text(markdown(report))
    print(markdown(report))
    return 0


class Loop:
    def __init__(self, work: Path, args: argparse.Namespace):
        self.work, self.args = work, args
        self.url = f"http://127.0.0.1:{args.port}"
        self.key = secrets.token_hex(16)
        self.server: subprocess.Popen | None = None
        self.started = time.time()

    def run(self) -> dict:
        a = self.args
        earlier = self.work / "traffic" / "train.jsonl"
        step("1/6 the simulated traffic")
        if earlier.is_file():  # (a rerun goes on from what an earlier one left: the same traffic, its log)
            print(f"{earlier.parent}: kept from an earlier run", file=sys.stderr)
        else:
            cli("traffic", "--out", self.work / "traffic", "--requests", a.requests, "--service", a.service)
        step("2/6 the server, with a proposal log")
        self.start_server()
        step(f"3/6 the earlier traffic, played in order, {a.train_concurrency} requests at a time")
        if self.logged() >= count_lines(earlier):
            print(f"{self.log}: holds the earlier traffic from an earlier run", file=sys.stderr)
        else:
            self.play(earlier, "played-train", "--speculation", "on", "--concurrency", a.train_concurrency)
        step("4/6 distill a draft version from the log")
        distilled = json.loads(cli("distill", self.log, "--draft", DRAFT, "--target", TARGET, "--json",
                                   capture=True).strip().splitlines()[-1])
        version = distilled["version"]
        report = self.keep({"target": TARGET, "draft": DRAFT, "version": version, "backend": a.backend,
                            "distill": {k: distilled[k] for k in ("agreement_before", "agreement_after",
                                                                  "kept_before", "kept_after",
                                                                  "held_out_tokens", "steps", "train_s",
                                                                  "trained_on", "held_out", "recipe")}})
        step(f"5/6 {version} on trial beside {DRAFT}; both measured on the later traffic, interleaved")
        self.put_on_trial(version)
        later_from = time.time()
        self.keep(report, measured=self.measure(version))
        self.keep(report, later_agreement=self.later_agreement(version, later_from))
        step("6/6 the later traffic, left to the server, until the trial decides")
        return self.keep(report, trial=self.until_decided(), minutes=round((time.time() - self.started) / 60, 1))

    def keep(self, report: dict, **results) -> dict:
        """report with results added, written to WORK/partial.json: a run stopped part way keeps what it measured."""
        report.update(results)
        (self.work / "partial.json").write_text(json.dumps(report, indent=1))
        return report

    @property
    def log(self) -> Path:
        return self.work / "traffic.db"

    def logged(self) -> int:
        from draftwise.train.served import served_requests

        return len(served_requests([self.log])) if self.log.is_file() else 0

    def start_server(self) -> None:
        a = self.args
        command = [*DRAFTWISE, "serve", "--target", TARGET, "--draft", DRAFT, "--method", "hybrid",
                   "--backend", a.backend, "--port", str(a.port), "--api-key", self.key,
                   "--proposal-log", str(self.log), "--prompt-cache-mb", "0"]
        if a.capture_features:
            command += ["--capture-features", str(self.work / "captured")]
        # (no prompt cache: the measurement's repeats and arms would otherwise prefill unequally)
        with open(self.work / "serve.log", "w") as out:
            self.server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.server.poll() is not None:
                raise SystemExit(f"the server stopped (exit {self.server.returncode}); see {self.work / 'serve.log'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise SystemExit(f"the server did not answer /health in 15 minutes; see {self.work / 'serve.log'}")

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)  # (a drain, as an operator's stop)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()

    def play(self, prompts: Path, name: str, *options, per_kind: int = 100_000) -> list[dict]:
        out = cli("loadgen", "--url", self.url, "--api-key", self.key, "--prompts", prompts,
                  "--per-category", per_kind, "--max-tokens", self.args.max_tokens, "--out", self.work / name,
                  "--json", *options, capture=True)
        return json.loads(out)

    def admin(self, method: str, body: dict | None = None) -> dict:
        response = httpx.request(method, f"{self.url}/admin/drafts", json=body, timeout=30,
                                 headers={"Authorization": f"Bearer {self.key}"})
        response.raise_for_status()
        return response.json()

    def put_on_trial(self, version: str) -> None:
        self.admin("POST", {"draft": version})
        while (trial := self.admin("GET")["trials"][-1])["state"] == "loading":
            time.sleep(1)
        if trial["state"] != "testing":
            raise SystemExit(f"the trial of {version} did not start: {trial}")

    def measure(self, version: str) -> list[dict]:
        """Each method, and each draft-model method with the version too, interleaved in the one server (requests
        that name their speculation are not the trial's samples)."""
        from draftwise.methods import DRAFT_MODEL, METHODS, methods_needing

        drafting = set(methods_needing(DRAFT_MODEL))
        methods = []
        for m in self.args.methods.split(","):
            if m not in METHODS:
                raise SystemExit(f"--methods: unknown method {m!r}")
            methods += [m, f"{m}:{version}"] if m in drafting else [m]
        rows = self.play(self.work / "traffic" / "eval.jsonl", "measured", "--methods", ",".join(methods),
                         "--speculation", "on", "--concurrency", "1", "--repeats", self.args.repeats,
                         per_kind=self.args.measure_per_kind)
        decode = decode_rates(json.loads((self.work / "measured" / "results.json").read_text())["requests"])
        return [{"method": r["method"], "tokens_per_s": r["tokens_per_s"], "low": r.get("tokens_per_s_low"),
                 "high": r.get("tokens_per_s_high"), "acceptance": r.get("acceptance"), **decode[r["method"]]}
                for r in rows]

    def later_agreement(self, version: str, since: float) -> dict:
        """Teacher-forced agreement of each draft with the target on the later requests the server logged."""
        from draftwise.loading import load_draft
        from draftwise.models import resolve
        from draftwise.train.distill import Recipe, agreement
        from draftwise.train.served import served_requests

        later = [s for s in served_requests([self.log]) if s.ts >= since]
        out = {"requests": len(later)}
        for name in (DRAFT, version):
            model = load_draft(resolve(name, progress=False), "float32", progress=False)
            measured = agreement(model, later, Recipe().seq_len)
            out[name] = {"agreement": measured.share, "kept": measured.kept_share, "tokens": measured.tokens}
            del model
        return out

    def until_decided(self, rounds: int = 6) -> dict:
        for _ in range(rounds):
            self.play(self.work / "traffic" / "eval.jsonl", "trial", "--speculation", "on", "--concurrency", "2")
            trial = self.admin("GET")["trials"][-1]
            if trial["state"] != "testing":
                return trial
        return self.admin("GET")["trials"][-1]


def count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def decode_rates(requests: list[dict]) -> dict[str, dict]:
    """Per method asked for: the decode tokens/s the server timed (its new tokens over its decode seconds, prefill
    apart), per repeat, and their median: what a draft changes, undiluted by the prompt's prefill."""
    runs: dict[str, dict[int, list[float]]] = {}
    for r in requests:
        stats = r.get("stats") or {}
        if r.get("error") is None and stats.get("decode_s"):
            cell = runs.setdefault(r["method"], {}).setdefault(r["repeat"], [0.0, 0.0])
            cell[0] += stats["new_tokens"]
            cell[1] += stats["decode_s"]
    out = {}
    for method, repeats in runs.items():
        rates = sorted(tokens / seconds for tokens, seconds in repeats.values())
        out[method] = {"decode_tokens_per_s": statistics.median(rates), "decode_runs": rates}
    return out


def cli(*argv, capture: bool = False) -> str:
    command = [*DRAFTWISE, *map(str, argv)]
    print("$ draftwise " + " ".join(map(str, argv)), file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE if capture else None, text=True, env=os.environ)
    if done.returncode != 0:
        raise SystemExit(f"draftwise {argv[0]} failed (exit {done.returncode})")
    return done.stdout or ""


def step(text: str) -> None:
    print(f"\n== {text}", file=sys.stderr, flush=True)


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def markdown(report: dict) -> str:
    d, later = report["distill"], report["later_agreement"]
    lines = [f"# The closed loop: {report['draft']} -> {report['version']} (target {report['target']})", "",
             f"Distilled in {d['train_s']:.0f} s ({d['steps']} steps) from {d['trained_on']['requests']} earlier "
             f"requests; on the latest {d['held_out']['requests']} of them (held out): agreement "
             f"{100 * d['agreement_before']:.1f}% -> {100 * d['agreement_after']:.1f}%, guesses kept in rounds of "
             f"{CHAIN} {percent(d.get('kept_before'))} -> {percent(d.get('kept_after'))}.", "",
             f"On the later traffic ({later['requests']} requests from other packages), teacher-forced agreement: "
             f"{percent(later[report['draft']]['agreement'])} -> {percent(later[report['version']]['agreement'])}, "
             f"guesses kept in rounds of {CHAIN} {percent(later[report['draft']].get('kept'))} -> "
             f"{percent(later[report['version']].get('kept'))}.",
             "", "| method | decode tok/s (runs) | aggregate tok/s (range) | acceptance |",
             "| --- | ---: | ---: | ---: |"]
    for row in report["measured"]:
        runs = ", ".join(f"{rate:.1f}" for rate in row.get("decode_runs", []))
        spread = f" ({row['low']:.1f}-{row['high']:.1f})" if row["low"] is not None else ""
        lines.append(f"| {row['method']} | {row.get('decode_tokens_per_s', 0):.1f} ({runs}) | "
                     f"{row['tokens_per_s']:.1f}{spread} | {percent(row['acceptance'])} |")
    trial = report["trial"]
    arms = "; ".join(f"{arm} {a['requests']} requests, {a['tokens_per_s']:.1f} tok/s a request, acceptance "
                     f"{percent(a['acceptance'])}" for arm, a in trial.get("arms", {}).items())
    lines += ["", f"Trial: **{trial['state']}**: {trial.get('reason') or '(no decision yet)'} ({arms})", "",
              f"{report['minutes']} minutes in all."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
