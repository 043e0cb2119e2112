"""Issue 82's 7B-class table: draftwise's quant route and llama.cpp on the same synthetic Qwen2.5-7B-shaped GGUF
(scripts/write_7b_gguf.py), one after the other on a quiet machine.

    python docs/experiments/gguf-7b-spr/measure_7b.py FILE.gguf [--side ours|llama|both] [--json OUT]

Ours: load time and peak RSS (a fresh process; the packing cache warm unless it is the first load), RSS after load
and after a 2,048-token prompt, the cost of one forward of 1, 2, 4, 8, 16 tokens after a 200-token prefill (the
bench's roofline), plain decoding (method none, 32 tokens). llama.cpp (the bench's build): llama-bench passes of
the same widths at depth 200 and tg32, and llama-server's load time and RSS after load and after the same prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

WIDTHS = (1, 2, 4, 8, 16)
CONTEXT = 2048


def rss_gb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmRSS")


def prompt_ids(n: int, vocab: int = 150000) -> list[int]:
    return [(7919 * i + 13) % vocab for i in range(n)]


def ours(path: str) -> dict:
    from draftwise import Engine
    from draftwise.bench.runners import measure_roofline

    started = time.perf_counter()
    engine = Engine.from_pretrained(target=path, method="none", backend="quant", progress=False)
    load_s = time.perf_counter() - started
    row = {"load_s": load_s, "peak_rss_load_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
           "rss_after_load_gb": rss_gb()}
    row["pass_ms"] = measure_roofline(engine.target.model, sizes=WIDTHS, context=200, repeats=3)
    engine.generate(prompt_ids(16), max_new_tokens=4, ignore_eos=True)  # warm-up
    result = engine.generate(prompt_ids(16), max_new_tokens=32, ignore_eos=True)
    row["plain_tok_s"] = result.stats.tokens_per_s
    engine.generate(prompt_ids(CONTEXT), max_new_tokens=8, ignore_eos=True)
    row["rss_after_2048_gb"] = rss_gb()
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return row


def llama(path: str) -> dict:
    from draftwise.bench.llamacpp_server import server_binary

    server = server_binary()
    bench = server.parent / "llama-bench"
    threads = str(os.cpu_count() or 2)
    row: dict = {"binary": str(server)}
    passes = json.loads(subprocess.run(
        [str(bench), "-m", path, "-t", threads, "-p", ",".join(map(str, WIDTHS)), "-n", "0", "-d", "200", "-r", "3",
         "-o", "json"], check=True, capture_output=True, text=True).stdout)
    row["pass_ms"] = {str(r["n_prompt"]): r["avg_ns"] / 1e6 for r in passes}  # one pass of n_prompt tokens
    plain = json.loads(subprocess.run(
        [str(bench), "-m", path, "-t", threads, "-p", "0", "-n", "32", "-r", "3", "-o", "json"],
        check=True, capture_output=True, text=True).stdout)
    row["plain_tok_s"] = plain[0]["avg_ts"]
    port = 18089
    started = time.perf_counter()
    proc = subprocess.Popen([str(server), "-m", path, "-t", threads, "-c", "4096", "-np", "1", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - started > 600 or proc.poll() is not None:
                raise RuntimeError("llama-server did not come up")
            time.sleep(0.2)
        row["load_s"] = time.perf_counter() - started
        row["rss_after_load_gb"] = rss_gb(proc.pid)
        body = json.dumps({"prompt": prompt_ids(CONTEXT), "n_predict": 8, "cache_prompt": False}).encode()
        request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as r:
            r.read()
        row["rss_after_2048_gb"] = rss_gb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--side", choices=("ours", "llama", "both"), default="both")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    rows = {}
    if args.side in ("ours", "both"):
        # A process of its own, so its peak RSS is the load's alone.
        out = subprocess.run([sys.executable, "-c", f"import json,sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
                              f"import measure_7b as m; print(json.dumps(m.ours({args.file!r})))"],
                             check=True, capture_output=True, text=True).stdout
        rows["draftwise"] = json.loads(out.strip().splitlines()[-1])
    if args.side in ("llama", "both"):
        rows["llama.cpp"] = llama(args.file)
    text = json.dumps(rows, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
