"""Helpers for the web keyboard tests: exports, a uvicorn server in a thread, chromium."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from fedkey.runners.processes import free_port
from fedkey.testing.wait import wait_for


@dataclass
class Models:
    word: Path  # trained GRU, round 3, word vocabulary of the demo corpus
    checkpoint: Path  # its checkpoint (re-export with another round for hot reload)
    lstm: Path  # untrained LSTM (two state tensors), round 0
    sentencepiece: Path  # untrained GRU on a SentencePiece vocabulary
    vocab: list[str]


def export_model(checkpoint: Path, out: Path) -> Path:
    from fedkey.export.onnx_export import export_checkpoint

    export_checkpoint(checkpoint, out)
    return out


def save_round(
    models: Models,
    round_idx: int,
    dest_dir: Path,
    val_ppl: float = 150.0,
    *,
    metrics: dict | None = None,
    server: dict | None = None,
) -> Path:
    """Export the trained weights as round `round_idx` into dest_dir/model.onnx (+ .json).

    `metrics` (the round's metrics row) and `server` (the server state) replace the checkpoint's
    defaults ({"val_ppl", "test_ppl"}, no server state), as fedkey.federation.engine writes them."""
    from fedkey.models.checkpoint import load_checkpoint, model_state, save_checkpoint

    model, tok, meta = load_checkpoint(models.checkpoint)
    ckpt = dest_dir.parent / f".ckpt-{dest_dir.name}-{round_idx}.safetensors"
    save_checkpoint(
        ckpt,
        model_state(model),
        model.config,
        tok,
        round_idx=round_idx,
        strategy="fedatt",
        extra={
            "metrics": metrics
            if metrics is not None
            else {"val_ppl": val_ppl, "test_ppl": val_ppl + 5},
            **({"server": server} if server is not None else {}),
        },
    )
    dest_dir.mkdir(parents=True, exist_ok=True)
    return export_model(ckpt, dest_dir / "model.onnx")


class ThreadServer:
    """An ASGI app under uvicorn in a background thread, on a free loopback port."""

    def __init__(self, app, **settings):
        """`settings`: more of uvicorn.Config's (a service's limits)."""
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", **settings
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start: its thread ended")
            return self.server.started

        wait_for(started, timeout=20, every=0.02, what="uvicorn did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
