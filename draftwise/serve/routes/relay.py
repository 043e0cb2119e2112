"""Carries a request's events from the scheduler's thread into its event loop, watching for the client leaving."""
from __future__ import annotations

import asyncio

from fastapi import Request

from draftwise.types import Event


class Relay:
    """Events arrive from the scheduler's thread through sink, which hands them to this request's asyncio queue."""

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
