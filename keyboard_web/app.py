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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mimetypes
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from keyboard_web.suggest import Session, Suggester, SuggestError

log = logging.getLogger("fedkey.keyboard")

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
NODE_MODULES = HERE / "node_modules"
ORT_DIST = NODE_MODULES / "onnxruntime-web" / "dist"
ORT_SCRIPT = "ort.wasm.min.js"  # the wasm-only build: no WebGPU/WebGL, single thread is fine
NPM_COMMAND = "npm ci --prefix keyboard_web"

MAX_TEXT = 10_000  # characters in one {"text": ...}
MAX_FRAME = 64 * 1024  # bytes (or characters) of one WebSocket frame
POLL_SECONDS = 1.0

# Module scripts must be served with a JavaScript type; Python 3.11 does not know .mjs.
mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("application/wasm", ".wasm")


def browser_mode_status() -> dict:
    """Whether the page can run the model in the browser (onnxruntime-web vendored)."""
    if not (ORT_DIST / ORT_SCRIPT).exists():
        return {
            "available": False,
            "reason": (
                "onnxruntime-web is not installed (keyboard_web/node_modules is missing): "
                f"run `{NPM_COMMAND}` and restart the keyboard"
            ),
        }
    return {"available": True, "reason": None, "script": f"/vendor/{ORT_SCRIPT}"}


class EventHub:
    """Fan-out of JSON events to the pages' /ws/events connections (drop-oldest queues)."""

    def __init__(self, queue_size: int = 256):
        self.queue_size = queue_size
        self.subscribers: set[asyncio.Queue] = set()

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(self.queue_size)
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

    def publish(self, text: str) -> None:
        for q in list(self.subscribers):
            while True:
                try:
                    q.put_nowait(text)
                    break
                except asyncio.QueueFull:
                    with contextlib.suppress(asyncio.QueueEmpty):
                        q.get_nowait()

    def publish_event(self, type_: str, **fields: Any) -> None:
        self.publish(json.dumps({"type": type_, "time": time.time(), **fields}))


class ModelHolder:
    """The served Suggester (swapped atomically) and the rounds served so far."""

    def __init__(self, model_path: Path, watch_dir: Path | None):
        self.watch_dir = watch_dir
        self.current = Suggester(model_path)
        self.history: dict[int, dict] = {}
        self._remember(self.current)
        self.watch_stamp: tuple[int, int] | None = None
        self.reloads = 0
        self.last_error: str | None = None

    def _remember(self, s: Suggester) -> None:
        if s.round is not None:
            self.history[int(s.round)] = {
                "round": s.round,
                "strategy": s.strategy,
                "val_ppl": s.metrics.get("val_ppl"),
                "test_ppl": s.metrics.get("test_ppl"),
            }

    def watched_json(self) -> Path | None:
        return self.watch_dir / "model.json" if self.watch_dir is not None else None

    def changed(self) -> bool:
        """True when the watched model.json differs from the served model's metadata."""
        path = self.watched_json()
        if path is None:
            return False
        try:
            st = path.stat()
        except OSError:
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self.watch_stamp:
            return False
        self.watch_stamp = stamp
        try:
            return path.read_bytes() != self.current.metadata_bytes
        except OSError:
            return False

    def load_watched(self) -> Suggester:
        """Build a Suggester from the watch dir (worker thread); retried if model.json moved on
        while the model was read, so the metadata and the weights are one export."""
        if self.watch_dir is None:
            raise RuntimeError("no watch directory to load a model from")
        path, json_path = self.watch_dir / "model.onnx", self.watch_dir / "model.json"
        for _ in range(5):
            before = json_path.read_bytes()
            s = Suggester(path)
            if s.metadata_bytes == before == json_path.read_bytes():
                return s
        return s

    def swap(self, s: Suggester) -> None:
        self.current = s  # one reference: a message sees the old or the new model, never a mix
        self.reloads += 1
        self._remember(s)


def _ws_url(base: str) -> str:
    base = base.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://") :]
    if base.startswith("http://"):
        return "ws://" + base[len("http://") :]
    return base


