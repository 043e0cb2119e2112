"""The load generator behind `draftwise loadgen`: drive a live server over HTTP at several concurrencies,
speculation on and off, for one method or several.

At each concurrency level, each cell (a mode, on, always or off, and for on and always a method) runs in turn, and
the whole round of cells again for each repeat, in the order interleave.order_for_repeat gives, so that whatever
else the machine is doing weighs on all of them alike: `concurrency` warm-up requests at once before a cell's first
run (not counted), then N streamed requests kept exactly `concurrency` in flight; with slices, a method's cells take
turns slice by slice of those N (LoadPlan.schedule). Off is the target alone whatever the method, yet it runs beside
each method's on and always (a block of three cells): a round of many cells spans minutes, over which this machine's
speed drifts by a tenth and more, and an on judged against an off minutes away would measure the drift. Per cell:
aggregate tokens/s (completion tokens over the run's wall time, a repeat's slices pooled; the median of the repeats,
and their range), p50/p95 time to first token and time between tokens (gaps between one request's consecutive
content chunks: the server sends one chunk per token), and the server-reported acceptance. Per method and level, the
throttle's verdict: on over the better of always and off, repeat by repeat (the cells of one repeat ran back to back).

Three layers: the plan (LoadPlan; the command's options become one in loadgen_command.py), the HTTP driver
(run_load and the coroutines under it), and pure functions (take_chunk, percentile, summarise, markdown_table) that
the tests feed made-up data.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

from draftwise.bench.interleave import order_for_repeat
from draftwise.errors import DraftwiseError
from draftwise.files import write_whole

# on: the server's default speculation (its draft length adapts to acceptance and load); always: the same method
# drafting its full k every round (adaptive off); off: the target alone.
MODES = ("on", "always", "off")
OFF = "off"
# What the throttle promises: adaptive speculation at least this share of the better of always and off.
THROTTLE_FLOOR = 0.95
API_KEY_ENV = "DRAFTWISE_API_KEY"
ERROR_CHARS = 300  # how much of an error body a record keeps


# ---------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class LoadPlan:
    """Everything a run needs, checked: what add_loadgen's options become."""

    url: str
    levels: tuple[int, ...]
    modes: tuple[str, ...]
    prompts: tuple  # BenchPrompt
    requests: int | None = None
    max_tokens: int = 64
    chat: bool = True
    methods: tuple[str | None, ...] = (None,)  # None: the server's own
    repeats: int = 1
    slices: int = 1  # each cell's requests run in this many slices, the modes interleaved slice by slice
    model: str | None = None
    api_key: str | None = None
    timeout: float = 300.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def count(self, level: int) -> int:
        """Requests at this level. Every level sends the same ones (prompts cycled in order), so that a ratio
        between levels compares load, not prompt mixes; fewer than the concurrency would never reach it."""
        return max(self.requests or max(len(self.prompts), *self.levels), level)

    def blocks(self) -> list[list[tuple[str, str | None]]]:
        """The (mode, method) cells every level runs, a block per method of its modes side by side, off among them
        (the target alone, tagged with the block's method: what that method's on is judged against)."""
        return [[(mode, method) for mode in self.modes] for method in self.methods]

    def parts(self, level: int) -> list[range]:
        """The requests of each slice of a cell at this level (indices into the level's count), in order: the count
        cut into `slices` near-equal consecutive runs, or fewer where a slice would hold fewer requests than the
        concurrency (it could never reach it)."""
        count = self.count(level)
        n = max(1, min(self.slices, count // level))
        bounds = [count * i // n for i in range(n + 1)]
        return [range(low, high) for low, high in zip(bounds, bounds[1:])]

    def schedule(self, level: int) -> Iterator[tuple[int, int, str, str | None]]:
        """Every run at a level, (repeat, slice, mode, method), in the order they go: each repeat's blocks as
        order_for_repeat orders them, and within a block, slice by slice, its cells side by side, mirrored from one
        slice (or repeat) to the next. With one slice a block's cells are as far apart as a whole cell takes (half
        a minute and more, over which a shared machine's speed can move by a fifth); slices bring an on and its off
        within seconds of each other, and give the drift as many mirrored pairs to cancel in."""
        parts = len(self.parts(level))
        for repeat in range(self.repeats):
            for block in order_for_repeat(self.blocks(), repeat):
                for part in range(parts):
                    for mode, method in order_for_repeat(block, repeat * parts + part):
                        yield repeat, part, mode, method


def base_url(url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000': OpenAI clients are given the /v1 form, we add paths to it."""
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise DraftwiseError(f"--url must be an http:// or https:// address like http://127.0.0.1:8000, got {url!r}")
    path = parsed.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parsed.scheme}://{parsed.netloc}{path}"


# ---------------------------------------------------------------------------------------------------------
# Results


def write_results(out: Path, plan: LoadPlan, records: list, rows: list[dict], command: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"url": plan.url, "endpoint": plan.path, "command": command, "max_tokens": plan.max_tokens,
            "methods": list(plan.methods), "repeats": plan.repeats, "slices": plan.slices, "prompts": len(plan.prompts),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    results = {"meta": meta, "summary": rows, "requests": [asdict(r) for r in records]}
    write_whole(out / "results.json", lambda p: p.write_text(json.dumps(results, indent=1) + "\n"))
    write_whole(out / "report.md", lambda p: p.write_text(report_markdown(meta, rows)))
    plot(rows, out / "loadgen.png")


# ---------------------------------------------------------------------------------------------------------
# Driving the server


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the request's own start unless said otherwise."""

    mode: str
    concurrency: int
    prompt_id: str
    method: str | None = None  # what was asked for (None: the server's own; off: the target alone)
    repeat: int = 0
    part: int = 0  # the slice of the cell's requests it ran in (LoadPlan.parts)
    start_s: float = 0.0  # from the start of the run
    ttft_s: float | None = None  # the first chunk with non-empty text
    chunk_times_s: list[float] = field(default_factory=list)  # every content chunk
    gaps_s: list[float] = field(default_factory=list)  # between consecutive content chunks
    total_s: float | None = None
    completion_tokens: int = 0
    tokens_from_usage: bool = False  # False: no usage chunk came, the content chunks were counted instead
    acceptance: float | None = None
    stats: dict | None = None  # the reply's `draftwise` field, as sent
    finish_reason: str | None = None
    status: int | None = None  # the HTTP status
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None
    level_wall_s: float | None = None  # the wall time of the run (a cell's slice in one repeat) it ran in


async def run_load(plan: LoadPlan, log=None, records: list | None = None) -> list[RequestRecord]:
    """Every level of the plan, and in it every repeat of its cells; the records of the counted requests, added to
    `records` run by run (so that a caller keeps those of the runs that ended when a later one fails)."""
    import httpx

    log = log or _stderr
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    # Enough connections that the pool never holds a request back from the concurrency asked for.
    limits = httpx.Limits(max_connections=max(plan.levels) + 1, max_keepalive_connections=max(plan.levels) + 1)
    records = [] if records is None else records
    # trust_env=False: the server named by --url, never a proxy from the environment (with the API key in clear).
    async with httpx.AsyncClient(base_url=plan.url, headers=headers, timeout=plan.timeout, limits=limits,
                                 trust_env=False) as http:
        model = plan.model or await first_model(http, plan.url)
        log(f"loadgen: {plan.url}{plan.path}, model {model}, {len(plan.prompts)} prompts, "
            f"max_tokens {plan.max_tokens}, {plan.repeats} repeat(s), {plan.slices} slice(s)")
        for level in plan.levels:
            parts, warm = plan.parts(level), set()
            for repeat, part, mode, method in plan.schedule(level):
                body = request_body(model, plan, mode, method)
                if (mode, method) not in warm:
                    await _warm_up(http, plan, body, mode, level)
                    warm.add((mode, method))
                run = await run_level(http, plan, body, (mode, method, repeat, part), level, parts[part])
                log(_progress_line(summarise(run)[0], run, len(parts)))
                records += run
    return records


async def first_model(http, url: str) -> str:
    import httpx

    try:
        response = await http.get("/v1/models")
    except httpx.HTTPError as err:
        raise DraftwiseError(f"cannot reach {url}: {_describe(err)}; is the server running?") from None
    if response.status_code != 200:
        raise DraftwiseError(f"GET {url}/v1/models answered {http_error(response.status_code, response.content)}"
                             f"{_auth_hint(response.status_code)}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise DraftwiseError(f"GET {url}/v1/models did not list a model; give one with --model") from None


def method_speculation(method: str) -> dict:
    """'hybrid' -> {"method": "hybrid"}; 'hybrid:NAME@v1' -> the same method drafting with NAME@v1, a draft version
    loaded beside the server's own (a trial's candidate), so that two drafts compare in one server, interleaved."""
    name, _, draft = method.partition(":")
    return {"method": name, "draft": draft} if draft else {"method": name}


def request_body(model: str, plan: LoadPlan, mode: str, method: str | None = None) -> dict:
    """The body shared by a cell's requests (method: what mode on or always asks for; None, the server's own); the
    prompt goes in per request."""
    body = {"model": model, "max_tokens": plan.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if mode == OFF:
        body["speculation"] = {"method": "none"}
        return body
    speculation = method_speculation(method) if method else {}
    if mode == "always":
        speculation["adaptive"] = False
    if speculation:
        body["speculation"] = speculation
    return body


def with_prompt(body: dict, text: str, chat: bool) -> dict:
    return dict(body, messages=[{"role": "user", "content": text}]) if chat else dict(body, prompt=text)


async def _warm_up(http, plan: LoadPlan, body: dict, mode: str, level: int) -> None:
    """`level` requests at once first, not counted: a server times each shape of step the first time it runs one
    (a draftwise server prices its drafting by them), so the first cell at a level would pay for timing that level's
    batches and the others not. If even these fail, every counted one would too: stop with the first one's reason."""
    records = [RequestRecord(mode, level, "warm-up") for _ in range(level)]
    started = time.perf_counter()
    await asyncio.gather(*(one_request(http, plan, body, plan.prompts[i % len(plan.prompts)], record, started)
                           for i, record in enumerate(records)))
    failed = next((r for r in records if r.error is not None), None)
    if failed is not None:
        raise DraftwiseError(f"the warm-up request (speculation {mode}, concurrency {level}) failed: "
                             f"{failed.error}{_auth_hint(failed.status)}")


async def run_level(http, plan: LoadPlan, body: dict, cell: tuple[str, str | None, int, int], level: int,
                    requests: range) -> list[RequestRecord]:
    """One run of a cell (mode, method, repeat, slice): the slice's requests (indices into the level's, the prompts
    cycled), `level` workers each sending the next one as soon as its last one ends."""
    prompts = [plan.prompts[i % len(plan.prompts)] for i in requests]
    mode, method, repeat, part = cell
    records = [RequestRecord(mode, level, str(p.question_id), method, repeat, part) for p in prompts]
    todo = deque(zip(prompts, records))
    origin = time.perf_counter()

    async def worker():
        while todo:
            prompt, record = todo.popleft()
            await one_request(http, plan, body, prompt, record, origin)

    await asyncio.gather(*(worker() for _ in range(level)))
    wall = time.perf_counter() - origin
    for record in records:
        record.level_wall_s = wall
    return records


async def one_request(http, plan: LoadPlan, body: dict, prompt, record: RequestRecord, origin: float) -> None:
    """Send one streamed request and fill its record; any failure lands in record.error, nothing is raised."""
    import httpx

    started = time.perf_counter()
    record.start_s = started - origin
    try:
        # wait_for bounds the whole request; httpx's own timeout bounds only each read or connect.
        await asyncio.wait_for(_stream(http, plan.path, with_prompt(body, prompt.text, plan.chat), record, started),
                               plan.timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {plan.timeout:g}s"
    except httpx.HTTPError as err:
        record.error = _describe(err)
    except ValueError as err:  # a chunk that is not JSON
        record.error = f"bad stream: {err}"
    record.total_s = time.perf_counter() - started
    finish_record(record)


async def _stream(http, path: str, payload: dict, record: RequestRecord, started: float) -> None:
    async with http.stream("POST", path, json=payload) as response:
        record.status = response.status_code
        if response.status_code != 200:
            record.error = http_error(response.status_code, await response.aread())
            return
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data == "[DONE]":
                record.done = True
                return
            if data is not None:
                take_chunk(record, json.loads(data), time.perf_counter() - started)


def finish_record(record: RequestRecord) -> None:
    """After the stream: a stream cut before [DONE] is a failure; without a usage chunk, count the chunks."""
    if record.error is None and not record.done:
        record.error = "the stream ended before data: [DONE]"
    if not record.tokens_from_usage:
        record.completion_tokens = len(record.chunk_times_s)


# ---------------------------------------------------------------------------------------------------------
# Pure: one stream's lines and chunks


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


STAT_NUMBERS = ("proposed", "accepted", "acceptance_rate", "mean_accepted_length")  # what the summary reads


def take_chunk(record: RequestRecord, chunk: dict, t: float) -> None:
    """Fold one OpenAI stream chunk (chat or completions), received t seconds into the request, into record. A
    chunk not of that shape is a ValueError (the request's "bad stream"), never another error that ends the run."""
    if not isinstance(chunk, dict):
        raise ValueError(f"a chunk must be a JSON object, got {chunk!r:.80}")
    try:
        _take(record, chunk, t)
    except (TypeError, AttributeError, KeyError) as err:
        raise ValueError(f"a chunk not in OpenAI's shape ({type(err).__name__}: {err}): {chunk!r:.80}") from None


def _take(record: RequestRecord, chunk: dict, t: float) -> None:
    if "error" in chunk:  # the server ended the request mid-stream
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        record.error = f"error in stream: {message}"
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if text:
            if record.chunk_times_s:
                record.gaps_s.append(t - record.chunk_times_s[-1])
            else:
                record.ttft_s = t
            record.chunk_times_s.append(t)
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    usage = chunk.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        record.completion_tokens = int(usage["completion_tokens"])
        record.tokens_from_usage = True
    stats = chunk.get("draftwise")
    if isinstance(stats, dict):
        if any(not isinstance(stats.get(name, 0), (int, float, type(None))) for name in STAT_NUMBERS):
            raise TypeError(f"the draftwise stats hold a non-number among {', '.join(STAT_NUMBERS)}")
        record.stats = stats
        record.acceptance = stats.get("acceptance_rate")


def http_error(status: int, body: bytes) -> str:
    """'HTTP 429: too many waiting requests': the OpenAI error message when the body has one, else the raw body."""
    text = body.decode("utf-8", "replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.strip() or "(empty body)"
    return f"HTTP {status}: {message[:ERROR_CHARS]}"


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _auth_hint(status: int | None) -> str:
    return f"; pass --api-key or set ${API_KEY_ENV}" if status in (401, 403) else ""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _progress_line(row: dict, records: list[RequestRecord], parts: int = 1) -> str:
    part = f", slice {records[0].part + 1}/{parts}" if parts > 1 else ""
    line = (f"loadgen: {_cell_name(row)}, concurrency {row['concurrency']}, repeat {records[0].repeat + 1}{part}: "
            f"{row['requests']} requests, "
            f"{_fmt(row['tokens_per_s'], 1)} tok/s, TBT p50 {_fmt(row['tbt_p50_s'], 0, 1000)} ms")
    if row["failed"]:
        first = next(r.error for r in records if r.error is not None)
        line += f", {row['failed']} FAILED (first: {first})"
    return line


# ---------------------------------------------------------------------------------------------------------
# Pure: statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the nearest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(records: list[RequestRecord]) -> list[dict]:
    """One row per cell and level (mode, method, concurrency), in the order they first ran. Only the requests that
    succeeded count towards tokens, times and acceptance. tokens_per_s is the median of the cell's runs (one per
    repeat; runs_tokens_per_s, by repeat, and its low and high); vs_c1_off compares with concurrency 1, speculation
    off (one user, the target alone) when that level ran; the on rows carry the throttle's verdict (judge_throttle)."""
    groups: dict[tuple, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault((r.mode, r.method, r.concurrency), []).append(r)
    rows = [_summary_row(mode, method, level, group) for (mode, method, level), group in groups.items()]
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == OFF and r["concurrency"] == 1), None)
    for row in rows:
        row["vs_c1_off"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] is not None else None
    judge_throttle(rows)
    return rows


def _summary_row(mode: str, method: str | None, level: int, group: list[RequestRecord]) -> dict:
    ok = [r for r in group if r.error is None]
    runs = _runs_tokens_per_s(group)
    rates = [rate for rate in runs if rate is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]  # pooled: a long request weighs by its number of tokens
    methods = sorted({r.stats["method"] for r in ok if r.stats and r.stats.get("method")})
    return {
        "mode": mode, "method": method, "concurrency": level, "requests": len(group), "failed": len(group) - len(ok),
        "tokens": sum(r.completion_tokens for r in ok), "wall_s": sum(_run_walls(group).values()) or None,
        "tokens_per_s": percentile(rates, 50), "tokens_per_s_low": min(rates, default=None),
        "tokens_per_s_high": max(rates, default=None), "runs_tokens_per_s": runs,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "tbt_p50_s": percentile(gaps, 50), "tbt_p95_s": percentile(gaps, 95),
        "acceptance": acceptance(ok), "mean_accepted_length": _mean(r.stats.get("mean_accepted_length")
                                                                    for r in ok if r.stats),
        "server_methods": methods,
    }


def _run_walls(group: list[RequestRecord]) -> dict[int, float]:
    """Each repeat's wall time: the sum of its slices' runs' (every request of a run carries its run's)."""
    runs: dict[tuple[int, int], float] = {}
    for r in group:
        if r.level_wall_s is not None:
            runs[r.repeat, r.part] = max(runs.get((r.repeat, r.part), 0.0), r.level_wall_s)
    walls: dict[int, float] = {}
    for (repeat, _), wall in runs.items():
        walls[repeat] = walls.get(repeat, 0.0) + wall
    return walls


def _runs_tokens_per_s(group: list[RequestRecord]) -> list[float | None]:
    """Aggregate tokens/s of each repeat's run, by repeat (None for a repeat that did not run)."""
    walls = _run_walls(group)
    rates: list[float | None] = [None] * (max(r.repeat for r in group) + 1)
    for repeat, wall in walls.items():
        tokens = sum(r.completion_tokens for r in group if r.repeat == repeat and r.error is None)
        rates[repeat] = tokens / wall if wall else None
    return rates


def judge_throttle(rows: list[dict]) -> None:
    """To each row of mode on, beside always or off at its level: on over the better of the two, repeat by repeat (a
    repeat's cells ran back to back, so each ratio compares like with like), its median and range (on_vs_best,
    _low, _high), and whether the median holds THROTTLE_FLOOR (throttle_holds); None where neither ran."""
    for on in (r for r in rows if r["mode"] == "on"):
        rivals = _rivals(rows, on)
        ratios = []
        for repeat, rate in enumerate(on["runs_tokens_per_s"]):
            best = max((_at(r, repeat) or 0.0 for r in rivals), default=0.0)
            if rate is not None and best:
                ratios.append(rate / best)
        median = percentile(ratios, 50)
        on.update(on_vs_best=median, on_vs_best_low=min(ratios, default=None),
                  on_vs_best_high=max(ratios, default=None),
                  throttle_holds=None if median is None else median >= THROTTLE_FLOOR)


def _rivals(rows: list[dict], on: dict) -> list[dict]:
    """The rows an on row is judged against, at its level: always with its method, and the off run beside them (any
    off, for records of a run that ran off once)."""
    level = [r for r in rows if r["concurrency"] == on["concurrency"]]
    offs = [r for r in level if r["mode"] == OFF]
    beside = [r for r in offs if r["method"] == on["method"]] or offs
    return [r for r in level if r["mode"] == "always" and r["method"] == on["method"]] + beside


def _at(row: dict, repeat: int) -> float | None:
    runs = row["runs_tokens_per_s"]
    return runs[repeat] if repeat < len(runs) else None


def acceptance(records: list[RequestRecord]) -> float | None:
    """Accepted over proposed draft tokens, pooled over the requests, when the server reports both counts;
    else the mean of the requests' own rates; None when no request reported any (speculation off)."""
    counted = [r.stats for r in records if r.stats and r.stats.get("proposed")]
    if counted:
        return sum(s.get("accepted", 0) for s in counted) / sum(s["proposed"] for s in counted)
    return _mean(r.acceptance for r in records)


def _mean(values) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


# ---------------------------------------------------------------------------------------------------------
# Output


def _fmt(value, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _cell_name(row: dict) -> str:
    """'speculation on, hybrid': a row's mode and the method it asked for (the server's own when it named none)."""
    if row["mode"] == OFF:
        return "speculation off" + (f", beside {row['method']}" if row["method"] else "")
    return f"speculation {row['mode']}, {_method_name(row)}"


def _method_name(row: dict) -> str:
    """The method a row asked for: 'none' for off, the server's own (as it reported it) where it named none."""
    if row.get("mode") == OFF:
        return f"none (beside {row['method']})" if row.get("method") else "none"
    return row["method"] or "/".join(row.get("server_methods") or []) or "(server's)"


def _rate_cell(row: dict) -> str:
    """'20.1' for one run, '20.1 (19.5-20.8)' for several: the median and the range of the repeats."""
    ran = [v for v in row["runs_tokens_per_s"] if v is not None]
    text = _fmt(row["tokens_per_s"], 1)
    return text if len(ran) < 2 else f"{text} ({row['tokens_per_s_low']:.1f}-{row['tokens_per_s_high']:.1f})"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | speculation | concurrency | requests (failed) | aggregate tok/s | vs c1 off "
             "| TTFT p50 / p95 s | TBT p50 / p95 ms | acceptance |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mode"] == OFF, _method_name(r), r["concurrency"], r["mode"])):
        ratio = "-" if r["vs_c1_off"] is None else f"{r['vs_c1_off']:.2f}x"
        lines.append(f"| {_method_name(r)} | {r['mode']} | {r['concurrency']} | {r['requests']} ({r['failed']}) "
                     f"| {_rate_cell(r)} | {ratio} | {_fmt(r['ttft_p50_s'])} / {_fmt(r['ttft_p95_s'])} "
                     f"| {_fmt(r['tbt_p50_s'], 1, 1000)} / {_fmt(r['tbt_p95_s'], 1, 1000)} "
                     f"| {_fmt(r['acceptance'])} |")
    return "\n".join(lines)


def throttle_table(rows: list[dict]) -> str:
    """The throttle's verdicts, one line per method and level that has one; empty when none ran."""
    judged = [r for r in rows if r["mode"] == "on" and r.get("on_vs_best") is not None]
    if not judged:
        return ""
    lines = ["| method | concurrency | on tok/s | always tok/s | off tok/s | on / best of always, off (range) "
             f"| >= {THROTTLE_FLOOR} |", "|---|---|---|---|---|---|---|"]
    for on in sorted(judged, key=lambda r: (_method_name(r), r["concurrency"])):
        rival = {r["mode"]: r["tokens_per_s"] for r in _rivals(rows, on)}
        low, high = on["on_vs_best_low"], on["on_vs_best_high"]
        spread = "" if low == high else f" ({low:.2f}-{high:.2f})"
        lines.append(f"| {_method_name(on)} | {on['concurrency']} | {_fmt(on['tokens_per_s'], 1)} "
                     f"| {_fmt(rival.get('always'), 1)} | {_fmt(rival.get(OFF), 1)} | {on['on_vs_best']:.2f}x{spread} "
                     f"| {'yes' if on['throttle_holds'] else '**no**'} |")
    return "\n".join(lines)


def _in_slices(meta: dict) -> str:
    slices = meta.get("slices", 1)
    return f", each cell in {slices} slices, a method's modes taking turns slice by slice" if slices > 1 else ""


def report_markdown(meta: dict, rows: list[dict]) -> str:
    methods = ", ".join(m or "the server's default" for m in meta["methods"])
    verdicts = throttle_table(rows)
    return (
        f"# Load test of {meta['url']}\n\n"
        f"{meta['date']}, `{meta['command']}`\n\n"
        f"POST {meta['endpoint']}, streamed, temperature 0, max_tokens {meta['max_tokens']}, {meta['prompts']} "
        f"prompts, {meta['repeats']} repeat(s) interleaved{_in_slices(meta)}; speculation on and always: {methods}; off: "
        f"`{{\"method\": \"none\"}}`.\n\n"
        f"{markdown_table(rows)}\n\n"
        "Aggregate tok/s: completion tokens of the requests that succeeded over the run's wall time (with slices, "
        "the sum of its slices'); with repeats, "
        "the median and (the range). vs c1 off: that over concurrency 1 with speculation off. TTFT: time to the "
        "first chunk with text. TBT: gaps between one request's consecutive chunks (one per token), pooled. "
        "Acceptance: accepted over proposed draft tokens, as the server reports them.\n"
        + (f"\n## Throttle\n\n{verdicts}\n\nOn (adaptive) over the better of always and off, repeat by repeat: "
           f"the median and (the range); it should be at least {THROTTLE_FLOOR}.\n" if verdicts else "")
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in threads and on servers
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for cell in dict.fromkeys(_cell_name(r) for r in rows):
        mine = sorted((r for r in rows if _cell_name(r) == cell), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [r["tokens_per_s"] or 0 for r in mine], marker="o", label=cell)
        tbt = [(r["tbt_p50_s"] * 1000 if r["tbt_p50_s"] is not None else float("nan")) for r in mine]
        right.plot(xs, tbt, marker="o", label=cell)
    left.set(xlabel="concurrency", ylabel="aggregate tokens/s", title="Throughput")
    right.set(xlabel="concurrency", ylabel="p50 time between tokens (ms)", title="Time between tokens")
    levels = sorted({r["concurrency"] for r in rows})
    for ax in (left, right):
        ax.set_xticks(levels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
