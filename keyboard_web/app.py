"""The live web keyboard: a FastAPI app serving suggestions over a WebSocket, and the page.

    GET  /               the keyboard page (static/index.html, app.js, suggest.js, style.css)
    GET  /model.onnx     the served model (for the page's in-browser mode); header X-Fedkey-Round
    GET  /model.json     its metadata (vocabulary, shape, round, strategy, metrics, privacy)
    GET  /api/info       round, strategy, perplexity, privacy (epsilon so far, delta, the budget,
                         the noise multiplier, the bounding), int8, whether browser mode works
    GET  /api/metrics    {"rounds": [...]}: the federation server's /v1/metrics (with events_url),
                         else the rounds this process has served
    WS   /ws/suggest     client sends {"text": "..."} (optional "id", echoed back), receives
                         {"suggestions": [3 words], "round": n}; a bad frame gets {"error": "..."}
                         and the connection stays open
    WS   /ws/events      the federation server's WS /v1/events relayed (with events_url), plus
                         this process's own {"type": "model_loaded", ...} after a hot reload
    GET  /vendor/...     onnxruntime-web's dist/ from keyboard_web/node_modules (npm ci)

Hot reload: with `watch_dir`, `<watch_dir>/model.json` is polled (once a second); when its
content differs from the served model's, `<watch_dir>/model.onnx` is loaded in a worker thread
and swapped in atomically (one reference). Each connection notices the swap on its next message,
drops its state cache (the weights changed) and its replies carry the new round.

Serving never imports torch.

The app is composed here from routers by concern, as fedkey.server.app is from fedkey.server.api:

    routes_page   GET /, /static/..., /vendor/...
    routes_model  GET /model.onnx, /model.json, /ngram.safetensors
    routes_api    GET /api/info, /api/metrics
    routes_ws     WS /ws/suggest, /ws/events

They serve from one `Keyboard` (fedkey.keyboard_web.service: the served model, the event hub, the relay
status), `app.state.keyboard`, which fedkey.keyboard_web.deps hands them; fedkey.keyboard_web.protocol holds the
/ws/suggest protocol, fedkey.keyboard_web.background the hot reload and the relay (the app's lifespan),
fedkey.keyboard_web.schemas the answers as OpenAPI describes them.
"""

from __future__ import annotations

import mimetypes
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from fedkey.keyboard_web import routes_api, routes_model, routes_page, routes_ws
from fedkey.keyboard_web.background import lifespan
from fedkey.keyboard_web.protocol import MAX_FRAME, MAX_TEXT
from fedkey.keyboard_web.service import (
    HERE,
    NODE_MODULES,
    NPM_COMMAND,
    ORT_DIST,
    ORT_SCRIPT,
    POLL_SECONDS,
    STATIC_DIR,
    EventHub,
    Keyboard,
    ModelHolder,
)

__all__ = [
    "HERE",
    "MAX_FRAME",
    "MAX_TEXT",
    "NODE_MODULES",
    "NPM_COMMAND",
    "ORT_DIST",
    "ORT_SCRIPT",
    "POLL_SECONDS",
    "STATIC_DIR",
    "UVICORN_LIMITS",
    "EventHub",
    "Keyboard",
    "ModelHolder",
    "create_app",
    "main",
    "serve",
]

#: uvicorn's settings of the keyboard's limits (fedkey.keyboard_web.limits has the app's): a WebSocket
#: frame past MAX_FRAME closes its connection (1009) before it is buffered whole.
UVICORN_LIMITS: dict[str, Any] = {"ws_max_size": MAX_FRAME}

# Module scripts must be served with a JavaScript type; Python 3.11 does not know .mjs.
mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("application/wasm", ".wasm")


def create_app(
    model_path: str | Path | None,
    watch_dir: str | Path | None = None,
    events_url: str | None = None,
    poll_seconds: float = POLL_SECONDS,
    events_token: str | None = None,
) -> FastAPI:
    """The keyboard app for the export `model_path` (defaults to `<watch_dir>/model.onnx`).

    `watch_dir`: hot-reload newer exports written there (model.onnx, then model.json).
    `events_url`: the federation server's base URL (http://host:port): what its WS /v1/events
    and GET /v1/metrics publish is passed to the pages, as far as the panel shows it
    (fedkey.keyboard_web.upstream). `events_token`: that server's operator token, when it asks for one.
    """
    keyboard = Keyboard.build(
        model_path,
        watch_dir,
        events_url,
        poll_seconds=poll_seconds,
        ort_dist=ORT_DIST,
        events_token=events_token,
    )
    app = FastAPI(
        title="fedkey keyboard",
        summary="The live web keyboard: next-word suggestions from the served model.",
        description="Suggestions over the WebSocket `/ws/suggest` (JSON), events over "
        "`/ws/events`; the page at `/`.",
        lifespan=lifespan,
    )
    app.state.keyboard = keyboard
    app.state.holder = keyboard.holder
    app.state.hub = keyboard.hub
    app.include_router(routes_page.router)
    routes_page.mount_files(app)
    for router in (routes_model.router, routes_api.router, routes_ws.router):
        app.include_router(router)
    return app


def serve(
    model_path: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8080,
    watch_dir: str | Path | None = None,
    events_url: str | None = None,
    events_token: str | None = None,
    tls: tuple[str | Path, str | Path] | None = None,
) -> None:
    """Run the keyboard with uvicorn (blocks until stopped); `tls`: (certificate, key) to serve
    HTTPS with."""
    import uvicorn

    app = create_app(
        model_path, watch_dir=watch_dir, events_url=events_url, events_token=events_token
    )
    log_level = os.environ.get("FEDKEY_LOG_LEVEL", "info")
    cert, key = tls or (None, None)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=cert,
        ssl_keyfile=key,
        **UVICORN_LIMITS,
    )


def main(argv: list[str] | None = None) -> None:
    """python -m fedkey.keyboard_web.app MODEL.onnx [--host H] [--port P] [--watch DIR] [--events URL]
    [--tls-cert PEM --tls-key PEM] (the federation server's operator token, if it asks for one:
    FEDKEY_OPERATOR_TOKEN)"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fedkey.keyboard_web.app", description=main.__doc__)
    p.add_argument("model", nargs="?", help="the exported model.onnx (default: WATCH/model.onnx)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--watch", help="directory to hot-reload newer exports from")
    p.add_argument("--events", help="federation server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    a = p.parse_args(argv)
    if (a.tls_cert is None) != (a.tls_key is None):
        p.error("HTTPS needs both --tls-cert and --tls-key")
    tls = (a.tls_cert, a.tls_key) if a.tls_cert else None
    token = os.environ.get("FEDKEY_OPERATOR_TOKEN")
    serve(a.model, a.host, a.port, a.watch, a.events, token, tls)


if __name__ == "__main__":
    main()
