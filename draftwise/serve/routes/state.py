"""The server's parts that routes read, set once on app.state by create_app and handed to a route by FastAPI's
dependency (server_state): a route needs no closure over create_app's locals, and a router is a module of its own."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from draftwise.serve.intake import Intake
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.scheduler import Scheduler


@dataclass(frozen=True)
class ServerState:
    scheduler: Scheduler
    model_id: str
    metrics: ServeMetrics
    intake: Intake  # parses request bodies off the event loop
    api_key: str | None = None  # None: every route is open
    rollouts: object = None  # rollout.Rollouts: draft versions on trial by POST /admin/drafts; None without
    drain_timeout: float = 30.0  # seconds the lifespan's drain waits for admitted requests


def server_state(request: Request) -> ServerState:
    return request.app.state.server
