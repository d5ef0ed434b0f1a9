"""What the keyboard's routes serve from: the served model (swapped atomically on a hot reload),
the fan-out of events to the pages, the federation server's relay status, and `Keyboard`, the one
object that holds them (fedkey.keyboard_web.deps hands it to the routes). Plain Python: no routes here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedkey.keyboard_web.limits import Inference, SocketGate
from fedkey.keyboard_web.suggest import Suggester
from fedkey.keyboard_web.upstream import Upstream

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
NODE_MODULES = HERE / "node_modules"
ORT_DIST = NODE_MODULES / "onnxruntime-web" / "dist"
ORT_SCRIPT = "ort.wasm.min.js"  # the wasm-only build: no WebGPU/WebGL, single thread is fine
NPM_COMMAND = "npm ci --prefix keyboard_web"

POLL_SECONDS = 1.0


def browser_mode_status(ort_dist: Path) -> dict:
    """Whether the page can run the model in the browser (onnxruntime-web vendored in
    `ort_dist`)."""
    if not (ort_dist / ORT_SCRIPT).exists():
        return {
            "available": False,
            "reason": (
                "onnxruntime-web is not installed (keyboard_web/node_modules is missing): "
                f"run `{NPM_COMMAND}` and restart the keyboard"
            ),
        }
    return {"available": True, "reason": None, "script": f"/vendor/{ORT_SCRIPT}"}


def model_event(s: Suggester) -> dict:
    """The served model as the events (`hello`, `model_loaded`) describe it."""
    return {
        "round": s.round,
        "strategy": s.strategy,
        "data": s.data,
        "best_round": s.best_round,
        "val_ppl": s.metrics.get("val_ppl"),
        "test_ppl": s.metrics.get("test_ppl"),
        "perplexity": s.perplexity,
        "privacy": s.privacy,
        "int8": bool(s.metadata.get("int8", False)),
    }


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

    def served_rounds(self) -> list[dict]:
        """The rounds this process has served, oldest first."""
        return [self.history[r] for r in sorted(self.history)]


@dataclass
class Keyboard:
    """Everything a keyboard app serves from: its model, its events, its relay, its settings."""

    holder: ModelHolder
    upstream: Upstream
    watch_dir: Path | None = None
    ort_dist: Path = ORT_DIST
    poll_seconds: float = POLL_SECONDS
    hub: EventHub = field(default_factory=EventHub)
    sockets: SocketGate = field(default_factory=SocketGate)  # fedkey.keyboard_web.limits
    inference: Inference = field(default_factory=Inference)

    @classmethod
    def build(
        cls,
        model_path: str | Path | None,
        watch_dir: str | Path | None = None,
        events_url: str | None = None,
        poll_seconds: float = POLL_SECONDS,
        ort_dist: Path = ORT_DIST,
        events_token: str | None = None,
    ) -> Keyboard:
        """The keyboard for the export `model_path` (defaults to `<watch_dir>/model.onnx`);
        `events_token`: the federation server's operator token, when it asks for one."""
        watch = Path(watch_dir) if watch_dir is not None else None
        if model_path is None:
            if watch is None:
                raise ValueError("create_app needs a model_path or a watch_dir holding model.onnx")
            model_path = watch / "model.onnx"
        return cls(
            holder=ModelHolder(Path(model_path), watch),
            upstream=Upstream(events_url.rstrip("/") if events_url else None, events_token),
            watch_dir=watch,
            ort_dist=ort_dist,
            poll_seconds=poll_seconds,
        )

    def info(self) -> dict:
        """GET /api/info: the served model, browser mode, the relay, the hot reloads."""
        s = self.holder.current
        browser = browser_mode_status(self.ort_dist)
        if browser["available"] and s.error:
            browser = {"available": False, "reason": s.error}
        return {
            **s.info(),
            "browser_mode": browser,
            "events": {
                "url": self.upstream.url,
                "connected": self.upstream.connected,
                "error": self.upstream.error,
            },
            "reloads": self.holder.reloads,
            "reload_error": self.holder.last_error,
            "watch_dir": str(self.watch_dir) if self.watch_dir is not None else None,
        }

    def hello(self) -> dict:
        """The first event of a /ws/events connection: the served model and the relay."""
        return {
            "type": "hello",
            "time": time.time(),
            "upstream": {"url": self.upstream.url, "connected": self.upstream.connected},
            **model_event(self.holder.current),
        }
