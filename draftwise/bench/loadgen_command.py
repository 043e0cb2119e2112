"""`draftwise loadgen`: the command's options, checked into a LoadPlan, and the run that writes its results.

The load generator itself is loadgen.py (the HTTP driver) and the modules beside it (load_plan, load_record,
load_stats, load_report); argparse stays here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys

from draftwise.bench.load_plan import MODES, SEED_SPAN, LoadPlan, base_url
from draftwise.bench.load_record import RequestRecord
from draftwise.bench.load_report import markdown_table, throttle_table, write_results
from draftwise.bench.load_server import SERVER_CHOICES
from draftwise.bench.load_stats import summarise
from draftwise.bench.loadgen import API_KEY_ENV, run_load
from draftwise.bench.prompts import default_prompts, load_prompts, select_prompts
from draftwise.errors import DraftwiseError
from draftwise.extras import need
from draftwise.files import prepare_out


def add_loadgen(commands, formatter) -> None:
    p = commands.add_parser(
        "loadgen",
        formatter_class=formatter,
        help="drive a live server over HTTP at several concurrencies, speculation on and off",
        description=(
            "Stream the bench's prompts to a running draftwise server (or any OpenAI-compatible one), with\n"
            "exactly C requests in flight at each --concurrency C. Within a level, each mode runs in turn: on\n"
            "(the server's default method, or each of --methods, its draft length adapting to acceptance and\n"
            "load), always (the same, drafting its full k every round: speculation {adaptive: false}) and off\n"
            "(the target alone: speculation {method: none}), side by side for each method, so that its on is\n"
            "judged against an off of the same minutes. With --repeats R the round of cells runs R times, in\n"
            "pairs of repeats whose second runs the first's order backwards (each pair rotated), so that a\n"
            "steady drift of the machine weighs on all alike; with --slices S each cell's requests run in S\n"
            "parts, a method's modes taking turns part by part. Each cell\n"
            "starts (its first run only) with C warm-up requests at once, not counted, so that the server has\n"
            "timed the level's batch shapes before any cell is measured; then --requests requests; a failed\n"
            "request is counted, never retried. Greedy (temperature 0) unless --temperature T: then every\n"
            "request is sampled at T, request i of a level seeded with --seed + i.\n"
            "\n"
            "Against a server that is not draftwise (found from /v1/models, and llama-server from its /props,\n"
            "or as --server says) only --speculation on runs, and no `speculation` field is sent: the\n"
            "report names the server measured.\n"
            "\n"
            "Per cell and level: aggregate tokens/s (completion tokens of the requests that succeeded over the\n"
            "run's wall time), p50/p95 time to first token (TTFT), p50/p95 time between tokens (TBT, the gaps\n"
            "between one request's consecutive chunks, pooled), and the acceptance the server reports; with\n"
            "repeats, the median tok/s and its range. The throttle's verdict per method and level: on over the\n"
            "better of always and off, repeat by repeat, which should be at least 0.95.\n"
            "\n"
            "Writes results.json (every request, raw, and the summary rows), report.md (the table) and\n"
            "loadgen.png under --out; prints the table on stdout, progress on stderr."
        ),
        epilog=(
            "examples:\n"
            "  draftwise serve --port 8000 &\n"
            "  draftwise loadgen --url http://127.0.0.1:8000 --concurrency 1,2,4,8 --max-tokens 64\n"
            "  draftwise loadgen --url http://127.0.0.1:8000 --speculation off --categories summarization\n"
            "  draftwise loadgen --url http://127.0.0.1:8000 --method lookup --no-chat --json\n"
            "  draftwise loadgen --url http://127.0.0.1:8000 --methods draft,lookup,hybrid \\\n"
            "      --speculation on,always,off --repeats 3\n"
            "  llama-server -m TARGET.gguf -md DRAFT.gguf -np 4 --port 8080 &\n"
            "  draftwise loadgen --url http://127.0.0.1:8080 --speculation on --temperature 0.7 --concurrency 1,4\n"
            "\n"
            "a run sends about (levels x cells x (repeats x requests + 1)) requests, a cell being a mode and a\n"
            "method (off: one cell); by default every level sends each\n"
            "selected prompt once (28 with --per-category 4), so start small with --per-category 1\n"
            "--concurrency 1,2 --max-tokens 16."
        ),
    )
    server = p.add_argument_group("server")
    server.add_argument("--url", required=True, metavar="URL",
                        help="the server's base address, http:// or https:// (a trailing /v1 is fine), "
                             "e.g. http://127.0.0.1:8000")
    server.add_argument("--api-key", metavar="KEY", help=f"sent as a bearer token (default: ${API_KEY_ENV})")
    server.add_argument("--model", metavar="ID", help="the model id to ask for (default: the first of /v1/models)")
    server.add_argument("--server", choices=SERVER_CHOICES, default="auto",
                        help="what the server is: 'auto' asks it (/v1/models, /props), 'plain' an OpenAI-compatible "
                             "server that takes no draftwise field (--speculation on only), 'draftwise' one that "
                             "takes the `speculation` field (default: %(default)s)")
    server.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds one request may take in all before it counts as failed (default: %(default)s)")
    work = p.add_argument_group("workload")
    work.add_argument("--concurrency", default="1,2,4,8", metavar="C,C,...",
                      help="comma-separated numbers of requests in flight (default: %(default)s)")
    work.add_argument("--speculation", default="on,off", metavar="MODE,...",
                      help=f"comma-separated modes, from: {', '.join(MODES)} (default: %(default)s)")
    work.add_argument("--methods", "--method", dest="methods", metavar="NAME,...",
                      help="in modes on and always, ask for each of these speculation methods in turn, "
                           "comma-separated (default: the server's own); the server must offer them (the warm-up "
                           "of one it lacks stops the run with the list it offers). METHOD:DRAFT drafts with a "
                           "version loaded beside the server's draft (a trial's), e.g. hybrid,hybrid:NAME@v1")
    work.add_argument("--repeats", type=int, default=1, metavar="N",
                      help="run every level's cells N times, interleaved (default: %(default)s)")
    work.add_argument("--slices", type=int, default=1, metavar="N",
                      help="run each cell's requests in N consecutive slices, a method's modes taking turns "
                           "slice by slice (mirrored), so that on and off are compared over seconds rather than "
                           "a whole cell's minute: a shared machine's drift then weighs on them alike; a slice "
                           "never holds fewer requests than the concurrency (default: %(default)s)")
    work.add_argument("--requests", type=int, metavar="N",
                      help="requests per mode and level, the same prompts at every level so that levels "
                           "compare, raised to the concurrency where below it (default: one per prompt, "
                           "at least the largest concurrency)")
    work.add_argument("--max-tokens", type=int, default=64, metavar="N",
                      help="max_tokens of every request (default: %(default)s)")
    work.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="sample every request at T, 0-2 (default: %(default)s, greedy)")
    work.add_argument("--top-p", type=float, metavar="P",
                      help="with --temperature: nucleus sampling's top_p, sent to every server so that none "
                           "applies its own default (default: 1, the whole distribution)")
    work.add_argument("--seed", type=int, metavar="S",
                      help="with --temperature: request i of a level sends seed S + i, the same at every level and "
                           "cell, so that a run repeats where the server honours seeds (default: 0)")
    work.add_argument("--categories", default="all", metavar="C,C,...",
                      help="the bench's prompt categories, comma-separated, or 'all' (default: %(default)s)")
    work.add_argument("--per-category", type=int, default=4, metavar="N",
                      help="first N prompts of each category (default: %(default)s)")
    work.add_argument("--prompts", metavar="FILE",
                      help="a JSONL file of {question_id, category, turns} instead of the built-in set")
    work.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                      help="POST /v1/chat/completions with the prompt as a user message; --no-chat: "
                           "/v1/completions with the raw prompt (default: chat)")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="loadgen-results", metavar="DIR", help="output folder (default: %(default)s)")
    out.add_argument("--json", action="store_true", help="print the summary rows as JSON on stdout")
    p.set_defaults(func=cmd_loadgen)


def plan_from_args(args: argparse.Namespace) -> LoadPlan:
    """Check every option before anything touches the network; a bad one is a DraftwiseError naming it."""
    _at_least("--requests", args.requests, 1, allow_none=True)
    _at_least("--max-tokens", args.max_tokens, 1)
    _at_least("--repeats", args.repeats, 1)
    _at_least("--slices", args.slices, 1)
    if not (math.isfinite(args.timeout) and args.timeout > 0):  # (a run must end by itself)
        raise DraftwiseError(f"--timeout must be a number of seconds > 0, got {args.timeout!r}")
    modes = tuple(dict.fromkeys(m.strip() for m in args.speculation.split(",") if m.strip()))
    if not modes or any(m not in MODES for m in modes):
        raise DraftwiseError(f"--speculation takes a comma list of: {', '.join(MODES)}; got {args.speculation!r}")
    methods = tuple(dict.fromkeys(m.strip() for m in (args.methods or "").split(",") if m.strip())) or (None,)
    unnamed = [m for m in methods if m and ":" in m and not all(m.partition(":")[::2])]  # METHOD:DRAFT, both named
    if (args.methods is not None and methods == (None,)) or unnamed:
        raise DraftwiseError(f"--methods takes a comma list of method names, each optionally METHOD:DRAFT, got "
                             f"{args.methods!r}")
    sampling = _sampling(args)
    prompts = load_prompts(args.prompts) if args.prompts else default_prompts()
    return LoadPlan(
        url=base_url(args.url), levels=_int_list(args.concurrency, "--concurrency"), modes=modes,
        prompts=tuple(select_prompts(prompts, args.categories, args.per_category)), requests=args.requests,
        max_tokens=args.max_tokens, chat=args.chat, methods=methods, repeats=args.repeats, slices=args.slices,
        model=args.model, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, timeout=args.timeout,
        server=args.server, **sampling,
    )


def _sampling(args: argparse.Namespace) -> dict:
    """--temperature, --top-p and --seed, checked; the last two mean nothing to a greedy run, which refuses them."""
    t = args.temperature
    if not (math.isfinite(t) and 0 <= t <= 2):
        raise DraftwiseError(f"--temperature must be a number from 0 to 2, got {t!r}")
    if t == 0:
        given = [name for name, value in (("--top-p", args.top_p), ("--seed", args.seed)) if value is not None]
        if given:
            raise DraftwiseError(f"{' and '.join(given)} apply to sampled runs only: give --temperature T > 0")
        return {"temperature": 0.0}
    top_p = 1.0 if args.top_p is None else args.top_p
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise DraftwiseError(f"--top-p must be a number in (0, 1], got {args.top_p!r}")
    if args.seed is not None and not 0 <= args.seed < SEED_SPAN:
        raise DraftwiseError(f"--seed must be an integer from 0 to {SEED_SPAN - 1}, got {args.seed!r}")
    return {"temperature": t, "top_p": top_p, "seed": args.seed or 0}


def without_secrets(argv: list[str]) -> list[str]:
    """argv as the report keeps it: an --api-key's value is a secret, and reports are shared (the variable that
    holds it is named instead)."""
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--api-key":
            arg = f"${API_KEY_ENV}"
        elif arg.startswith("--api-key="):
            arg = f"--api-key=${API_KEY_ENV}"
        out.append(arg)
    return out


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise DraftwiseError(f"{name} takes a comma list of integers >= 1, got {text!r}")
    return tuple(dict.fromkeys(values))


def _at_least(name: str, value, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < low:
        raise DraftwiseError(f"{name} must be an integer >= {low}, got {value!r}")


def cmd_loadgen(args: argparse.Namespace) -> int:
    need("bench", what="draftwise loadgen")  # httpx for the requests, matplotlib for the plot
    plan = plan_from_args(args)
    out = prepare_out(args.out, "results.json, report.md and the plot")  # before the run, not after it
    records: list[RequestRecord] = []
    found: dict = {}
    try:
        asyncio.run(run_load(plan, records=records, found=found))
    finally:  # a level that failed (the server went away) or Ctrl-C: the levels already run are kept
        rows = summarise(records)
        if records:
            write_results(out, plan, records, rows,
                          command="draftwise " + " ".join(shlex.quote(a) for a in without_secrets(sys.argv[1:])),
                          server=found.get("server"))
            print(f"loadgen: wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'loadgen.png'}",
                  file=sys.stderr)
    verdicts = throttle_table(rows)
    print(json.dumps(rows, indent=1) if args.json else markdown_table(rows) + (f"\n\n{verdicts}" if verdicts else ""))
    return 0
