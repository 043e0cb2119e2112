"""Prefix-aware routing against power of two choices, on a multi-turn chat workload, on a local Ray cluster.

Each chat asks about a different source file of this repository (a long first turn), then asks two follow-ups.
Users take turns as in a busy service: every chat's first turn, in a shuffled order, `--concurrency` at a time,
then every chat's second, and so on; so a chat comes back to replicas whose load has moved on. (Were each chat's
turns sent back to back, power of two choices would send a next turn to the replica that had just finished the
last one, the less busy by one request: affinity by accident.) Each round deploys the replicas afresh
(cold prompt caches) with one routing policy; policies alternate, `--repeats` rounds each. Reported per policy:
time to first token of first and of later turns (median), the later turns' prompt-cache hits (the share whose
prompt was partly cached, and the tokens cached), and the round's aggregate tokens/s.

    python docs/experiments/tools/replica_routing.py --out /tmp/routing
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import ray
from ray import serve

from draftwise.cli import build_parser
from draftwise.serve.command import build_server
from draftwise.serve.replicas import APP_NAME, NAMESPACE, build_app, check_replica_options, start_board

REPO = Path(__file__).resolve().parents[3]
FOLLOW_UPS = ["What could go wrong in this code? One sentence.", "Name one test it needs. One sentence."]


def documents(count: int, chars: int) -> list[tuple[str, str]]:
    files = sorted((REPO / "draftwise").rglob("*.py"), key=lambda p: p.stat().st_size, reverse=True)
    return [(str(p.relative_to(REPO)), p.read_text()[:chars]) for p in files[:count]]


class Chat:
    """One user's conversation about one file: its messages so far."""

    def __init__(self, name: str, text: str):
        self.name = name
        self.messages = [{"role": "user", "content": f"Here is {name}:\n\n{text}\n\nWhat does this code do? Briefly."}]

    def turn(self, client, model: str, max_tokens: int, turn: int) -> dict:
        """Send the chat so far, stream the reply, add it and the next question to the chat."""
        began = time.perf_counter()
        first, reply, stats = None, "", {}
        with client.chat.completions.with_streaming_response.create(
                model=model, messages=self.messages, max_tokens=max_tokens, temperature=0, stream=True) as raw:
            replica = raw.headers.get("x-draftwise-replica")
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    reply += chunk.choices[0].delta.content
                stats = (chunk.model_extra or {}).get("draftwise") or stats
        self.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UPS[turn % 2]}]
        return {"chat": self.name, "turn": turn, "replica": replica, "ttft_s": (first or time.perf_counter()) - began,
                "e2e_s": time.perf_counter() - began, "prompt_tokens": stats.get("prompt_tokens"),
                "prompt_cached": stats.get("prompt_cached"), "new_tokens": stats.get("new_tokens")}


def one_round(args, routing: str, url: str, docs) -> dict:
    serve_args = build_parser().parse_args(
        ["serve", "--target", args.target, "--draft", "none", "--method", args.method, "--replicas",
         str(args.replicas), "--routing", routing, "--prompt-cache-mb", "512"])
    check_replica_options(serve_args)
    serve.run(build_app(build_server, serve_args), name=APP_NAME, route_prefix="/", blocking=False)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    began = time.perf_counter()
    chats, rows, order = [Chat(name, text) for name, text in docs], [], random.Random(0)
    with ThreadPoolExecutor(args.concurrency) as pool:
        for turn in range(args.turns):  # every user's turn, in a shuffled order, before anyone's next one
            order.shuffle(chats)
            rows += pool.map(lambda chat: chat.turn(client, args.target, args.max_tokens, turn), chats)
    wall = time.perf_counter() - began
    serve.delete(APP_NAME)
    later = [r for r in rows if r["turn"] > 0]
    return {"routing": routing, "wall_s": wall, "rows": rows,
            "ttft_first_s": statistics.median(r["ttft_s"] for r in rows if r["turn"] == 0),
            "ttft_later_s": statistics.median(r["ttft_s"] for r in later),
            "later_hit_share": sum(1 for r in later if r["prompt_cached"]) / len(later),
            "later_cached_share": sum(r["prompt_cached"] or 0 for r in later) / sum(r["prompt_tokens"] for r in later),
            "tokens_per_s": sum(r["new_tokens"] or 0 for r in rows) / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--method", default="lookup")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--chats", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--doc-chars", type=int, default=2400)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    docs = documents(args.chats, args.doc_chars)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    rounds = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        board = start_board()  # noqa: F841 (held while the rounds run)
        for repeat in range(args.repeats):
            for routing in ("prefix", "pow2") if repeat % 2 == 0 else ("pow2", "prefix"):
                result = one_round(args, routing, f"http://127.0.0.1:{port}", docs)
                rounds.append(result)
                print(f"{routing:6s} ttft first {result['ttft_first_s']:.2f}s later {result['ttft_later_s']:.2f}s "
                      f"hits {result['later_hit_share']:.0%} cached {result['later_cached_share']:.0%} "
                      f"{result['tokens_per_s']:.1f} tok/s ({result['wall_s']:.0f}s)", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {}
    for routing in ("prefix", "pow2"):
        mine = [r for r in rounds if r["routing"] == routing]
        summary[routing] = {key: statistics.median(r[key] for r in mine) for key in
                            ("ttft_first_s", "ttft_later_s", "later_hit_share", "later_cached_share", "tokens_per_s")}
    report = {"command": " ".join(sys.argv), "options": vars(args) | {"out": str(args.out)}, "summary": summary,
              "rounds": rounds}
    (args.out / "routing.json").write_text(json.dumps(report, indent=1))
    lines = ["| routing | TTFT, first turns (s) | TTFT, later turns (s) | later turns with a cache hit | "
             "their prompt tokens cached | aggregate tok/s |", "|---|---|---|---|---|---|"]
    for routing, s in summary.items():
        lines.append(f"| {routing} | {s['ttft_first_s']:.2f} | {s['ttft_later_s']:.2f} | {s['later_hit_share']:.0%} | "
                     f"{s['later_cached_share']:.0%} | {s['tokens_per_s']:.1f} |")
    (args.out / "routing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
