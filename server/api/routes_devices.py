"""Enrollment: POST /v1/devices."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server import validation
from server.api.deps import CoordinatorDep, enroll_rate_limit, small_body
from server.api.schemas import FULL_DISK, STALLED, EnrollRequest, EnrollResponse, errors, json_body

router = APIRouter(tags=["devices"])

ENROLL_SHAPE = '{"enrollment_secret": str, "name": str, "num_samples": int}'


@router.post(
    "/v1/devices",
    response_model=EnrollResponse,
    dependencies=[Depends(enroll_rate_limit)],
    openapi_extra=json_body(EnrollRequest),
    responses=errors(
        {
            401: "wrong or missing enrollment secret",
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
