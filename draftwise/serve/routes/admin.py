"""/admin/drafts: the draft versions on trial (rollout.Rollouts), read and started; only on a server with --api-key."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from draftwise.errors import DraftwiseError
from draftwise.serve.request_error import RequestError
from draftwise.serve.rollout import TrialUnderWay
from draftwise.serve.routes.body import read_body
from draftwise.serve.routes.state import ServerState, server_state

router = APIRouter()


def _rollouts(state: ServerState) -> object:
    if state.rollouts is None:
        raise RequestError("this server has no draft rollouts (serve a draft-model method with a --draft)",
                           status=404, kind="invalid_request_error", code="no_rollouts", reason="not_found")
    if not state.api_key:  # an admin route open to anyone would let anyone change what serves everyone
        raise RequestError("the admin routes need a server started with --api-key", status=403,
                           kind="permission_error", code="no_api_key", reason="unauthorized")
    return state.rollouts


@router.get("/admin/drafts")
async def drafts(state: ServerState = Depends(server_state)):
    return _rollouts(state).summary()


@router.post("/admin/drafts")
async def put_draft_on_trial(request: Request, state: ServerState = Depends(server_state)):
    """{"draft": "<base>@v<N>"}: load it beside the draft in front and put it on trial (202); the decision is
    the GET's."""
    trials = _rollouts(state)
    try:
        body = json.loads(await read_body(request))
    except ValueError as err:
        raise RequestError(f"the body is not valid JSON: {err}", code="invalid_json", reason="invalid_json")
    name = body.get("draft") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise RequestError('the body must be {"draft": NAME}, a draft version such as '
                           'qwen2.5-coder-0.5b-instruct@v1', "draft")
    try:
        trial = await asyncio.to_thread(trials.start, name)
    except TrialUnderWay as err:
        raise RequestError(str(err), "draft", status=409, code="trial_under_way")
    except DraftwiseError as err:  # a missing version, one already loaded, an engine without a draft model
        raise RequestError(str(err), "draft")
    return JSONResponse({"trial": trial.summary()}, status_code=202)
