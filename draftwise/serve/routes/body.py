"""A request's body, read with a bound on its size (the completions and the admin routes; replicas.py's ingress
reads up to the same bound)."""
from __future__ import annotations

from fastapi import Request

from draftwise.serve.request_error import RequestError

# A request body. A context of 32,768 tokens is well under 1 MiB of text (as token ids, 1/4 MiB); and reading JSON
# holds the interpreter's lock throughout, which the model loop needs between its kernels, for a time that grows with
# the body: at 4 MiB the pause stays short, where bodies many times larger stall every sequence's tokens
# (docs/experiments/constants/README.md).
MAX_BODY_BYTES = 4 * 2**20


async def read_body(request: Request) -> bytes:
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
