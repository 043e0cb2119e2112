"""`draftwise serve --replicas N`: N draftwise servers behind one endpoint, on Ray Serve.

Ray Serve runs the parts: an ingress (a thin relay behind Ray's HTTP proxy), N replicas (each one
engine with its own continuous-batching scheduler and the very app of the single-process server, app.py, run in
process by asgi_call.py), a request router in front of the replicas, autoscaling, health checks and restarts.
Ours are the routing policy and the views of the whole:

- PrefixAffinityRouter sends a request to the replica that was sent the longest prefix of its text (its prompt
  cache is warm there: a chat's next turn, a shared system prompt) unless that replica is much busier; else
  power of two choices, Ray's default.
- The ingress retries a request on another replica when its replica died before any of the response went out,
  and ends a stream that loses its replica with an error event, never a silent end.
- /metrics sums the replicas' counters and histograms and labels their gauges by replica (metrics_merge.py),
  from the expositions each replica posts to a MetricsBoard actor every second; /dashboard draws those sums.

Ray is imported only here, and only `--replicas` imports this module.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import signal
import sys
import threading
import time

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from draftwise.errors import DraftwiseError
from draftwise.extras import need
from draftwise.serve.routes.body import MAX_BODY_BYTES
from draftwise.serve.asgi_call import HTTPCall, ResponseStart, run_call
from draftwise.serve.dashboard import MetricsHistory, dashboard_data
from draftwise.serve.metrics_merge import FixedCollector, merge_metrics, merged_families
from draftwise.serve.prefix_routing import PrefixIndex, routing_text

need("ray", what="draftwise serve --replicas (the replicas run on Ray Serve)")  # (an extra: say how to get it)
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.exceptions import RayError  # noqa: E402
from ray.serve.config import AutoscalingConfig, RequestRouterConfig  # noqa: E402
from ray.serve.request_router import FIFOMixin, RequestRouter  # noqa: E402
from ray.serve.schema import LoggingConfig  # noqa: E402

log = logging.getLogger(__name__)

APP_NAME = "draftwise"
NAMESPACE = "draftwise"
BOARD = "draftwise-metrics"
METRICS_EVERY_S = 1.0
STALE_S = 15.0  # a replica that has not posted its metrics for this long is gone (dead, or scaled down)
REPLICA_HEADER = b"x-draftwise-replica"
WHOLE_VIEWS = ("/metrics", "/dashboard/data")  # answered from every replica's metrics, not the one relayed to
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


# -- the replicas' metrics, gathered ---------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class MetricsBoard:
    """Each replica's latest /metrics exposition, by replica."""

    def __init__(self):
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def texts(self) -> dict[str, str]:
        now = time.monotonic()
        self._texts = {r: (at, t) for r, (at, t) in self._texts.items() if now - at < STALE_S}
        return {r: t for r, (_, t) in self._texts.items()}


# -- one replica -----------------------------------------------------------------------------------------------
def _model_loop(build, args, ready: concurrent.futures.Future) -> None:
    """Load the models and run the model loop, on this one thread: the OpenMP team that loads them is the one
    whose threads run every forward (a second team on the same cores slows each one; serve/command.py)."""
    import torch

    try:
        torch.set_num_threads(args.threads_per_replica)
        served = build(args)
    except BaseException as err:  # noqa: BLE001 (the replica's constructor raises it)
        ready.set_exception(err)
        return
    ready.set_result(served)
    try:
        served.scheduler.run()  # until drained
    finally:
        served.close()


class DraftwiseReplica:
    """One draftwise server: engine, scheduler and app; HTTP calls arrive from the ingress over Ray."""

    async def __init__(self, build, args):
        """build(args): the server's parts (serve/command.py's build_server), made on the model loop's thread."""
        self.name = serve.get_replica_context().replica_id.unique_id
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._model = threading.Thread(target=_model_loop, args=(build, args, ready), name="draftwise-model",
                                       daemon=True)
        self._model.start()
        self.served = await asyncio.wrap_future(ready)
        self.app = self.served.app
        self._lifespan = self.app.router.lifespan_context(self.app)  # the dashboard's sampling; drain at the end
        await self._lifespan.__aenter__()
        self._poster = asyncio.create_task(self._post_metrics())

    async def serve_http(self, call: HTTPCall):
        async for part in run_call(self.app, call):
            if isinstance(part, ResponseStart):  # which replica answered: for operators, and for routing's tests
                part = ResponseStart(part.status, [*part.headers, (REPLICA_HEADER, self.name.encode())])
            yield part

    def check_health(self) -> None:
        if not self._model.is_alive():
            raise RuntimeError("the model loop has stopped")

    async def _post_metrics(self) -> None:
        metrics, board = self.app.state.metrics, None
        while True:
            try:
                board = board or _board()
                await board.put.remote(self.name, metrics.render()[0].decode())
            except (RayError, ValueError) as err:  # (no board, or it went away: the deployment is torn down)
                board = None
                log.debug("metrics not posted: %s", err)
            await asyncio.sleep(METRICS_EVERY_S)

    async def __del__(self):
        """Ray stops sending to a replica it stops and lets its requests finish; then this drains what is left."""
        self._poster.cancel()
        await self._lifespan.__aexit__(None, None, None)
        await asyncio.to_thread(self._model.join, 30)


