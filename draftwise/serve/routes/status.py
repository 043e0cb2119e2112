"""What the server is: /health (open, for load balancers), /metrics (Prometheus) and /v1/models."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from draftwise.serve.routes.state import ServerState, server_state

open_router = APIRouter()  # no key: a load balancer's probe carries none
router = APIRouter()


@open_router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    if state.scheduler.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok", "running": state.scheduler.running, "waiting": state.scheduler.waiting}


@router.get("/metrics")
async def prometheus(state: ServerState = Depends(server_state)):
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    return {"object": "list",
            "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "draftwise"}]}
