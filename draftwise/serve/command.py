"""`draftwise serve`: its options and its handler. The HTTP stack (fastapi, uvicorn: the `serve` extra) is imported
when the command runs, never when the parser is built."""
from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from draftwise import options
from draftwise.config import DEFAULT_DRAFT, GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.extras import need


def add_serve(commands, formatter) -> None:
    p = commands.add_parser(
        "serve",
        formatter_class=formatter,
        help="serve a model over OpenAI's HTTP API, many requests batched into each step",
        description=(
            "An OpenAI-compatible server: /v1/models, /v1/completions, /v1/chat/completions (streaming with\n"
            "stream: true), /health, /metrics (Prometheus) and /dashboard (live charts). Every running request is\n"
            "drafted for and verified in one batched target pass per step; requests join and leave between\n"
            "steps. Greedy output is the target's own, alone or in a batch. Per request, the extra body field\n"
            "\"speculation\" picks the method and draft length, or turns speculation off; the response's\n"
            "\"draftwise\" field has the request's own acceptance stats. SIGTERM or Ctrl-C drains: running requests finish (up to\n"
            "--drain-timeout), new ones get 503; a second signal stops at once."
        ),
        epilog=(
            "examples:\n"
            "  draftwise serve --port 8000\n"
            "  draftwise serve --target ./my-hf-folder --draft none --method lookup --api-key s3cret\n"
            "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
            "      -d '{\"model\": \"qwen2.5-coder-1.5b-instruct\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}'\n"
            "  # chat, streamed, with this request's own speculation settings (or \"speculation\": false):\n"
            "  curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            "      -d '{\"model\": \"qwen2.5-coder-1.5b-instruct\", \"stream\": true, \"max_tokens\": 64,\n"
            "           \"messages\": [{\"role\": \"user\", \"content\": \"Write quicksort in Python.\"}],\n"
            "           \"speculation\": {\"method\": \"draft\", \"num_draft_tokens\": 6}}'\n"
            "  # python: openai.OpenAI(base_url=\"http://127.0.0.1:8000/v1\", api_key=\"unused\")\n"
            "  curl -s http://127.0.0.1:8000/metrics | grep draftwise_accepted"
        ),
    )
    m = p.add_argument_group("models")
    options.add_target(m, role="the model served")
    options.add_draft(m, default=DEFAULT_DRAFT, also="; 'none' for no draft model")
    options.add_method(m, role="the method loaded, and run for the requests that do not choose one")
    options.add_head(m)
    options.add_dtype(m)
    options.add_backend(m)
    options.add_batch_invariant(m)
    options.add_device(m)
    options.add_lookup_ngram(m)
    m.add_argument("--model-id", help="the model name clients send (default: --target)")
    r = p.add_argument_group("speculation (of the requests that leave out the \"speculation\" field)")
    options.add_draft_length(r)
    r.add_argument("--experiment", metavar="ARMS.toml",
                   help="A/B arms: split the requests that leave out \"speculation\" between speculation settings "
                        "by weight ([[arm]] tables of name, weight, speculation; `by = \"user\"` gives each value "
                        "of that request field one arm for good). Metrics, the proposal log and each response's "
                        "\"draftwise\" field carry the arm; `draftwise log stats` compares them")
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 exposes the server to "
                        "the network: set --api-key)")
    n.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    n.add_argument("--api-key", default=os.environ.get("DRAFTWISE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$DRAFTWISE_API_KEY; none when unset)")
    n.add_argument("--trust-request-special-tokens", action="store_true",
                   help="read control tokens written as text in a request's prompt or messages (<|im_end|>, "
                        "<|im_start|>) as the tokens themselves, and take any role a message names: every client "
                        "can then write system turns of its own. By default that text is plain text and roles "
                        "are those the chat template knows. Only for clients you trust as you trust yourself")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-batch", type=int, default=8, help="most requests running in one step (default: 8)")
    s.add_argument("--max-waiting", type=int, default=64,
                   help="most requests waiting to join; more get 429 with Retry-After (default: 64)")
    s.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens prefilled per step, so a long prompt does not stall the others "
                        "(default: 128)")
    g = p.add_argument_group("guard")
    g.add_argument("--guard", metavar="MODULE:FUNCTION",
                   help="called as FUNCTION(request_body, text_so_far) before text is streamed; returning "
                        "'block' or False ends the response with finish_reason content_filter")
    g.add_argument("--block-regex", metavar="REGEX",
                   help="a built-in guard: block a response whose text matches REGEX (Python's re)")
    g.add_argument("--guard-window", type=int, default=64, metavar="CHARS",
                   help="characters held back before sending, so a blocked phrase of up to CHARS characters "
                        "is caught before any of it leaves (default: %(default)s)")
    s.add_argument("--draft-timeout-ms", type=float, metavar="MS",
                   help="a step whose drafting takes longer puts its sequences on the target alone for the rest "
                        "of their requests (still exact; counted in draftwise_proposer_fallbacks_total); a "
                        "proposer that raises always does (default: no limit)")
    s.add_argument("--proposal-log", metavar="PATH",
                   help="record every proposed token of every round in this SQLite file, off the hot path "
                        "(read it with `draftwise log stats PATH`; export training pairs with `draftwise log "
                        "export`)")
    s.add_argument("--proposal-log-rows", type=int, default=5_000_000, metavar="N",
                   help="most rows the proposal log keeps; the oldest go first (default: %(default)s)")
    s.add_argument("--capture-features", metavar="DIR",
                   help="keep what a feature head learns from, as the target computes it while serving: its last "
                        "hidden state at every position of each finished request, one file per request, for "
                        "`draftwise train-head --captured DIR` (users' text: folder 0700, files 0600)")
    s.add_argument("--capture-features-mb", type=float, default=2048, metavar="MB",
                   help="size budget of --capture-features; the earliest requests' files go first (default: "
                        "%(default)s)")
    s.add_argument("--proposal-log-days", type=float, metavar="DAYS",
                   help="keep the proposal log's rows (users' prompts and outputs, as token ids) this many days "
                        "at most; `draftwise log purge` deletes on demand (default: kept until --proposal-log-rows)")
    s.add_argument("--prompt-cache-mb", type=float, default=1024, metavar="MB",
                   help="keep the keys and values of finished requests' texts, up to this many MB for target and "
                        "draft together, and reuse them for prompts that start the same way (a chat's next turn, a "
                        "shared system prompt); the least recently used go first; 0 turns it off "
                        "(default: %(default)s)")
    s.add_argument("--proposal-cache-tokens", type=int, default=0, metavar="N",
                   help="let prompt lookup (methods lookup, lookup-tree and the hybrids) propose from the texts of earlier requests too, "
                        "the last N tokens of them: templated traffic repeats spans no single prompt holds; 0 turns "
                        "it off (default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default: 30)")
    d = p.add_argument_group("replicas (on Ray Serve: pip install 'draftwise[ray]')")
    d.add_argument("--replicas", type=int, metavar="N",
                   help="serve N replicas behind one endpoint, each one engine with its own batching scheduler, on "
                        "a Ray cluster: a local one, or --ray-address's. Requests go to the replica whose prompt "
                        "cache holds the longest prefix of them unless it is much busier (--routing). Without it, "
                        "one process serves and Ray is not imported")
    d.add_argument("--max-replicas", type=int, metavar="M",
                   help="autoscale between --replicas and M replicas on the requests in flight per replica "
                        "(default: a fixed --replicas)")
    d.add_argument("--target-ongoing-requests", type=float, default=4.0, metavar="R",
                   help="the requests in flight per replica that autoscaling aims at (default: %(default)s)")
    d.add_argument("--threads-per-replica", type=int, metavar="T",
                   help="CPU threads (and Ray CPUs) each replica takes (default: this machine's cores / --replicas)")
    d.add_argument("--routing", choices=("prefix", "pow2"), default="prefix",
                   help="prefix: the replica whose prompt cache is warm for the request, unless much busier; "
                        "pow2: the less busy of two random replicas, Ray's default (default: %(default)s)")
    d.add_argument("--ray-address", metavar="ADDRESS",
                   help="join this Ray cluster ('auto': the one started on this machine by `ray start`) instead of "
                        "starting a local one")
    p.set_defaults(func=cmd_serve)


