"""The HTTP side: OpenAI's API on FastAPI. create_app assembles the app from its routers (routes/), its state
(routes/state.ServerState on app.state) and its lifespan; the routes parse, submit to the scheduler, and relay
its events."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import Depends, FastAPI

from draftwise.errors import DraftwiseError
from draftwise.serve.dashboard import MetricsHistory
from draftwise.serve.intake import Intake
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.routes import admin, completions, dashboard, status
from draftwise.serve.routes.auth import check_key
from draftwise.serve.routes.errors import add_error_handlers
from draftwise.serve.routes.state import ServerState
from draftwise.serve.scheduler import Scheduler


def create_app(scheduler: Scheduler, model_id: str, metrics: ServeMetrics, api_key: str | None = None,
               speculation: dict | None = None, drain_timeout: float = 30.0, experiment=None,
               trust_request_special_tokens: bool = False, rollouts=None) -> FastAPI:
    """The ASGI app. On uvicorn's shutdown (lifespan) it drains the scheduler, so an embedded server that stops
    lets its admitted requests finish; `draftwise serve` drains earlier, on the signal (see command.py).
    speculation: the GenerationConfig options (num_draft_tokens, adaptive) of requests that do not set them.
    experiment: A/B arms (experiment.Experiment) that pick the speculation of requests that leave it out.
    trust_request_special_tokens: read control tokens spelled in a request's text as the tokens (request_text.py);
    only for a server whose every client may write the model's turns, system turns included.
    rollouts: draft versions put on trial by POST /admin/drafts (rollout.Rollouts); not beside an experiment, as a
    trial is an experiment of its own."""
    if rollouts is not None and experiment is not None:
        raise DraftwiseError("a server runs either an --experiment or draft rollouts, not both: a trial is an "
                             "experiment of its own")
    intake = Intake(scheduler, model_id, speculation, experiment or rollouts, trust_request_special_tokens)
    if rollouts is not None:
        scheduler.request_observer, rollouts.observer = rollouts.observe, metrics.observe_trial
        rollouts.on_loop = scheduler.call  # (a draft joins and leaves the engine on the model loop)

    app = FastAPI(title="draftwise", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan)
    app.state.server = ServerState(scheduler, model_id, metrics, intake, api_key, rollouts, drain_timeout)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.state.dashboard = MetricsHistory(metrics.registry)  # GET /dashboard: live charts of these metrics
    add_error_handlers(app)
    app.include_router(status.open_router)  # /health: a load balancer's probe carries no key
    app.include_router(dashboard.open_router)  # the page and its files: no numbers in them
    for router in (status.router, admin.router, completions.router, dashboard.router):
        app.include_router(router, dependencies=[Depends(check_key)])
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServerState = app.state.server
    async with app.state.dashboard.sampling():  # the dashboard's history, while the server runs
        yield
    await asyncio.to_thread(state.scheduler.drain, state.drain_timeout)  # a no-op when already drained
    state.intake.close()
