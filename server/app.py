"""The HTTP API of `fedkey server` (README, "The HTTP contract"): thin routes over the Coordinator.

    app = create_app(Settings(storage="runs/server", enrollment_secret="s3cret"))

Every error is `{"detail": "<message>"}` with its status, FastAPI's own request validation
included. Prometheus metrics live in a registry per app, so tests can build several apps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import validation
from server.coordinator import Coordinator
from server.ratelimit import RateLimiter
from server.settings import MAX_WAIT, Settings
from server.validation import ValidationError

MAX_JSON_BODY = 65_536


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def _describe(errors) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


def _etag_matches(header: str, sha: str) -> bool:
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') == sha:
            return True
    return False


def _clamp_wait(wait: float) -> float:
    """?wait= within [0, MAX_WAIT]; "inf" is the longest wait, "nan" none."""
    if math.isnan(wait):
        return 0.0
    return max(0.0, min(float(wait), MAX_WAIT))


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
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.coordinator = coordinator
    limiter = (
        RateLimiter(settings.enroll_rate, settings.enroll_burst)
        if settings.enroll_rate > 0
        else None
    )
    app.state.enroll_limiter = limiter

    # -- errors: always {"detail": "<message>"} --------------------------------------------------

    @app.exception_handler(ValidationError)
    async def _api_error(request: Request, exc: ValidationError):
        return _error(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _request_error(request: Request, exc: RequestValidationError):
        return _error(422, _describe(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error(500, f"internal server error: {type(exc).__name__}")

    async def _small_body(request: Request) -> bytes:
        return await validation.read_limited(request.stream(), MAX_JSON_BODY)

    # -- routes --------------------------------------------------------------------------------

    @app.post("/v1/devices")
    async def enroll(request: Request):
        """Enroll a device: {"enrollment_secret", "name"?, "num_samples"?} -> {"device_id", "token"}."""
        if limiter is not None:
            host = request.client.host if request.client else "unknown"
            wait = limiter.take(host)
            if wait > 0:
                coordinator.telemetry.enroll_limited.inc()
                retry = max(1, math.ceil(wait))
                return _error(
                    429,
                    f"too many enrollment attempts from {host}: retry in {retry} s",
                    {"Retry-After": str(retry)},
                )
        raw = await _small_body(request)
        body = validation.parse_json_object(
            raw,
            '{"enrollment_secret": str, "name": str, "num_samples": int}',
            "bad_request",
        )
        return coordinator.enroll(
            body.get("enrollment_secret"), body.get("name"), body.get("num_samples")
        )

    @app.get("/v1/rounds/current")
    async def current_round(request: Request, wait: float = Query(0.0)):
        """This device's view of the round; long-polls up to `wait` seconds (max 60)."""
        device_id = coordinator.authenticate(request.headers.get("authorization"))
        return await coordinator.wait_view(device_id, _clamp_wait(wait))

    @app.get("/v1/model")
    async def model(request: Request):
        """The global model as a checkpoint file (safetensors); ETag = its sha256."""
        rnd, data, sha = coordinator.model()
        headers = {
            "ETag": f'"{sha}"',
            "X-Fedkey-Round": str(rnd),
            "Cache-Control": "no-cache",
        }
        inm = request.headers.get("if-none-match")
        if inm and _etag_matches(inm, sha):
            return Response(status_code=304, headers=headers)
        headers["Content-Disposition"] = f'attachment; filename="round_{rnd:04d}.safetensors"'
        return Response(data, media_type="application/octet-stream", headers=headers)

    @app.post("/v1/rounds/{n}/loss")
    async def report_loss(n: int, request: Request, wait: float = Query(0.0)):
        """{"train_loss", "num_samples"} -> {"upload": true|false|null} (FedMed topK)."""
        authorization = request.headers.get("authorization")
        coordinator.authenticate(authorization)  # 401 before the body is read
        raw = await _small_body(request)
        return await coordinator.report_loss(authorization, n, raw, _clamp_wait(wait))

    @app.post("/v1/rounds/{n}/update")
    async def upload(n: int, request: Request):
        """Raw safetensors body; headers X-Fedkey-Num-Samples and X-Fedkey-Train-Loss."""
        return await coordinator.receive_update(
            request.headers.get("authorization"), n, request.headers, request.stream()
        )

    @app.get("/v1/metrics")
    async def metrics_rows():
        return {"rounds": coordinator.metrics_rows()}

    @app.get("/healthz")
    async def healthz():
        return coordinator.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(
            generate_latest(coordinator.telemetry.registry), media_type=CONTENT_TYPE_LATEST
        )

    @app.websocket("/v1/events")
    async def events(ws: WebSocket):
        sub = coordinator.events.subscribe()  # before accept: no event is missed after it
        try:
            await ws.accept()

            async def until_closed():
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    while True:
                        msg = await ws.receive()
                        if msg["type"] == "websocket.disconnect":
                            return

            closed = asyncio.create_task(until_closed())
            try:
                while True:
                    get = asyncio.create_task(sub.get())
                    done, _ = await asyncio.wait({get, closed}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        return
                    event = get.result()
                    if event is None:
                        with contextlib.suppress(Exception):
                            await ws.close(code=1001)
                        return
                    await ws.send_json(event)
            finally:
                closed.cancel()
        except (WebSocketDisconnect, RuntimeError):
            return
        finally:
            sub.close()

    return app
