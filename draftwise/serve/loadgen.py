"""`draftwise loadgen`: drive a live server over HTTP at several concurrencies, speculation on and off.

For each concurrency level, the modes (on, off) run one after the other, each with a warm-up request and then
N streamed requests kept exactly `concurrency` in flight. Per level: aggregate tokens/s (completion tokens over
the level's wall time), p50/p95 time to first token and time between tokens (gaps between one request's
consecutive content chunks; the server sends one chunk per token), and the server-reported acceptance.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from draftwise.errors import DraftwiseError

MODES = ("on", "off")


@dataclass
class RequestRecord:
    mode: str
    concurrency: int
    prompt_id: str
    started: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between consecutive content chunks
    completion_tokens: int = 0
    acceptance: float | None = None
    error: str | None = None
    level_wall_s: float | None = None  # the wall time of the level this request ran in


def add_loadgen(commands, formatter) -> None:
    p = commands.add_parser(
        "loadgen",
        formatter_class=formatter,
        help="drive a live draftwise (or any OpenAI-compatible) server at several concurrencies",
        description=(
            "Stream the bench's prompts to a running server, exactly C requests in flight, at each --concurrency,\n"
            "with speculation on (the server's default) and off (the extra body field speculation: off). Writes\n"
            "results.json (every request), report.md (the table) and loadgen.png under --out, and prints the table."
        ),
        epilog=(
            "examples:\n"
            "  draftwise serve --port 8000 &\n"
            "  draftwise loadgen --url http://127.0.0.1:8000 --concurrency 1,2,4,8 --max-tokens 64\n"
            "  draftwise loadgen --url http://127.0.0.1:8000 --speculation off --categories summarization"
        ),
    )
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("DRAFTWISE_API_KEY"), help="default: $DRAFTWISE_API_KEY")
    p.add_argument("--model", help="the model id to send (default: the first of the server's /v1/models)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of requests in flight")
    p.add_argument("--speculation", default="on,off", help="comma list of modes: on, off")
    p.add_argument("--method", help="with mode on, ask for this speculation method (default: the server's)")
    p.add_argument("--requests", type=int, help="requests per level (default: 2 x concurrency, at least 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--categories", default="all", help="bench prompt categories, comma list or all")
    p.add_argument("--per-category", type=int, default=4, help="prompts taken from each category")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default="loadgen-results", help="folder for results.json, report.md, loadgen.png")
    p.add_argument("--json", action="store_true", help="print the summary rows as JSON instead of the table")
    p.set_defaults(func=cmd_loadgen)


def cmd_loadgen(args: argparse.Namespace) -> int:
    from draftwise.bench.prompts import default_prompts, select_prompts

    if urlparse(args.url).scheme not in ("http", "https"):
        raise DraftwiseError(f"--url must be an http:// or https:// address, got {args.url!r}")
    levels = _int_list(args.concurrency, "--concurrency")
    modes = [m.strip() for m in args.speculation.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise DraftwiseError(f"--speculation takes a comma list of: {', '.join(MODES)}")
    prompts = select_prompts(default_prompts(), args.categories, args.per_category)
    records = asyncio.run(_drive(args, levels, modes, prompts))
    rows = summarise(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"summary": rows, "requests": [asdict(r) for r in records]},
                                                 indent=1))
    table = markdown_table(rows)
    (out / "report.md").write_text(f"# Load test of {args.url}\n\n{table}\n")
    plot(rows, out / "loadgen.png")
    print(json.dumps(rows, indent=1) if args.json else table)
    print(f"wrote {out}/results.json, report.md, loadgen.png", file=sys.stderr)
    return 0


# -- driving -------------------------------------------------------------------------------------------
async def _drive(args, levels: list[int], modes: list[str], prompts) -> list[RequestRecord]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout) as http:
        model = args.model or await _first_model(http)
        for level in levels:
            count = args.requests or max(4, 2 * level)
            for mode in modes:
                body = _body(model, args, mode)
                await _one(http, body, prompts[0], RequestRecord(mode, level, "warm-up"))
                print(f"loadgen: concurrency {level}, speculation {mode}: {count} requests", file=sys.stderr)
                records += await _level(http, body, prompts, mode, level, count)
    return records


async def _level(http, body: dict, prompts, mode: str, level: int, count: int) -> list[RequestRecord]:
    queue = [(prompts[i % len(prompts)], RequestRecord(mode, level, str(prompts[i % len(prompts)].question_id)))
             for i in range(count)]
    pending = list(queue)

    async def worker():
        while pending:
            prompt, record = pending.pop(0)
            await _one(http, body, prompt, record)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(level)))
    wall = time.perf_counter() - started
    for _, record in queue:
        record.started -= started  # relative to the level's start
        record.level_wall_s = wall
    return [r for _, r in queue]


async def _one(http, body: dict, prompt, record: RequestRecord) -> None:
    payload = dict(body, messages=[{"role": "user", "content": prompt.text}])
    record.started = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=payload) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"].get("message")
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    if last is None:
                        record.ttft_s = now - record.started
                    else:
                        record.gaps_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
                    record.acceptance = (chunk.get("draftwise") or {}).get("acceptance_rate")
    except Exception as err:  # counted, never retried
        record.error = f"{type(err).__name__}: {err}"


async def _first_model(http) -> str:
    response = await http.get("/v1/models")
    if response.status_code != 200:
        raise DraftwiseError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]["id"]


def _body(model: str, args, mode: str) -> dict:
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if mode == "off":
        body["speculation"] = "off"
    elif args.method:
        body["speculation"] = {"method": args.method}
    return body


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise DraftwiseError(f"{name} takes a comma list of integers >= 1, got {text!r}")
    return values


# -- statistics (pure) ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the nearest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(records: list[RequestRecord]) -> list[dict]:
    """One row per (mode, concurrency), in the order they ran; ratios against concurrency 1 with speculation off
    (the plain single-user server) when that level ran."""
    rows = []
    for key in dict.fromkeys((r.mode, r.concurrency) for r in records):
        group = [r for r in records if (r.mode, r.concurrency) == key]
        ok = [r for r in group if r.error is None]
        wall = group[0].level_wall_s
        tokens = sum(r.completion_tokens for r in ok)
        gaps = [g for r in ok for g in r.gaps_s]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        accept = [r.acceptance for r in ok if r.acceptance is not None]
        rows.append({
            "mode": key[0], "concurrency": key[1], "requests": len(group), "failed": len(group) - len(ok),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "tbt_p50_s": percentile(gaps, 50), "tbt_p95_s": percentile(gaps, 95),
            "acceptance": sum(accept) / len(accept) if accept else None,
        })
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == "off" and r["concurrency"] == 1), None)
    for row in rows:
        row["vs_c1_off"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return rows


def markdown_table(rows: list[dict]) -> str:
    def f(value, digits=2, scale=1.0):
        return "-" if value is None else f"{value * scale:.{digits}f}"

    lines = ["| speculation | concurrency | requests (failed) | aggregate tok/s | vs c1 off | TTFT p50 / p95 s "
             "| TBT p50 / p95 ms | acceptance |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mode"], r["concurrency"])):
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['requests']} ({r['failed']}) | {f(r['tokens_per_s'])} "
                     f"| {f(r['vs_c1_off'])}x | {f(r['ttft_p50_s'])} / {f(r['ttft_p95_s'])} "
                     f"| {f(r['tbt_p50_s'], 0, 1000)} / {f(r['tbt_p95_s'], 0, 1000)} | {f(r['acceptance'])} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [r["tokens_per_s"] or 0 for r in mine], marker="o", label=f"speculation {mode}")
        right.plot(xs, [(r["tbt_p50_s"] or 0) * 1000 for r in mine], marker="o", label=f"speculation {mode}")
    left.set(xlabel="concurrency", ylabel="aggregate tokens/s", title="Throughput")
    right.set(xlabel="concurrency", ylabel="p50 time between tokens (ms)", title="Time between tokens")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
