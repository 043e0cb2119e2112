"""One response's shapes, a completion's or a chat's, whole or streamed in chunks, with its timing metrics."""
from __future__ import annotations

import time
import uuid

from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.request_error import RequestError
from draftwise.serve.tools import CallReader, split_calls
from draftwise.types import Event

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "content_filter": "content_filter"}


class Reply:
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
                "usage": self.usage(), "draftwise": stats(event, self.arm)}

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
                "draftwise": stats(event, self.arm)}


def failure(event: Event) -> RequestError | None:
    """The error a final event means: a round that raised (500), or the server's drain ending it (503)."""
    if event.finish_reason == "error":
        return RequestError(f"the request failed while generating: {event.error}", status=500, kind="server_error")
    if event.finish_reason == "cancelled":  # we cancel only after the client left, so the server ended it
        return RequestError("the server shut down before this request finished (--drain-timeout)", status=503,
                            kind="server_error", code="shutting_down")
    return None


def stats(event: Event, arm: str) -> dict | None:
    """The request's own speculation stats and A/B arm (the extra response field)."""
    return {**event.stats.to_dict(), "arm": arm} if event.stats is not None else None
