"""One HTTP request run through an ASGI app in this process, its response given back as a stream of parts.

Behind Ray Serve (replicas.py) every replica runs the very app of the single-process server (app.py): the
ingress relays a request's method, path, headers and body, and the status, headers and body chunks come back
over Ray's streaming call. So the routes, error bodies, API key check and per-request speculation are one code,
whether one process serves or many.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class HTTPCall:
    """What the ingress received: enough to replay the request on a replica."""
    method: str
    path: str  # with its leading "/"
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    """The first part of a response: its status line and headers. Body chunks (bytes) follow."""
    status: int
    headers: list[tuple[bytes, bytes]]


async def run_call(app, call: HTTPCall) -> AsyncIterator:
    """Yield the app's ResponseStart, then each non-empty body chunk as it is sent. Closing the iterator early
    (the client left) tells the app its client disconnected, as uvicorn would, so the request's slot is freed."""
    sent: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()  # the caller stopped reading
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await left.wait()  # after the body, the only news is a disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
             "query_string": call.query, "root_path": "", "headers": call.headers, "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # the app returned (or raised): nothing more comes
    finished = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [tuple(h) for h in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    break
        if not finished:
            raise RuntimeError(f"the app ended {call.method} {call.path} without finishing its response") \
                from (task.exception() if task.done() and not task.cancelled() else None)
    finally:
        left.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(task), 5)  # its own cleanup: a left stream cancels its ticket
        if not task.done():
            task.cancel()