def request_defaults(args: argparse.Namespace) -> dict:
    """The speculation options of the requests that leave them out (-k, --fixed-k), checked as a request's are."""
    options.check_lookup_ngram(args)
    defaults = dict(num_draft_tokens=args.num_draft_tokens, adaptive=not args.fixed_k)
    GenerationConfig.from_options(**defaults)
    return defaults


def _check_limits(args: argparse.Namespace) -> None:
    """The numeric options, checked before the models load for minutes, each error naming its flag."""
    if args.proposal_log_days is not None and not (math.isfinite(args.proposal_log_days) and args.proposal_log_days > 0):
        raise DraftwiseError(f"--proposal-log-days must be a number of days > 0, got {args.proposal_log_days}")
    if args.proposal_log_days is not None and not args.proposal_log:
        raise DraftwiseError("--proposal-log-days limits the proposal log: give --proposal-log PATH too")
    least = {"--max-batch": (args.max_batch, 1, ""), "--prefill-chunk": (args.prefill_chunk, 1, ""),
             "--max-waiting": (args.max_waiting, 0, " (0: every request that cannot run at once gets 429)"),
             "--proposal-cache-tokens": (args.proposal_cache_tokens, 0, " (0 turns it off)"),
             "--prompt-cache-mb": (args.prompt_cache_mb, 0, " (0 turns the prompt cache off)"),
             "--drain-timeout": (args.drain_timeout, 0, ""), "--capture-features-mb": (args.capture_features_mb, 1, "")}
    for flag, (value, low, note) in least.items():
        if not (math.isfinite(value) and value >= low):  # (a float flag takes "nan" and "inf")
            raise DraftwiseError(f"{flag} must be a number >= {low}{note}, got {value}")
    if args.draft_timeout_ms is not None and not (math.isfinite(args.draft_timeout_ms) and args.draft_timeout_ms > 0):
        raise DraftwiseError(f"--draft-timeout-ms must be a number > 0 (leave it out for no timeout), "
                             f"got {args.draft_timeout_ms}")
    if args.api_key is not None and not args.api_key.strip():  # an empty key would quietly turn the check off
        raise DraftwiseError("--api-key (or $DRAFTWISE_API_KEY) is empty: give a key, or leave both unset to serve "
                             "without one")


