"""Every error in OpenAI's shape {"error": {message, type, param, code}}, FastAPI's own included."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.serve.request_error import RequestError
from draftwise.serve.routes.state import server_state


def add_error_handlers(app: FastAPI) -> None:
    """The handlers count each refusal in the server's metrics (app.state.server)."""

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError):
        server_state(request).metrics.reject(err.reason)
        return error_response(err, {"WWW-Authenticate": "Bearer"} if err.status == 401 else None)  # (RFC 6750)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        reason = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "invalid_request")
        message = {404: f"no route {request.url.path}; this server has /v1/models, /v1/completions, "
                        "/v1/chat/completions, /health, /metrics and /dashboard",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        server_state(request).metrics.reject(reason)
        return error_response(RequestError(message, status=err.status_code, code=reason),
                              getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):  # FastAPI's 422, as OpenAI's 400
        server_state(request).metrics.reject("invalid_parameter")
        return error_response(RequestError(f"invalid request: {err.errors()}"))

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception):  # a bug of ours: say so, in the same shape
        return error_response(RequestError(f"internal error: {type(err).__name__}: {err}", status=500,
                                           kind="server_error"))


def error_response(err: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
