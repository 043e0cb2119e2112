"""The API key check: a dependency of every router but the open ones (/health, the dashboard's page and files)."""
from __future__ import annotations

import secrets

from fastapi import Request

from draftwise.serve.request_error import RequestError
from draftwise.serve.routes.state import server_state


def check_key(request: Request) -> None:
    api_key = server_state(request).api_key
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if api_key and not (scheme.lower() == "bearer"  # (the scheme's case is free, as in RFC 9110)
                        and secrets.compare_digest(given.strip().encode(), api_key.encode())):
        raise RequestError("a valid API key is required: send the header 'Authorization: Bearer KEY'",
                           status=401, kind="authentication_error", code="invalid_api_key", reason="unauthorized")
