"""GET /dashboard (the page), /dashboard/static/NAME (uPlot) and /dashboard/data (the numbers, behind the key check).

The page and uPlot are open, like /health: they are the same bytes for everyone and hold no numbers, and a browser
cannot send an Authorization header when it opens a page. With a key, open /dashboard?key=KEY: the page sends it as
the bearer header with its requests for /dashboard/data, which the key guards. The history the numbers come from is
app.state.dashboard (serve/dashboard.MetricsHistory), sampled for as long as the server runs (app.py's lifespan).
"""
from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.serve.dashboard import STATIC, dashboard_data
from draftwise.serve.routes.state import ServerState, server_state

open_router = APIRouter()  # the page and its files: no numbers, and a browser opening a page sends no key
router = APIRouter()


@functools.cache
def _static() -> tuple[str, dict[str, tuple[bytes, str]]]:
    """The page, and each of uPlot's files with its media type, read once."""
    static = resources.files("draftwise.serve") / "static"
    page = (static / "dashboard.html").read_text(encoding="utf-8")
    return page, {name: ((static / name).read_bytes(), kind) for name, kind in STATIC.items()}


@open_router.get("/dashboard")
async def dashboard():
    return HTMLResponse(_static()[0], headers={"Cache-Control": "no-cache"})


@open_router.get("/dashboard/static/{name}")
async def static_file(name: str):
    files = _static()[1]
    if name not in files:
        raise StarletteHTTPException(404)
    body, kind = files[name]
    return Response(body, media_type=kind, headers={"Cache-Control": "max-age=86400"})


@router.get("/dashboard/data")
async def data(request: Request, state: ServerState = Depends(server_state)):
    drafts = None if state.rollouts is None else state.rollouts.summary
    return dashboard_data(request.app.state.dashboard, drafts)
