"""Enrollment: POST /v1/devices; for the operator, POST /v1/enrollment-tokens (single-use tokens)
and DELETE /v1/devices/{device_id} (revocation)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from fedkey.federation.updates import validation
from fedkey.server.api.deps import (
    CoordinatorDep,
    OperatorAuthorizationDep,
    enroll_rate_limit,
    small_body,
)
from fedkey.server.api.schemas import (
    FULL_DISK,
    STALLED,
    EnrollRequest,
    EnrollResponse,
    MintRequest,
    MintResponse,
    RevokeResponse,
    errors,
    json_body,
)
from fedkey.server.devices import DEVICE_NAME
from fedkey.server.enrollment import DEFAULT_TOKEN_TTL

router = APIRouter(tags=["devices"])

ENROLL_SHAPE = '{"enrollment_secret": str, "name": str, "num_samples": int}'


@router.post(
    "/v1/devices",
    response_model=EnrollResponse,
    dependencies=[Depends(enroll_rate_limit)],
    openapi_extra=json_body(EnrollRequest),
    responses=errors(
        {
            401: "wrong, spent, expired or missing enrollment secret or token",
            403: "the server enrolls no more devices (FEDKEY_MAX_DEVICES)",
            409: "the device name is already enrolled",
            413: "the body is larger than 64 KB",
            408: STALLED,
            422: "the body is not a JSON object of the fields above, or a field is invalid",
            429: "too many enrollment attempts from this address: retry after Retry-After",
            507: FULL_DISK.format(what="enrollment"),
        }
    ),
)
async def enroll(request: Request, coordinator: CoordinatorDep):
    """Enroll a device; answers its id and bearer token. Rate limited per client address."""
    body = validation.parse_json_object(await small_body(request), ENROLL_SHAPE, "bad_request")
    return await coordinator.enroll(
        body.get("enrollment_secret"), body.get("name"), body.get("num_samples")
    )


MINT_SHAPE = '{"count": int, "ttl": float}'
OPERATOR_ONLY = {
    401: "the request does not carry the operator token",
    403: "the server has no operator token (FEDKEY_OPERATOR_TOKEN)",
}


@router.post(
    "/v1/enrollment-tokens",
    response_model=MintResponse,
    openapi_extra=json_body(MintRequest),
    responses=errors(
        {
            **OPERATOR_ONLY,
            413: "the body is larger than 64 KB",
            408: STALLED,
            422: "the body is not a JSON object of the fields above, or a field is invalid",
            507: FULL_DISK.format(what="tokens"),
        }
    ),
)
async def mint(
    request: Request, coordinator: CoordinatorDep, authorization: OperatorAuthorizationDep
):
    """Mint single-use enrollment tokens: each enrolls one device (as its `enrollment_secret`)
    before it expires. For the operator (`Authorization: Bearer <FEDKEY_OPERATOR_TOKEN>`)."""
    coordinator.check_operator_action(authorization, "POST /v1/enrollment-tokens")
    body = validation.parse_json_object(await small_body(request), MINT_SHAPE, "bad_request")
    return await coordinator.mint_enrollment_tokens(
        body.get("count"), body.get("ttl", DEFAULT_TOKEN_TTL)
    )


@router.delete(
    "/v1/devices/{device_id}",
    response_model=RevokeResponse,
    responses=errors(
        {
            **OPERATOR_ONLY,
            404: "no such device enrolled (or revoked already)",
            422: "device_id is not a device name",
        }
    ),
)
async def revoke(
    device_id: Annotated[str, Path(pattern=DEVICE_NAME.pattern)],
    coordinator: CoordinatorDep,
    authorization: OperatorAuthorizationDep,
):
    """Revoke a device: its token stops working at once, it is selected no more, and its name
    cannot be enrolled again. For the operator."""
    coordinator.check_operator_action(authorization, "DELETE /v1/devices")
    return await coordinator.revoke(device_id)