# -- routing ---------------------------------------------------------------------------------------------------
class PrefixAffinityRouter(RequestRouter):
    """The replica that was sent the longest prefix of a request's text first, unless it has `imbalance` more
    requests in flight than the least busy; then, or with no prefix known, two random replicas (Ray probes both
    and takes the less busy). Not first-in-first-out (FIFOMixin): that hands the replica chosen for one request
    to whichever request waits longest, and a chat's next turn would land where another's cache is."""

    def initialize_state(self, imbalance: int = 4, max_blocks: int = 200_000):
        self.imbalance = imbalance
        self.index = PrefixIndex(max_blocks)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        two = _two(candidate_replicas)
        text = _text(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        best, _ = self.index.longest(text, by_id) if text else (None, 0)
        if best is None:
            return [two]
        queue = self.replica_queue_len_cache
        least = min((queue.get(r) or 0) for r in by_id)
        if (queue.get(best) or 0) > least + self.imbalance:
            return [two]
        return [[by_id[best]], [r for r in two if r.replica_id != best] or two]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        text = _text(pending_request)
        if text:
            self.index.add(replica_id, text)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)


class PowerOfTwoRouter(FIFOMixin, RequestRouter):
    """Ray's default policy without locality: two random replicas, the less busy taken (the baseline)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        return [_two(candidate_replicas)] if candidate_replicas else []


def _two(candidates: list) -> list:
    """Two of the candidates at random (or the one there is): power of two choices' draw."""
    return random.sample(candidates, min(2, len(candidates)))


def _text(pending_request) -> str:
    call = pending_request.args[0] if pending_request is not None and pending_request.args else None
    return routing_text(call.path, call.body) if isinstance(call, HTTPCall) else ""


ROUTERS = {"prefix": PrefixAffinityRouter, "pow2": PowerOfTwoRouter}


# -- the ingress -----------------------------------------------------------------------------------------------
class Ingress:
    """Relays each HTTP request to a replica and its response back, as it comes."""

    async def __init__(self, replicas, retries: int = 1):
        self.replicas, self.retries = replicas, retries
        # The dashboard of the whole deployment: its history sampled from the replicas' merged metrics.
        self.merged = FixedCollector([])
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.merged)
        self.history = MetricsHistory(registry)
        self._sampler = asyncio.create_task(self._sample_forever())

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.merged.families = merged_families(await _board().texts.remote())
                self.history.sample()
            except (RayError, ValueError) as err:  # (no board yet, or it is gone: the next reading will tell)
                log.debug("no metrics to sample: %s", err)
            await asyncio.sleep(self.history.interval_s)

    async def __call__(self, request: Request) -> Response:
        if request.url.path.startswith("/admin/drafts"):  # (each replica would judge its own trial)
            return JSONResponse({"error": {
                "message": "draft trials (POST /admin/drafts) run on a single-process server; a server with "
                           "--replicas has none", "type": "invalid_request_error", "param": None,
                "code": "no_rollouts"}}, status_code=404)
        call = HTTPCall(request.method, request.url.path, request.url.query.encode(), list(request.headers.raw),
                        await _bounded_body(request))
        for attempt in range(self.retries + 1):
            stream = self.replicas.options(stream=True).serve_http.remote(call)
            try:
                start: ResponseStart = await stream.__anext__()
                first = await _next(stream)
                break
            except RayError as err:  # its replica failed before any of the response went out: another may serve it
                stream.cancel()
                log.warning("a replica failed on %s %s (%s); %s", call.method, call.path, type(err).__name__,
                            "retrying on another" if attempt < self.retries else "giving up")
                if attempt == self.retries:
                    return _replica_lost(err)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() not in HOP_HEADERS}
        if call.path in WHOLE_VIEWS and start.status == 200:  # (the replica checked the API key)
            stream.cancel()
            if call.path == "/metrics":
                return Response(merge_metrics(await _board().texts.remote()), media_type=headers["content-type"])
            return JSONResponse(dashboard_data(self.history))
        if attempt:
            headers["x-draftwise-retried"] = str(attempt)  # (served again after its first replica failed)
        if first is None:
            return Response(b"", status_code=start.status, headers=headers)
        streaming = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(first, stream, streaming), status_code=start.status, headers=headers)


