"""The HTTP side: OpenAI's API on FastAPI. It parses, submits to the scheduler, and relays events.

Events arrive from the scheduler's thread through a sink that hands them to this request's asyncio queue.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from draftwise.errors import DraftwiseError
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.protocol import RequestError, parse
from draftwise.serve.scheduler import QueueFull, Scheduler, ShuttingDown
from draftwise.types import Event

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # engine -> OpenAI


def create_app(scheduler: Scheduler, model_id: str, metrics: ServeMetrics, api_key: str | None = None,
               default_draft_tokens: int = 4) -> FastAPI:
    app = FastAPI(title="draftwise", docs_url=None, redoc_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                metrics.reject("unauthorized")
                return _error(RequestError("a valid API key is required: Authorization: Bearer KEY", status=401,
                                           kind="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "draftwise"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        arrived = time.perf_counter()
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise RequestError(f"the body is not valid JSON: {err}", code="invalid_json") from err
            parsed = parse(body, scheduler.engine, model_id, chat, default_draft_tokens)
            relay = _Relay(asyncio.get_running_loop())
            ticket = scheduler.submit(parsed.prompt_ids, parsed.cfg, relay.sink)
        except RequestError as err:
            metrics.reject(err.code or ("unknown_model" if err.status == 404 else "invalid_parameter"))
            return _error(err)
        except QueueFull as err:
            metrics.reject("queue_full")
            return _error(RequestError(str(err), status=429, kind="rate_limit_error", code="queue_full"),
                          {"Retry-After": str(max(1, round(err.retry_after)))})
        except ShuttingDown as err:
            metrics.reject("shutting_down")
            return _error(RequestError(str(err), status=503, kind="server_error", code="shutting_down"))
        except DraftwiseError as err:
            metrics.reject("invalid_parameter")
            return _error(RequestError(str(err)))
        reply = _Reply(chat, model_id, len(parsed.prompt_ids), arrived, metrics)
        if parsed.stream:
            return StreamingResponse(_stream(request, relay, ticket, reply, parsed.include_usage),
                                     media_type="text/event-stream")
        return await _whole(request, relay, ticket, reply)

    async def _whole(request: Request, relay: "_Relay", ticket, reply: "_Reply"):
        pieces, event = [], None
        try:
            while (event := await relay.next(request)) is not None and event.finish_reason is None:
                reply.token(event)
                pieces.append(event.text)
        finally:
            if event is None or event.finish_reason is None:
                scheduler.cancel(ticket)  # the client went away
        if event is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        reply.finish(event)
        if event.finish_reason == "error":
            return _error(RequestError(f"the request failed while generating: {event.error}", status=500,
                                       kind="server_error"))
        return reply.whole("".join(pieces), event)

    async def _stream(request: Request, relay: "_Relay", ticket, reply: "_Reply", include_usage: bool):
        event = None
        try:
            if reply.chat:
                yield _sse(reply.chunk({"role": "assistant", "content": ""}, None))
            while (event := await relay.next(request)) is not None and event.finish_reason is None:
                reply.token(event)
                if event.text:
                    yield _sse(reply.chunk(event.text, None))
            if event is None:
                return
            reply.finish(event)
            if event.finish_reason == "error":
                yield _sse(RequestError(f"the request failed while generating: {event.error}", status=500,
                                        kind="server_error").body())
            else:
                yield _sse(reply.chunk("" if not reply.chat else {}, FINISH_REASONS.get(event.finish_reason)))
                if include_usage:
                    yield _sse(reply.usage_chunk(event))
            yield "data: [DONE]\n\n"
        finally:
            if event is None or event.finish_reason is None:
                scheduler.cancel(ticket)  # disconnected (or the response was dropped) mid-stream

    return app


class _Relay:
    """Carries events from the scheduler thread into this request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self, request: Request, poll_s: float = 0.5) -> Event | None:
        """The next event, or None once the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), poll_s)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None


class _Reply:
    """One response's shapes (completion or chat) and its timing metrics."""

    def __init__(self, chat: bool, model_id: str, prompt_tokens: int, arrived: float, metrics: ServeMetrics):
        self.chat, self.model_id, self.prompt_tokens = chat, model_id, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.arrived, self.metrics = arrived, metrics
        self.last_token: float | None = None
        self.completion_tokens = 0

    def token(self, event: Event) -> None:
        now = time.perf_counter()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.tbt.observe(now - self.last_token)
        self.last_token = now
        self.completion_tokens += 1

    def finish(self, event: Event) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrived)
        self.metrics.requests.labels(event.finish_reason).inc()

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

    def usage_chunk(self, event: Event) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id, "choices": [],
                "usage": self.usage(), "draftwise": _stats(event)}

    def whole(self, text: str, event: Event) -> dict:
        finish = FINISH_REASONS.get(event.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": [choice], "usage": self.usage(),
                "draftwise": _stats(event)}


def _stats(event: Event) -> dict | None:
    """The request's own speculation stats (the extra response field)."""
    return event.stats.to_dict() if event.stats is not None else None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(err: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
