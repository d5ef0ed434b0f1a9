"""The HTTP API of `fedkey server`, by concern (docs/how-to/http-federation.md; the generated HTTP API reference); fedkey.server.app builds
the app from these routers. Routes are thin: each calls the Coordinator's public methods.

    routes_devices  POST /v1/devices (enrollment)
    routes_rounds   GET /v1/rounds/current, POST /v1/rounds/{n}/loss, POST /v1/rounds/{n}/update
    routes_model    GET /v1/model
    routes_ops      GET /v1/metrics, /healthz, /metrics (Prometheus)
    routes_events   WebSocket /v1/events

fedkey.server.api.deps holds the dependencies (the coordinator, the bearer token, the enrollment rate
limit), fedkey.server.api.schemas the bodies and answers.
"""

from __future__ import annotations

from fastapi import APIRouter

from fedkey.server.api import routes_devices, routes_events, routes_model, routes_ops, routes_rounds

ROUTERS: tuple[APIRouter, ...] = (
    routes_devices.router,
    routes_rounds.router,
    routes_model.router,
    routes_ops.router,
    routes_events.router,
)
