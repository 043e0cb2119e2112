"""The load generator behind `draftwise loadgen`: drive a live server over HTTP at several concurrencies,
speculation on and off, for one method or several.

At each concurrency level, each cell (a mode, on, always or off, and for on and always a method) runs in turn, and the
whole round of cells again for each repeat, in the order interleave.order_for_repeat gives, so that whatever else the
machine is doing weighs on all of them alike: `concurrency` warm-up requests at once before a cell's first run (not
counted), then N streamed requests kept exactly `concurrency` in flight; with slices, a method's cells take turns
slice by slice of those N (LoadPlan.schedule). Off is the target alone whatever the method, yet it runs beside each
method's on and always (a block of three cells): a round of many cells spans minutes, over which a shared machine's
speed drifts, and an on judged against an off minutes away would measure the drift (how far it drifted:
docs/experiments/constants/README.md). Per cell: aggregate tokens/s (completion tokens over the run's wall time, a
repeat's slices pooled; the median of the repeats, and their range), p50/p95 time to first token, time between
chunks (TBT) and time per output token (TPOT: a server may send a verified draft's tokens in one chunk or in a
burst), and the server-reported acceptance. Per method and level, the throttle's verdict: on over the better of always and off, repeat
by repeat (the cells of one repeat ran back to back).

This module is the HTTP driver (run_load and the coroutines under it). Beside it, each with one job: the plan
(load_plan.py, LoadPlan; the command's options become one in loadgen_command.py), a request's record and the parsing
of its stream (load_record.py), the statistics (load_stats.py) and the written results (load_report.py); the
parsing, the statistics and the tables are pure functions that the tests feed made-up data.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque

from draftwise.bench.load_plan import LoadPlan, request_body, with_prompt
from draftwise.bench.load_record import RequestRecord, finish_record, http_error, sse_data, take_chunk
from draftwise.bench.load_report import cell_name, fmt
from draftwise.bench.load_server import check_plan, identify
from draftwise.bench.load_stats import summarise
from draftwise.errors import DraftwiseError

API_KEY_ENV = "DRAFTWISE_API_KEY"


async def run_load(plan: LoadPlan, log=None, records: list | None = None,
                   found: dict | None = None) -> list[RequestRecord]:
    """Every level of the plan, and in it every repeat of its cells; the records of the counted requests, added to
    `records` run by run (so that a caller keeps those of the runs that ended when a later one fails). found["server"]:
    the ServerKind measured, as soon as it is known (the report names it)."""
    import httpx

    log = log or _stderr
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    # Enough connections that the pool never holds a request back from the concurrency asked for.
    limits = httpx.Limits(max_connections=max(plan.levels) + 1, max_keepalive_connections=max(plan.levels) + 1)
    records = [] if records is None else records
    # trust_env=False: the server named by --url, never a proxy from the environment (with the API key in clear).
    async with httpx.AsyncClient(base_url=plan.url, headers=headers, timeout=plan.timeout, limits=limits,
                                 trust_env=False) as http:
        listing = await list_models(http, plan.url, required=plan.model is None)
        model = plan.model or first_model(listing, plan.url)
        server = await identify(http, listing, plan.server)
        check_plan(plan, server)  # before any request
        if found is not None:
            found["server"] = server
        log(f"loadgen: {plan.url}{plan.path} ({server.name}), model {model}, {len(plan.prompts)} prompts, "
            f"max_tokens {plan.max_tokens}, temperature {plan.temperature:g}, {plan.repeats} repeat(s), "
            f"{plan.slices} slice(s)")
        for level in plan.levels:
            parts, warm = plan.parts(level), set()
            for repeat, part, mode, method in plan.schedule(level):
                body = request_body(model, plan, mode, method, server.speculation, server.extra_fields(plan))
                if (mode, method) not in warm:
                    await _warm_up(http, plan, body, mode, level)
                    warm.add((mode, method))
                run = await run_level(http, plan, body, (mode, method, repeat, part), level, parts[part])
                log(_progress_line(summarise(run)[0], run, len(parts)))
                records += run
    return records


async def list_models(http, url: str, required: bool = True) -> dict | None:
    """GET /v1/models. Not required (--model given): None where it does not answer, and the warm-up meets the
    reason; a server that cannot be reached at all is an error either way."""
    import httpx

    try:
        response = await http.get("/v1/models")
    except httpx.HTTPError as err:
        raise DraftwiseError(f"cannot reach {url}: {_describe(err)}; is the server running?") from None
    if response.status_code != 200:
        if not required:
            return None
        raise DraftwiseError(f"GET {url}/v1/models answered {http_error(response.status_code, response.content)}"
                             f"{_auth_hint(response.status_code)}")
    try:
        return response.json()
    except ValueError:
        if required:
            raise DraftwiseError(f"GET {url}/v1/models did not answer JSON; give a model with --model") from None
        return None


def first_model(listing: dict | None, url: str) -> str:
    try:
        return listing["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise DraftwiseError(f"GET {url}/v1/models did not list a model; give one with --model") from None


async def _warm_up(http, plan: LoadPlan, body: dict, mode: str, level: int) -> None:
    """`level` requests at once first, not counted: a server times each shape of step the first time it runs one
    (a draftwise server prices its drafting by them), so the first cell at a level would pay for timing that level's
    batches and the others not. If even these fail, every counted one would too: stop with the first one's reason."""
    records = [RequestRecord(mode, level, "warm-up") for _ in range(level)]
    started = time.perf_counter()
    await asyncio.gather(*(one_request(http, plan, body, plan.prompts[i % len(plan.prompts)], record, started,
                                       plan.request_seed(i)) for i, record in enumerate(records)))
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
    records = [RequestRecord(mode, level, str(p.question_id), method, repeat, part, seed=plan.request_seed(i))
               for i, p in zip(requests, prompts)]
    todo = deque(zip(prompts, records))
    origin = time.perf_counter()

    async def worker():
        while todo:
            prompt, record = todo.popleft()
            await one_request(http, plan, body, prompt, record, origin, record.seed)

    await asyncio.gather(*(worker() for _ in range(level)))
    wall = time.perf_counter() - origin
    for record in records:
        record.level_wall_s = wall
    return records


async def one_request(http, plan: LoadPlan, body: dict, prompt, record: RequestRecord, origin: float,
                      seed: int | None = None) -> None:
    """Send one streamed request and fill its record; any failure lands in record.error, nothing is raised."""
    import httpx

    started = time.perf_counter()
    record.start_s = started - origin
    try:
        # wait_for bounds the whole request; httpx's own timeout bounds only each read or connect.
        await asyncio.wait_for(_stream(http, plan.path, with_prompt(body, prompt.text, plan.chat, seed), record,
                                       started),
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


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _auth_hint(status: int | None) -> str:
    return f"; pass --api-key or set ${API_KEY_ENV}" if status in (401, 403) else ""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _progress_line(row: dict, records: list[RequestRecord], parts: int = 1) -> str:
    part = f", slice {records[0].part + 1}/{parts}" if parts > 1 else ""
    line = (f"loadgen: {cell_name(row)}, concurrency {row['concurrency']}, repeat {records[0].repeat + 1}{part}: "
            f"{row['requests']} requests, "
            f"{fmt(row['tokens_per_s'], 1)} tok/s, TBT p50 {fmt(row['tbt_p50_s'], 0, 1000)} ms")
    if row["failed"]:
        first = next(r.error for r in records if r.error is not None)
        line += f", {row['failed']} FAILED (first: {first})"
    return line
