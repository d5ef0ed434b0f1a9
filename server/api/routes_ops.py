"""For operators: the metrics rows, the health check, Prometheus."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fedkey.server.api.deps import CoordinatorDep, OperatorAuthorizationDep
from fedkey.server.api.schemas import Health, MetricsRows, errors, json_errors

router = APIRouter(tags=["ops"])


@router.get(
    "/v1/metrics",
    response_model=MetricsRows,
    responses=errors({401: "an operator token is set and the request does not carry it"}),
)
async def metrics_rows(coordinator: CoordinatorDep, authorization: OperatorAuthorizationDep):
    """The metrics of every aggregated round, as published (under DP an allow-list); with
    FEDKEY_OPERATOR_TOKEN set, only with `Authorization: Bearer <it>`."""
    coordinator.check_observer(authorization, "GET /v1/metrics")
    return {"rounds": await coordinator.metrics_rows()}


@router.get("/healthz", response_model=Health, responses=errors({}))
async def healthz(coordinator: CoordinatorDep):
    """The round the server is at and its state."""
    return coordinator.health()


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses=json_errors(
        {
            401: "an operator token is set and the request does not carry it",
            403: "a DP run without an operator token: its counters are not published",
        }
    ),
)
async def prometheus(coordinator: CoordinatorDep, authorization: OperatorAuthorizationDep):
    """Prometheus metrics (text format): for the operator (with FEDKEY_OPERATOR_TOKEN set, only
    with `Authorization: Bearer <it>`; under DP only so)."""
    coordinator.check_operator(authorization)
    return Response(generate_latest(coordinator.telemetry.registry), media_type=CONTENT_TYPE_LATEST)