def _feature_capture(args: argparse.Namespace, engine):
    """The --capture-features folder's writer, or None; an error where the target's backend gives no hidden states."""
    if not args.capture_features:
        return None
    from draftwise.methods import BACKENDS, INTERNALS
    from draftwise.serve.feature_capture import FeatureCapture

    if INTERNALS not in BACKENDS[engine.target.backend_name]:
        raise DraftwiseError(f"--capture-features needs the target's hidden states, which the "
                             f"{engine.target.backend_name} backend does not give; serve with --backend quant or hf")
    return FeatureCapture(args.capture_features, int(args.capture_features_mb * 2**20))


@dataclass
class Served:
    """One server's parts, built from `draftwise serve`'s options: the single process's, or one replica's."""
    engine: object
    scheduler: object
    app: object
    model_id: str
    log: object = None  # the proposal log, closed after the model loop ends
    capture: object = None  # the --capture-features writer, likewise
    experiment: object = None

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.capture is not None:
            self.capture.close()


def check_serve_options(args: argparse.Namespace) -> dict:
    """Every option checked before anything is opened or loaded; the requests' speculation defaults."""
    speculation = request_defaults(args)
    _check_limits(args)
    return speculation


def build_server(args: argparse.Namespace) -> Served:
    """Load the models and put the scheduler and the HTTP app around them. Call it on the thread that will run
    the model loop (scheduler.run): that thread's OpenMP team is the one the models' kernels use."""
    from draftwise import Engine
    from draftwise.serve.app import create_app
    from draftwise.serve.experiment import Experiment
    from draftwise.serve.guard import load_guard
    from draftwise.serve.metrics import ServeMetrics
    from draftwise.serve.proposal_log import ProposalLog
    from draftwise.serve.scheduler import Scheduler

    speculation = check_serve_options(args)
    draft = None if args.draft in (None, "none") else args.draft
    # A bad guard, arms file or log path fails here, before the models load.
    guard = load_guard(args.guard, args.block_regex, args.guard_window)
    experiment = Experiment.load(args.experiment) if args.experiment else None
    max_age_s = None if args.proposal_log_days is None else args.proposal_log_days * 86400
    log = ProposalLog(args.proposal_log, max_rows=args.proposal_log_rows, max_age_s=max_age_s) \
        if args.proposal_log else None
    engine = Engine.from_pretrained(args.target, draft, args.method, **options.engine_options(args))
    capture = _feature_capture(args, engine)
    if args.prompt_cache_mb:
        engine.enable_prompt_cache(int(args.prompt_cache_mb * 2**20))
    if args.proposal_cache_tokens:
        engine.enable_proposal_cache(args.proposal_cache_tokens)
    if experiment is not None:
        experiment.check(engine.methods_available)  # e.g. an arm of method "draft" on a server without a draft
    metrics = ServeMetrics(experiment.labels if experiment is not None else ("",))
    scheduler = Scheduler(engine, max_batch=args.max_batch, max_waiting=args.max_waiting,
                          prefill_chunk=args.prefill_chunk, metrics=metrics, proposal_log=log,
                          draft_timeout_s=None if args.draft_timeout_ms is None else args.draft_timeout_ms / 1000,
                          guard=guard, feature_capture=capture)
    model_id = args.model_id or args.target
    rollouts = None
    if engine.draft_maker is not None and experiment is None and args.replicas is None:
        # (a draft that another could be tried beside; a trial across replicas would need one judge for all)
        from draftwise.loading import draft_version_loader
        from draftwise.models import check_resolves
        from draftwise.serve.rollout import Rollouts

        rollouts = Rollouts(engine, draft_version_loader(engine, args.device), check=check_resolves)
    app = create_app(scheduler, model_id, metrics, args.api_key, speculation, args.drain_timeout, experiment,
                     trust_request_special_tokens=args.trust_request_special_tokens, rollouts=rollouts)
    return Served(engine, scheduler, app, model_id, log, capture, experiment)