def create_app(
    model_path: str | Path | None,
    watch_dir: str | Path | None = None,
    events_url: str | None = None,
    poll_seconds: float = POLL_SECONDS,
) -> FastAPI:
    """The keyboard app for the export `model_path` (defaults to `<watch_dir>/model.onnx`).

    `watch_dir`: hot-reload newer exports written there (model.onnx, then model.json).
    `events_url`: the federation server's base URL (http://host:port): its WS /v1/events is
    relayed to the pages and its GET /v1/metrics proxied at /api/metrics.
    """
    watch = Path(watch_dir) if watch_dir is not None else None
    if model_path is None:
        if watch is None:
            raise ValueError("create_app needs a model_path or a watch_dir holding model.onnx")
        model_path = watch / "model.onnx"
    holder = ModelHolder(Path(model_path), watch)
    hub = EventHub()
    events_base = events_url.rstrip("/") if events_url else None
    upstream: dict[str, bool | str | None] = {"connected": False, "error": None}

    async def watcher() -> None:
        while True:
            await asyncio.sleep(poll_seconds)
            try:
                if not holder.changed():
                    continue
                new = await asyncio.to_thread(holder.load_watched)
            except Exception as e:  # a broken export: keep serving the current model
                holder.last_error = f"{type(e).__name__}: {e}"
                log.warning("hot reload from %s failed: %s", watch, holder.last_error)
                continue
            old = holder.current.round
            holder.swap(new)
            holder.last_error = None
            log.info("hot reload: round %s -> %s", old, new.round)
            hub.publish_event("model_loaded", **_model_event(new))

    async def relay(base: str) -> None:
        from websockets.asyncio.client import connect

        url = _ws_url(base) + "/v1/events"
        backoff = 0.5
        while True:
            try:
                async with connect(url, open_timeout=5, max_size=2**20) as ws:
                    upstream.update(connected=True, error=None)
                    hub.publish_event("upstream", connected=True, url=base)
                    backoff = 0.5
                    async for msg in ws:
                        if isinstance(msg, bytes):
                            msg = msg.decode("utf-8", "replace")
                        hub.publish(msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # refused, closed, timed out: try again later
                upstream.update(error=f"{type(e).__name__}: {e}")
            if upstream["connected"]:
                hub.publish_event("upstream", connected=False, url=base)
            upstream["connected"] = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = []
        if watch is not None:
            tasks.append(asyncio.create_task(watcher()))
        if events_base:
            tasks.append(asyncio.create_task(relay(events_base)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    app = FastAPI(title="fedkey keyboard", lifespan=lifespan)
    app.state.holder = holder
    app.state.hub = hub

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    if ORT_DIST.is_dir():
        app.mount("/vendor", StaticFiles(directory=ORT_DIST), name="vendor")
    else:

        @app.get("/vendor/{path:path}", include_in_schema=False)
        async def no_vendor(path: str):
            return JSONResponse({"detail": browser_mode_status()["reason"]}, status_code=404)

    def model_headers(s: Suggester) -> dict:
        return {
            "X-Fedkey-Round": str(s.round),
            "Cache-Control": "no-cache",
        }

    @app.get("/model.onnx")
    async def model_onnx():
        s = holder.current
        return Response(
            s.onnx_bytes, media_type="application/octet-stream", headers=model_headers(s)
        )

    @app.get("/model.json")
    async def model_json():
        s = holder.current
        return Response(s.metadata_bytes, media_type="application/json", headers=model_headers(s))

    @app.get("/api/info")
    async def info():
        s = holder.current
        browser = browser_mode_status()
        if browser["available"] and s.error:
            browser = {"available": False, "reason": s.error}
        return {
            **s.info(),
            "browser_mode": browser,
            "events": {
                "url": events_base,
                "connected": upstream["connected"],
                "error": upstream["error"],
            },
            "reloads": holder.reloads,
            "reload_error": holder.last_error,
            "watch_dir": str(watch) if watch is not None else None,
        }

    @app.get("/api/metrics")
    async def metrics():
        if not events_base:
            rows = [holder.history[r] for r in sorted(holder.history)]
            return {"rounds": rows, "source": "served"}
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                r = await client.get(events_base + "/v1/metrics")
                r.raise_for_status()
                body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            return JSONResponse(
                {"detail": f"the federation server at {events_base} did not answer: {e}"},
                status_code=502,
            )
        return {"rounds": body.get("rounds", []), "source": "federation"}

    @app.websocket("/ws/suggest")
    async def ws_suggest(ws: WebSocket):
        await ws.accept()
        session: Session | None = None
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                raw = msg.get("text")
                if raw is None:
                    await ws.send_json({"error": 'send JSON text frames: {"text": "..."}'})
                    continue
                request, error = _parse_request(raw)
                if error is not None:
                    await ws.send_json({"error": error})
                    continue
                current = holder.current
                if session is None or session.suggester is not current:
                    session = current.new_session()  # new weights: the state cache starts over
                try:
                    reply = session.suggest(request["text"])
                except SuggestError as e:
                    reply = {"error": str(e), "round": current.round}
                except Exception as e:  # pragma: no cover - a bug; the connection survives it
                    log.exception("suggestion failed")
                    session = None
                    reply = {"error": f"internal error: {type(e).__name__}"}
                if "id" in request:
                    reply["id"] = request["id"]
                await ws.send_json(reply)
        except (WebSocketDisconnect, RuntimeError):
            return

    @app.websocket("/ws/events")
    async def ws_events(ws: WebSocket):
        queue = hub.subscribe()
        try:
            await ws.accept()
            s = holder.current
            await ws.send_text(
                json.dumps(
                    {
                        "type": "hello",
                        "time": time.time(),
                        "upstream": {"url": events_base, "connected": upstream["connected"]},
                        **_model_event(s),
                    }
                )
            )

            async def until_closed():
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    while True:
                        if (await ws.receive())["type"] == "websocket.disconnect":
                            return

            closed = asyncio.create_task(until_closed())
            try:
                while True:
                    get = asyncio.create_task(queue.get())
                    done, _ = await asyncio.wait({get, closed}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        return
                    await ws.send_text(get.result())
            finally:
                closed.cancel()
        except (WebSocketDisconnect, RuntimeError):
            return
        finally:
            hub.unsubscribe(queue)

    return app


def _model_event(s: Suggester) -> dict:
    return {
        "round": s.round,
        "strategy": s.strategy,
        "val_ppl": s.metrics.get("val_ppl"),
        "test_ppl": s.metrics.get("test_ppl"),
        "perplexity": s.perplexity,
        "privacy": s.privacy,
        "int8": bool(s.metadata.get("int8", False)),
    }


def _parse_request(raw: str) -> tuple[dict, str | None]:
    """A {"text": str} request, or the reason it is not one."""
    if len(raw) > MAX_FRAME:
        return {}, f"message too long ({len(raw)} characters; at most {MAX_FRAME})"
    try:
        request = json.loads(raw)
    except json.JSONDecodeError as e:
        return {}, f'not JSON ({e.msg} at position {e.pos}): send {{"text": "..."}}'
    if not isinstance(request, dict) or "text" not in request:
        return {}, 'expected a JSON object {"text": "..."}'
    text = request["text"]
    if not isinstance(text, str):
        return {}, f'"text" must be a string, got {type(text).__name__}'
    if len(text) > MAX_TEXT:
        return {}, f'"text" too long ({len(text)} characters; at most {MAX_TEXT})'
    return request, None


def serve(
    model_path: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8080,
    watch_dir: str | Path | None = None,
    events_url: str | None = None,
) -> None:
    """Run the keyboard with uvicorn (blocks until stopped)."""
    import uvicorn

    app = create_app(model_path, watch_dir=watch_dir, events_url=events_url)
    uvicorn.run(app, host=host, port=port, log_level=os.environ.get("FEDKEY_LOG_LEVEL", "info"))


def main(argv: list[str] | None = None) -> None:
    """python -m keyboard_web.app MODEL.onnx [--host H] [--port P] [--watch DIR] [--events URL]"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m keyboard_web.app", description=main.__doc__)
    p.add_argument("model", nargs="?", help="the exported model.onnx (default: WATCH/model.onnx)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--watch", help="directory to hot-reload newer exports from")
    p.add_argument("--events", help="federation server base URL, e.g. http://127.0.0.1:8000")
    a = p.parse_args(argv)
    serve(a.model, a.host, a.port, a.watch, a.events)


if __name__ == "__main__":
    main()
