"""A device in a round: its view (long-poll), its loss report, its upload."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from starlette.requests import ClientDisconnect

from fedkey.server.api.deps import (
    AuthorizationDep,
    CoordinatorDep,
    DeviceId,
    clamp_wait,
    small_body,
)
from fedkey.server.api.schemas import (
    FULL_DISK,
    OVERLOADED,
    STALLED,
    UPLOAD_BODY,
    LossAnswer,
    LossReport,
    RoundView,
    UploadReceipt,
    errors,
    json_body,
)
from fedkey.server.upload_inbox import RECEIVE_WAIT

router = APIRouter(tags=["rounds"])

RoundNumber = Annotated[int, Path(description="the round number")]
Wait = Annotated[
    float,
    Query(description="long-poll up to this many seconds (at most 60; inf the longest, nan none)"),
]

UNAUTHORIZED = "missing, malformed or unknown bearer token"
NOT_OPEN = "round n is not the open round (stale or future), or the run is finished"
NOT_SELECTED = "this device is not selected in round n (or topK chose other uploaders)"


@router.get(
    "/v1/rounds/current",
    response_model=RoundView,
    responses=errors(
        {
            401: UNAUTHORIZED,
            422: "wait is not a number",
            429: "this device has FEDKEY_POLLS_PER_DEVICE long-polls waiting already",
        }
    ),
)
async def current_round(coordinator: CoordinatorDep, device_id: DeviceId, wait: Wait = 0.0):
    """This device's view of the round; answers at once when it differs from the view last
    given to this device, else when it changes within `wait` seconds."""
    return await coordinator.wait_view(device_id, clamp_wait(wait))


@router.post(
    "/v1/rounds/{n}/loss",
    response_model=LossAnswer,
    openapi_extra=json_body(LossReport),
    responses=errors(
        {
            401: UNAUTHORIZED,
            403: NOT_SELECTED,
            409: f"{NOT_OPEN}; or a different loss was already reported",
            413: "the body is larger than 64 KB",
            408: STALLED,
            422: "n is not an integer, or the body is not a JSON object of the fields above "
            "(a finite train_loss, a positive num_samples)",
            507: FULL_DISK.format(what="loss report"),
        }
    ),
)
async def report_loss(
    n: RoundNumber,
    request: Request,
    coordinator: CoordinatorDep,
    device_id: DeviceId,  # 401 before the body is read
    authorization: AuthorizationDep,
    wait: Wait = 0.0,
):
    """Report the local training loss (FedMed topK); waits up to `wait` seconds for the decision
    whether to upload."""
    raw = await small_body(request)
    return await coordinator.report_loss(authorization, n, raw, clamp_wait(wait))


UPDATE_ERRORS = errors(
    {
        400: "the body is not a safetensors file, or Content-Length is not a number",
        401: UNAUTHORIZED,
        403: f"{NOT_SELECTED}; or the topK decision is pending",
        409: f"{NOT_OPEN}; or a different update was already uploaded",
        413: "the body is larger than the model plus the allowed margin",
        408: STALLED,
        422: "n is not an integer; tensor names, shapes or dtypes that do not fit the model; "
        "NaN or Inf; a missing or malformed X-Fedkey-* header",
        507: FULL_DISK.format(what="update"),
    }
)
UPDATE_ERRORS[503] = {
    **UPDATE_ERRORS[503],
    "description": f"{OVERLOADED}; or no upload slot (FEDKEY_MAX_RECEIVING) came free within "
    f"{RECEIVE_WAIT:g} s",
}


@router.post(
    "/v1/rounds/{n}/update",
    response_model=UploadReceipt,
    openapi_extra=UPLOAD_BODY,
    responses=UPDATE_ERRORS,
)
async def upload(
    n: RoundNumber, request: Request, coordinator: CoordinatorDep, authorization: AuthorizationDep
):
    """Upload the trained weights (a safetensors body, streamed). The same bytes again answer the
    same receipt."""
    # The coordinator authenticates (a refused upload is counted and published as one).
    try:
        return await coordinator.receive_update(authorization, n, request.headers, request.stream())
    except ClientDisconnect:  # the phone went away mid-body (its file is removed): nobody to tell
        return Response(status_code=400)
