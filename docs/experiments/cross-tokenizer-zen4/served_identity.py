"""Served at concurrency 4, each text the same as alone: a cross-tokenizer pair behind `draftwise serve`.

Starts `draftwise serve` on 127.0.0.1 (the Qwen 1.5B target, --draft and --method as given), sends the record's
prompts and the bench's first prompt of each category, greedy, first one at a time, then 4 at a time, through the
official openai client; prints whether every text matched, the acceptance the server reported, and stops the server.

    .venv/bin/python docs/experiments/cross-tokenizer-zen4/served_identity.py --draft smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

HERE = Path(__file__).resolve().parent
PORT = 8431


def prompts() -> list[str]:
    from draftwise.bench.prompts import default_prompts, select_prompts

    own = [json.loads(line)["turns"][0] for line in (HERE / "prompts.jsonl").read_text().splitlines()]
    return own + [p.text for p in select_prompts(default_prompts(), per_category=1)]


def wait_ready(url: str, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="hybrid")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{PORT}"
    server = subprocess.Popen([sys.executable, "-m", "draftwise", "serve", "--draft", args.draft, "--method",
                               args.method, "--host", "127.0.0.1", "--port", str(PORT), "--max-batch", "4"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(prompt: str):
            reply = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0,
                                                   max_tokens=args.max_tokens,
                                                   messages=[{"role": "user", "content": prompt}])
            stats = reply.model_extra.get("draftwise", {})
            return reply.choices[0].message.content, stats.get("accepted", 0), stats.get("proposed", 0)

        texts = prompts()
        alone = [ask(p) for p in texts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, texts))
        same = [a[0] == t[0] for a, t in zip(alone, together)]
        for name, runs in (("alone", alone), ("at 4", together)):
            kept, offered = sum(r[1] for r in runs), sum(r[2] for r in runs)
            print(f"{name}: {kept}/{offered} guesses kept ({kept / max(offered, 1):.2f})")
        print(f"{sum(same)}/{len(same)} texts the same at concurrency 4 as alone "
              f"(draft {args.draft}, method {args.method}, {args.max_tokens} tokens)")
        return 0 if all(same) else 1
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    raise SystemExit(main())
