"""For the page's panel: GET /api/info (the served model, browser mode, the relay) and
GET /api/metrics (the rounds, from the federation server or as served here)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from fedkey.keyboard_web.deps import KeyboardDep
from fedkey.keyboard_web.schemas import ErrorBody, Info, Metrics
from fedkey.keyboard_web.upstream import FederationUnreachable

router = APIRouter(tags=["panel"])


@router.get("/api/info", responses={200: {"model": Info}})
async def info(keyboard: KeyboardDep):
    """Round, strategy, perplexity, privacy, int8, whether browser mode works, the events relay
    and the hot reloads."""
    return keyboard.info()


@router.get(
    "/api/metrics",
    responses={
        200: {"model": Metrics},
        502: {"model": ErrorBody, "description": "The federation server did not answer."},
    },
)
async def metrics(keyboard: KeyboardDep):
    """The federation server's GET /v1/metrics rows (with events_url), else the rounds this
    process has served."""
    if not keyboard.upstream.url:
        return {"rounds": keyboard.holder.served_rounds(), "source": "served"}
    try:
        rounds = await keyboard.upstream.rounds()
    except FederationUnreachable as e:
        return JSONResponse({"detail": str(e)}, status_code=502)
    return {"rounds": rounds, "source": "federation"}