async def _bounded_body(request: Request) -> bytes:
    """The body, read up to one byte past the server's limit: the replica refuses a longer one (413)."""
    body = bytearray()
    if int(request.headers.get("content-length") or 0) <= MAX_BODY_BYTES:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                break
    return bytes(body)


def _board():
    return ray.get_actor(BOARD, namespace=NAMESPACE)


async def _next(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _rest(first: bytes, stream, event_stream: bool):
    done = False
    try:
        yield first
        async for chunk in stream:
            yield chunk
        done = True
    except RayError as err:  # its replica died mid-response: say so, as the server says a failure in a stream
        done = True
        log.warning("a replica failed while streaming a response (%s)", type(err).__name__)
        if event_stream:
            yield f"data: {json.dumps(_replica_lost_body(err))}\n\n".encode()
        # (a whole response is one chunk, so only a stream can end here; it ends without its [DONE])
    finally:
        if not done:
            stream.cancel()  # the client left: the replica's request is cancelled, its slot freed


def _replica_lost_body(err: Exception) -> dict:
    return {"error": {"message": f"the replica serving this request failed ({type(err).__name__}); retry it",
                      "type": "server_error", "param": None, "code": "replica_failed"}}


def _replica_lost(err: Exception) -> JSONResponse:
    return JSONResponse(_replica_lost_body(err), status_code=503, headers={"Retry-After": "1"})


# -- the application -------------------------------------------------------------------------------------------
def build_app(build, args):
    """The Ray Serve application of `draftwise serve --replicas N`. args: serve's parsed options; build(args): one
    server's parts (serve/command.py's build_server)."""
    low, high = args.replicas, args.max_replicas or args.replicas
    quiet = LoggingConfig(enable_access_log=False)  # (Ray logs a line per call: two per request)
    replica_options = dict(
        logging_config=quiet,
        ray_actor_options={"num_cpus": args.threads_per_replica},
        max_ongoing_requests=args.max_batch * 2,  # a full batch and as many waiting; the rest wait in the router
        graceful_shutdown_timeout_s=args.drain_timeout,
        health_check_period_s=5,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[args.routing]),
    )
    if high > low:
        replica_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=low,
            target_ongoing_requests=args.target_ongoing_requests)
    else:
        replica_options["num_replicas"] = low
    replicas = serve.deployment(DraftwiseReplica, name="DraftwiseReplica", **replica_options).bind(build, args)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1,
                               max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}, logging_config=quiet)
    return ingress.bind(replicas)


def check_replica_options(args) -> None:
    if args.replicas < 1:
        raise DraftwiseError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise DraftwiseError(f"--max-replicas ({args.max_replicas}) must be >= --replicas ({args.replicas}), the "
                             "fewest replicas autoscaling keeps")
    if args.threads_per_replica is None:
        args.threads_per_replica = max(1, (os.cpu_count() or 1) // args.replicas)
    if args.threads_per_replica < 1:
        raise DraftwiseError(f"--threads-per-replica must be >= 1, got {args.threads_per_replica}")
    if not args.target_ongoing_requests > 0:
        raise DraftwiseError(f"--target-ongoing-requests must be > 0, got {args.target_ongoing_requests}")


def start_board():
    return MetricsBoard.options(name=BOARD, namespace=NAMESPACE, get_if_exists=True).remote()


def serve_replicas(args, build) -> int:
    """Start (or join, with --ray-address) a Ray cluster, run the application on it until SIGTERM or Ctrl-C,
    then delete it: Ray lets each replica's requests finish, up to --drain-timeout."""
    from draftwise.models import resolve

    check_replica_options(args)
    for name in (args.target, args.draft):  # pulled once here, not by every replica at once
        if name not in (None, "none"):
            resolve(name)
    if args.ray_address:
        ray.init(address=args.ray_address, namespace=NAMESPACE)
    else:
        ray.init(namespace=NAMESPACE, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        board = start_board()  # (held: an actor nobody refers to is collected)
        serve.run(build_app(build, args), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"draftwise: serving {args.model_id or args.target} on {args.replicas} replica(s) "
              f"({args.routing} routing) at http://{args.host}:{args.port}/v1", file=sys.stderr)
        while not stop.wait(1):
            pass
        print("draftwise: draining the replicas", file=sys.stderr)
        serve.delete(APP_NAME)
        ray.kill(board)
    finally:
        if not args.ray_address:
            serve.shutdown()
        ray.shutdown()
    return 0
