"""The HTTP API of `fedkey server` (docs/how-to/http-federation.md; the generated HTTP API reference): the app, its error handlers and
its lifespan; the routes are in fedkey.server.api, thin over the Coordinator.

    app = create_app(Settings(storage="runs/server", enrollment_secret="s3cret"))

Every error is `{"detail": "<message>"}` with its status, FastAPI's own request validation
included. Prometheus metrics live in a registry per app, so tests can build several apps.
/openapi.json (and /docs) describe every route, body, answer and error status.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fedkey.federation.updates.validation import ValidationError
from fedkey.server.api import ROUTERS
from fedkey.server.api.deps import MAX_JSON_BODY
from fedkey.server.api.deps import clamp_wait as _clamp_wait
from fedkey.server.coordinator import Coordinator
from fedkey.server.runtime.admission import Admission
from fedkey.server.runtime.disk_full import no_space, out_of_space
from fedkey.server.runtime.rate_limit import RateLimiter
from fedkey.server.settings import Settings

__all__ = ["MAX_JSON_BODY", "_clamp_wait", "create_app"]


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def _describe(errors) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


def create_app(settings: Settings | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the coordinator (data, engine, resume, round driver)."""
    settings = settings or Settings()
    coordinator = Coordinator(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await coordinator.start()
        try:
            yield
        finally:
            await coordinator.stop()

    app = FastAPI(
        title="fedkey federation server",
        summary="Federated next-word keyboard: rounds, uploads, the global model.",
        description="JSON control messages, safetensors bytes for tensors; every error is "
        '`{"detail": "<message>"}`. Events stream over the WebSocket `/v1/events` (JSON).',
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.coordinator = coordinator
    app.state.enroll_limiter = (
        RateLimiter(settings.enroll_rate, settings.enroll_burst)
        if settings.enroll_rate > 0
        else None
    )

    # -- errors: always {"detail": "<message>"} --------------------------------------------------

    @app.exception_handler(ValidationError)
    async def _api_error(request: Request, exc: ValidationError):
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_error(request: Request, exc: RequestValidationError):
        return _error(422, _describe(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        if out_of_space(exc):  # a write the full disk refused: nothing changed, retry later
            return await _api_error(request, no_space("the request"))
        if isinstance(exc, OperationalError):  # the database locked or out of reach: transient
            return _error(
                503, "the database is busy: nothing was stored; retry", {"Retry-After": "5"}
            )
        return _error(500, f"internal server error: {type(exc).__name__}")

    for router in ROUTERS:
        app.include_router(router)
    if settings.admit_per_tick:
        app.add_middleware(Admission, per_tick=settings.admit_per_tick)
    return app
