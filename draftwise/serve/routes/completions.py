"""POST /v1/completions and /v1/chat/completions: parse, submit to the scheduler, and relay its events, whole or
as server-sent events."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from draftwise.errors import DraftwiseError
from draftwise.serve.request_error import RequestError
from draftwise.serve.routes.body import read_body
from draftwise.serve.routes.errors import error_response
from draftwise.serve.routes.relay import Relay
from draftwise.serve.routes.reply import Reply, failure, stats
from draftwise.serve.routes.state import ServerState, server_state
from draftwise.serve.scheduler import QueueFull, ShuttingDown

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold tokens back

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, state: ServerState = Depends(server_state)):
    return await _serve(request, state, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: ServerState = Depends(server_state)):
    return await _serve(request, state, chat=True)


async def _serve(request: Request, state: ServerState, chat: bool):
    arrived, metrics = time.perf_counter(), state.metrics
    try:
        try:
            raw = await read_body(request)
        except ClientDisconnect:  # it left while sending: nobody to answer, and nothing of ours to trace
            log.info("a client disconnected while sending its request body")
            return Response(status_code=499)
        body, parsed = await state.intake.parse(raw, chat)  # JSON, checks, template, tokenizer: off the event loop
        relay = Relay(asyncio.get_running_loop())
        reply = Reply(chat, state.model_id, len(parsed.prompt_ids), arrived, metrics, parsed.arm, parsed.tool_calls)
        ticket = state.scheduler.submit(parsed.prompt_ids, parsed.cfg, relay.sink, request_id=reply.id,
                                        request=body, arm=parsed.arm)
    except RequestError as err:
        metrics.reject(err.reason)
        return error_response(err)
    except QueueFull as err:
        metrics.reject("queue_full")
        return error_response(RequestError(str(err), status=429, kind="rate_limit_error", code="queue_full"),
                              {"Retry-After": str(max(1, math.ceil(err.retry_after)))})
    except ShuttingDown as err:
        metrics.reject("shutting_down")
        return error_response(RequestError(str(err), status=503, kind="server_error", code="shutting_down"))
    except DraftwiseError as err:  # the engine's checks, run by intake on the model loop
        metrics.reject("invalid_parameter")
        return error_response(RequestError(str(err)))
    if parsed.stream:
        # The background task covers a client that leaves before the stream's first byte: then the generator
        # never starts, and its finally (which cancels) never runs.
        return StreamingResponse(_stream(request, state, relay, ticket, reply, parsed.include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(_cancel_unless_finished, state, ticket, reply))
    return await _whole(request, state, relay, ticket, reply)


async def _whole(request: Request, state: ServerState, relay: Relay, ticket, reply: Reply):
    pieces, event = [], None
    try:
        while (event := await relay.next(request)) is not None and event.finish_reason is None:
            reply.token(event)
            pieces.append(event.text)
        if event is not None:
            pieces.append(event.text)  # a guard releases its held-back text with the end
            reply.finish(event)
    finally:
        _cancel_unless_finished(state, ticket, reply)  # the client went away (or this task was cancelled)
    if event is None:
        return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
    failed = failure(event)
    return error_response(failed) if failed else reply.whole("".join(pieces), event)


async def _stream(request: Request, state: ServerState, relay: Relay, ticket, reply: Reply, include_usage: bool):
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
        failed = failure(event)
        if failed:  # the status line is long gone: say it in the stream, as OpenAI does
            yield _sse(failed.body())
        else:
            for chunk in reply.deltas(event.text, last=True):  # a guard releases its held-back text with the end
                yield _sse(chunk)
            # The request's stats ride on its last chunk, as on a whole reply: a client need not ask for usage.
            yield _sse({**reply.chunk("" if not reply.chat else {}, reply.finish_reason(event)),
                        "draftwise": stats(event, reply.arm)})
            if include_usage:
                yield _sse(reply.usage_chunk(event))
        yield "data: [DONE]\n\n"
    finally:
        _cancel_unless_finished(state, ticket, reply)  # disconnected (or the response was dropped) mid-stream


def _cancel_unless_finished(state: ServerState, ticket, reply: Reply) -> None:
    if not reply.closed:
        state.scheduler.cancel(ticket)
        reply.abandon()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
