"""The HTTP side: OpenAI's API on FastAPI. It parses, submits to the scheduler, and relays events.

Events arrive from the scheduler's thread through a sink that hands them to this request's asyncio queue.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from draftwise.errors import DraftwiseError
from draftwise.serve.dashboard import add_dashboard
from draftwise.serve.intake import Intake
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.protocol import RequestError
from draftwise.serve.rollout import TrialUnderWay
from draftwise.serve.scheduler import QueueFull, Scheduler, ShuttingDown
from draftwise.serve.tools import CallReader, split_calls
from draftwise.types import Event

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "content_filter": "content_filter"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold tokens back
# A request body. A context of 32,768 tokens is well under 1 MiB of text (as token ids, 1/4 MiB); and reading JSON
# holds the interpreter's lock throughout, which the model loop needs between its kernels: a body of 32 MiB of small
# numbers held it for 0.7 s, 4 MiB holds it for under 0.1 s.
MAX_BODY_BYTES = 4 * 2**20

log = logging.getLogger(__name__)


def create_app(scheduler: Scheduler, model_id: str, metrics: ServeMetrics, api_key: str | None = None,
               speculation: dict | None = None, drain_timeout: float = 30.0, experiment=None,
               trust_request_special_tokens: bool = False, rollouts=None) -> FastAPI:
    """The ASGI app. On uvicorn's shutdown (lifespan) it drains the scheduler, so an embedded server that stops
    lets its admitted requests finish; `draftwise serve` drains earlier, on the signal (see command.py).
    speculation: the GenerationConfig options (num_draft_tokens, adaptive) of requests that do not set them.
    experiment: A/B arms (experiment.Experiment) that pick the speculation of requests that leave it out.
    trust_request_special_tokens: read control tokens spelled in a request's text as the tokens (request_text.py);
    only for a server whose every client may write the model's turns, system turns included.
    rollouts: draft versions put on trial by POST /admin/drafts (rollout.Rollouts); not beside an experiment, as a
    trial is an experiment of its own."""
    if rollouts is not None and experiment is not None:
        raise DraftwiseError("a server runs either an --experiment or draft rollouts, not both: a trial is an "
                             "experiment of its own")
    intake = Intake(scheduler, model_id, speculation, experiment or rollouts, trust_request_special_tokens)
    if rollouts is not None:
        scheduler.request_observer, rollouts.observer = rollouts.observe, metrics.observe_trial
        rollouts.on_loop = scheduler.call  # (a draft joins and leaves the engine on the model loop)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with app.state.dashboard.sampling():  # the dashboard's history, while the server runs
            yield
        await asyncio.to_thread(scheduler.drain, drain_timeout)  # a no-op when already drained
        intake.close()

    app = FastAPI(title="draftwise", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    _add_error_handlers(app, metrics)

    def check_key(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if api_key and not (scheme.lower() == "bearer"  # (the scheme's case is free, as in RFC 9110)
                            and secrets.compare_digest(given.strip().encode(), api_key.encode())):
            raise RequestError("a valid API key is required: send the header 'Authorization: Bearer KEY'",
                               status=401, kind="authentication_error", code="invalid_api_key", reason="unauthorized")

    api = APIRouter(dependencies=[Depends(check_key)])  # every route but /health

    @app.get("/health")
    async def health():
        if scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting}

    @api.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "draftwise"}]}

    def admin() -> object:
        if rollouts is None:
            raise RequestError("this server has no draft rollouts (serve a draft-model method with a --draft)",
                               status=404, kind="invalid_request_error", code="no_rollouts", reason="not_found")
        if not api_key:  # an admin route open to anyone would let anyone change what serves everyone
            raise RequestError("the admin routes need a server started with --api-key", status=403,
                               kind="permission_error", code="no_api_key", reason="unauthorized")
        return rollouts

    @api.get("/admin/drafts")
    async def drafts():
        return admin().summary()

    @api.post("/admin/drafts")
    async def put_draft_on_trial(request: Request):
        """{"draft": "<base>@v<N>"}: load it beside the draft in front and put it on trial (202); the decision is
        the GET's."""
        trials = admin()
        try:
            body = json.loads(await _body(request))
        except ValueError as err:
            raise RequestError(f"the body is not valid JSON: {err}", code="invalid_json", reason="invalid_json")
        name = body.get("draft") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError('the body must be {"draft": NAME}, a draft version such as '
                               'qwen2.5-coder-0.5b-instruct@v1', "draft")
        try:
            trial = await asyncio.to_thread(trials.start, name)
        except TrialUnderWay as err:
            raise RequestError(str(err), "draft", status=409, code="trial_under_way")
        except DraftwiseError as err:  # a missing version, one already loaded, an engine without a draft model
            raise RequestError(str(err), "draft")
        return JSONResponse({"trial": trial.summary()}, status_code=202)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        arrived = time.perf_counter()
        try:
            try:
                raw = await _body(request)
            except ClientDisconnect:  # it left while sending: nobody to answer, and nothing of ours to trace
                log.info("a client disconnected while sending its request body")
                return Response(status_code=499)
            body, parsed = await intake.parse(raw, chat)  # JSON, checks, template, tokenizer: off the event loop
            relay = _Relay(asyncio.get_running_loop())
            reply = _Reply(chat, model_id, len(parsed.prompt_ids), arrived, metrics, parsed.arm, parsed.tool_calls)
            ticket = scheduler.submit(parsed.prompt_ids, parsed.cfg, relay.sink, request_id=reply.id, request=body,
                                      arm=parsed.arm)
        except RequestError as err:
            metrics.reject(err.reason)
            return _error(err)
        except QueueFull as err:
            metrics.reject("queue_full")
            return _error(RequestError(str(err), status=429, kind="rate_limit_error", code="queue_full"),
                          {"Retry-After": str(max(1, math.ceil(err.retry_after)))})
        except ShuttingDown as err:
            metrics.reject("shutting_down")
            return _error(RequestError(str(err), status=503, kind="server_error", code="shutting_down"))
        except DraftwiseError as err:  # (parse ran the engine's checks; the scheduler runs them again for its callers)
            metrics.reject("invalid_parameter")
            return _error(RequestError(str(err)))
        if parsed.stream:
            # The background task covers a client that leaves before the stream's first byte: then the generator
            # never starts, and its finally (which cancels) never runs.
            return StreamingResponse(_stream(request, relay, ticket, reply, parsed.include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS,
                                     background=BackgroundTask(_cancel_unless_finished, ticket, reply))
        return await _whole(request, relay, ticket, reply)

    async def _whole(request: Request, relay: "_Relay", ticket, reply: "_Reply"):
        pieces, event = [], None
        try:
            while (event := await relay.next(request)) is not None and event.finish_reason is None:
                reply.token(event)
                pieces.append(event.text)
            if event is not None:
                pieces.append(event.text)  # a guard releases its held-back text with the end
                reply.finish(event)
        finally:
            _cancel_unless_finished(ticket, reply)  # the client went away (or this task was cancelled)
        if event is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        failure = _failure(event)
        return _error(failure) if failure else reply.whole("".join(pieces), event)

    async def _stream(request: Request, relay: "_Relay", ticket, reply: "_Reply", include_usage: bool):
        event = None
        try:
            if reply.chat:
                yield _sse(reply.chunk({"role": "assistant", "content": ""}, None))
            while (event := await relay.next(request)) is not None and event.finish_reason is None:
                reply.token(event)
                for chunk in reply.deltas(event.text):
                    yield _sse(chunk)
            if event is None:
                return
            reply.finish(event)
            failure = _failure(event)
            if failure:  # the status line is long gone: say it in the stream, as OpenAI does
                yield _sse(failure.body())
            else:
                for chunk in reply.deltas(event.text, last=True):  # a guard releases its held-back text with the end
                    yield _sse(chunk)
                # The request's stats ride on its last chunk, as on a whole reply: a client need not ask for usage.
                yield _sse({**reply.chunk("" if not reply.chat else {}, reply.finish_reason(event)),
                            "draftwise": _stats(event, reply.arm)})
                if include_usage:
                    yield _sse(reply.usage_chunk(event))
            yield "data: [DONE]\n\n"
        finally:
            _cancel_unless_finished(ticket, reply)  # disconnected (or the response was dropped) mid-stream

    def _cancel_unless_finished(ticket, reply: "_Reply") -> None:
        if not reply.closed:
            scheduler.cancel(ticket)
            reply.abandon()

    app.state.dashboard = add_dashboard(app, api, metrics, drafts=None if rollouts is None else rollouts.summary)  # GET /dashboard: live charts of these metrics
    app.include_router(api)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServeMetrics) -> None:
    """Every error in OpenAI's shape {"error": {message, type, param, code}}, FastAPI's own included."""

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError):
        metrics.reject(err.reason)
        return _error(err, {"WWW-Authenticate": "Bearer"} if err.status == 401 else None)  # (RFC 6750)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        reason = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "invalid_request")
        message = {404: f"no route {request.url.path}; this server has /v1/models, /v1/completions, "
                        "/v1/chat/completions, /health, /metrics and /dashboard",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        metrics.reject(reason)
        return _error(RequestError(message, status=err.status_code, code=reason), getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):  # FastAPI's 422, as OpenAI's 400
        metrics.reject("invalid_parameter")
        return _error(RequestError(f"invalid request: {err.errors()}"))

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception):  # a bug of ours: say so, in the same shape
        return _error(RequestError(f"internal error: {type(err).__name__}: {err}", status=500, kind="server_error"))