def cmd_serve(args: argparse.Namespace) -> int:
    need("serve", what="draftwise serve")
    if args.replicas is not None:
        check_serve_options(args)  # (before Ray starts)
        from draftwise.serve.replicas import serve_replicas

        return serve_replicas(args, build_server)
    import uvicorn

    from draftwise.serve.http_server import DrainingServer

    served = build_server(args)
    scheduler = served.scheduler
    print(f"draftwise: serving {served.model_id} ({served.engine.method}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    if served.experiment is not None:
        print(f"draftwise: experiment {args.experiment}: {served.experiment.describe()}", file=sys.stderr)
    server = DrainingServer(uvicorn.Config(served.app, host=args.host, port=args.port, log_level="warning"),
                            scheduler, args.drain_timeout)
    # The model loop runs here, on the thread that loaded the models, and HTTP on another: every thread that runs
    # torch gets its own OpenMP team, and two teams contending for the same few cores slow every forward.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http = threading.Thread(target=server.run_then_stop, name="draftwise-http", daemon=True)
    http.start()
    try:
        scheduler.run()  # until the server stops it: drained after a signal, or uvicorn failed to start
    finally:
        server.should_exit = True
        http.join(timeout=10)
        served.close()
    return 0 if server.started else 1


def serve_in_thread(app, host: str = "127.0.0.1") -> tuple[str, Callable[[], None]]:
    """Run app on a free port of host in a daemon thread: (base URL, stop()). For tests and the load driver.

    The socket is bound here, before uvicorn starts, so no other process can take the port in between."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="draftwise-uvicorn")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://{host}:{port}", stop
