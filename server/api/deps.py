"""What the routes depend on: the coordinator, the bearer token, the enrollment rate limit, and the
small JSON bodies they read themselves.

Every dependency is `async def`: FastAPI runs a plain `def` in a worker thread, and the
coordinator is driven from the event loop only.
"""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from fedkey.federation.updates import validation
from fedkey.server.coordinator import Coordinator
from fedkey.server.settings import MAX_WAIT

MAX_JSON_BODY = 65_536  # the enrollment and loss-report bodies (and a WebSocket message)

# Declares the security scheme in OpenAPI; it refuses nothing itself (auto_error=False): the
# coordinator's checks give the 401s their messages.
bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="the device token POST /v1/devices answered",
)


async def get_coordinator(conn: HTTPConnection) -> Coordinator:
    return conn.app.state.coordinator


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]


def raw_authorization(scheme: HTTPBearer):
    """A dependency giving the raw `Authorization` header, for the coordinator to check in the
    request's own order; `scheme` declares it in OpenAPI and refuses nothing itself."""

    # Depends as a default, not in the annotation: the module's annotations are strings
    # (__future__), and a string cannot name this closure's `scheme`
    async def header(
        request: Request, _: HTTPAuthorizationCredentials | None = Depends(scheme)
    ) -> str | None:
        return request.headers.get("authorization")

    return header


AuthorizationDep = Annotated[str | None, Depends(raw_authorization(bearer))]

# The operator's scheme (GET /metrics, GET /v1/metrics, WS /v1/events): the server's operator
# token, not a device's.
operator_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="operator",
    description="the server's operator token (FEDKEY_OPERATOR_TOKEN)",
)

OperatorAuthorizationDep = Annotated[str | None, Depends(raw_authorization(operator_bearer))]


async def current_device(coordinator: CoordinatorDep, authorization: AuthorizationDep) -> str:
    """The authenticated device's id, or 401 (before any of the body is read)."""
    return coordinator.authenticate(authorization)


DeviceId = Annotated[str, Depends(current_device)]


async def enroll_rate_limit(request: Request, coordinator: CoordinatorDep) -> None:
    """429 with Retry-After past the per-IP enrollment bucket (before the body is read)."""
    limiter = request.app.state.enroll_limiter
    if limiter is None:
        return
    host = request.client.host if request.client else "unknown"
    wait = limiter.take(host)
    if wait > 0:
        coordinator.telemetry.enroll_limited.inc()
        retry = max(1, math.ceil(wait))
        raise HTTPException(
            429,
            f"too many enrollment attempts from {host}: retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )


async def small_body(request: Request) -> bytes:
    """A JSON control body, at most MAX_JSON_BODY bytes (413 past it)."""
    return await validation.read_limited(request.stream(), MAX_JSON_BODY)


def clamp_wait(wait: float) -> float:
    """?wait= within [0, MAX_WAIT]; "inf" is the longest wait, "nan" none."""
    if math.isnan(wait):
        return 0.0
    return max(0.0, min(float(wait), MAX_WAIT))