async def _body(request: Request) -> bytes:
    """The request's body, read up to MAX_BODY_BYTES: more is refused (413) before it is all in memory."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    return bytes(body)


def _too_large() -> RequestError:
    return RequestError(f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", status=413,
                        code="request_too_large", reason="too_large")


class _Relay:
    """Carries events from the scheduler thread into this request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._checked = loop.time()  # when the client was last seen connected

    def sink(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self, request: Request, poll_s: float = 0.5) -> Event | None:
        """The next event, or None once the client has disconnected. Asked every poll_s whether events come or
        not: asked only in a pause between events, a client that left a whole reply while tokens kept coming held
        its slot to max_tokens."""
        while True:
            if self.loop.time() - self._checked >= poll_s:
                self._checked = self.loop.time()
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(self.queue.get(), poll_s)
            except asyncio.TimeoutError:
                continue


class _Reply:
    """One response's shapes (completion or chat) and its timing metrics, labelled with its A/B arm.
    tool_calls: the text is read for tool calls (tools.py), which go out as the message's tool_calls."""

    def __init__(self, chat: bool, model_id: str, prompt_tokens: int, arrived: float, metrics: ServeMetrics,
                 arm: str = "", tool_calls: bool = False):
        self.chat, self.model_id, self.prompt_tokens = chat, model_id, prompt_tokens
        self.reader = CallReader() if tool_calls else None
        self.calls = 0  # tool calls streamed so far
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.arrived, self.metrics, self.arm = arrived, metrics, arm
        self.last_token: float | None = None
        self.completion_tokens = 0
        self.closed = False  # the final event is counted (finished or abandoned)

    def token(self, event: Event) -> None:
        now = time.perf_counter()
        if self.last_token is None:
            self.metrics.ttft.labels(self.arm).observe(now - self.arrived)
        else:
            self.metrics.tbt.labels(self.arm).observe(now - self.last_token)
        self.last_token = now
        self.completion_tokens += 1

    def abandon(self) -> None:
        """The client left before the end: its scheduler-side final event has nobody to reach."""
        self.finish(Event(token_id=None, text="", finish_reason="cancelled"))

    def finish(self, event: Event) -> None:
        self.closed = True
        self.metrics.e2e.labels(self.arm).observe(time.perf_counter() - self.arrived)
        self.metrics.requests.labels(event.finish_reason, self.arm).inc()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def chunk(self, content, finish_reason: str | None) -> dict:
        if self.chat:
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id, "choices": [choice]}

    def deltas(self, text: str, last: bool = False) -> list[dict]:
        """The chunks that stream new text: as it comes, or (reading tool calls) its content and each call once
        its block has closed, whole, as one delta (OpenAI's clients gather a call's pieces by index)."""
        if self.reader is None:
            return [self.chunk(text, None)] if text else []
        items = self.reader.add(text) + (self.reader.finish() if last else [])
        chunks = []
        for kind, value in items:
            if kind == "call":
                value, self.calls = {"index": self.calls, **value}, self.calls + 1
                chunks.append(self.chunk({"tool_calls": [value]}, None))
            else:
                chunks.append(self.chunk(value, None))
        return chunks

    def finish_reason(self, event: Event, calls: int | None = None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a reply that called and ended by itself (one cut by max_tokens
        says "length", as the text may hold a call it never closed)."""
        called = self.calls if calls is None else calls
        if called and event.finish_reason in ("eos", "stop"):
            return "tool_calls"
        return FINISH_REASONS.get(event.finish_reason)

    def usage_chunk(self, event: Event) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id, "choices": [],
                "usage": self.usage(), "draftwise": _stats(event, self.arm)}

    def whole(self, text: str, event: Event) -> dict:
        finish = FINISH_REASONS.get(event.finish_reason)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.reader is not None:
                message["content"], calls = split_calls(text)
                if calls:
                    message["tool_calls"] = calls
                finish = self.finish_reason(event, len(calls))
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": [choice], "usage": self.usage(),
                "draftwise": _stats(event, self.arm)}


def _failure(event: Event) -> RequestError | None:
    """The error a final event means: a round that raised (500), or the server's drain ending it (503)."""
    if event.finish_reason == "error":
        return RequestError(f"the request failed while generating: {event.error}", status=500, kind="server_error")
    if event.finish_reason == "cancelled":  # we cancel only after the client left, so the server ended it
        return RequestError("the server shut down before this request finished (--drain-timeout)", status=503,
                            kind="server_error", code="shutting_down")
    return None


def _stats(event: Event, arm: str) -> dict | None:
    """The request's own speculation stats and A/B arm (the extra response field)."""
    return {**event.stats.to_dict(), "arm": arm} if event.stats is not None else None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(err: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
