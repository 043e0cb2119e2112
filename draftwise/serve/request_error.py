"""The error a request gets: OpenAI's error body, naming the parameter at fault (protocol.py, tools.py, structured.py
raise it; the routes (routes/) answer with it)."""
from __future__ import annotations

from draftwise.errors import DraftwiseError


class RequestError(DraftwiseError):
    """A request the server refuses: an OpenAI-style error body with this status. reason labels the
    draftwise_rejected_requests_total counter (invalid_json, invalid_parameter, unknown_model, context_length...)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None, reason: str = "invalid_parameter"):
        super().__init__(message)
        self.param, self.status, self.kind, self.code, self.reason = param, status, kind, code, reason

    def body(self) -> dict:
        return {"error": {"message": _encodable(str(self)), "type": self.kind, "param": _encodable(self.param),
                          "code": self.code}}


def _encodable(text: str | None) -> str | None:
    """text as UTF-8 can carry it: a message that quotes the request may hold a lone surrogate (JSON escapes one),
    which no response body can encode; it is written as its escape instead."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")
