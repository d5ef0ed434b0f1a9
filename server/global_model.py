"""The newest global model: the checkpoint bytes GET /v1/model serves; and, with export_dir, the
ONNX export for the keyboard, made in the background: of the round best on validation so far
(the engine's `Federation.best`), so that a round that does worse never replaces the keyboard's
model, or of every round with export_latest or under DP; its metrics row as the server publishes
it (fedkey.federation.metrics_row.public_row)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fedkey.federation.engine import Federation
from fedkey.federation.metrics_row import public_row
from fedkey.server.events import EventBus

log = logging.getLogger("fedkey.server")


class GlobalModel:
    """The federation's newest global model as served and exported; :meth:`refresh` after each
    aggregated round."""

    def __init__(
        self,
        fed: Federation,
        events: EventBus,
        export_dir: Path | None,
        export_latest: bool = False,
    ):
        self._fed = fed
        self._events = events
        self._export_dir = export_dir
        self._export_latest = export_latest
        self._model: tuple[int, bytes, str] | None = None  # (round, checkpoint bytes, sha256)
        self._exporting: asyncio.Task | None = None
        self._exported_round: int | None = None

    def refresh(self) -> None:
        """Serve the federation's newest model, and export it."""
        data = self._fed.public_checkpoint()
        self._model = (self._fed.round, data, hashlib.sha256(data).hexdigest())
        self._schedule_export()

    def current(self) -> tuple[int, bytes, str]:
        """(round, checkpoint bytes, sha256) of the model :meth:`refresh` loaded last."""
        if self._model is None:
            raise RuntimeError("the coordinator is not started: start() loads the global model")
        return self._model

    # -- ONNX exports for the keyboard ------------------------------------------------------------

    def export_round(self) -> int:
        """The round whose model the export folder should hold: the round best on validation so
        far (the newest round with export_latest, or before any round was scored). Under DP the
        newest: the choice by the phones' held-out text is a release the accountant does not
        cover (fedkey.federation.metrics_row.public_row), the newest noised model is post-processing;
        unless --dp-publish-scores publishes those scores anyway."""
        best, privacy = self._fed.best, self._fed.config.privacy
        if self._export_latest or best is None or (privacy.dp and not privacy.publish_scores):
            return self._fed.round
        return int(best["round"])

    def _schedule_export(self) -> None:
        """With export_dir, export the round :meth:`export_round` names to ONNX in the background:
        one export at a time, always of the round it names once done (rounds finished meanwhile
        are skipped). A round that is not the best on validation exports nothing."""
        export_dir = self._export_dir
        if export_dir is None or self._exporting:
            return
        self._exporting = asyncio.create_task(self._export_newest(export_dir), name="fedkey-export")

    async def _export_newest(self, export_dir: Path) -> None:
        try:
            while self._exported_round != (r := self.export_round()):
                path = self._fed.storage.checkpoint_path(r)
                try:
                    published = partial(public_row, privacy=self._fed.config.privacy)
                    ngram = self._fed.config.ngram  # --ngram: shipped beside the model
                    report = await asyncio.to_thread(_export, path, export_dir, published, ngram)
                except Exception as e:  # an export failure never stops the federation
                    log.exception("round %d: ONNX export failed", r)
                    self._events.publish(
                        "export_failed", round=r, reason=f"{type(e).__name__}: {e}"
                    )
                    return
                self._exported_round = r
                self._events.publish(
                    "model_exported", round=r, path=str(report.path), bytes=report.bytes
                )
        finally:
            self._exporting = None


def _export(
    checkpoint: Path, export_dir: Path, metrics: Callable[[dict], dict], ngram: str | None = None
):
    """The ONNX export of `checkpoint`, its metrics row as `metrics` publishes it; with the run's
    n-gram (`ngram`) beside it, mixed in with the weight the round's row measured."""
    from fedkey.export.onnx_export import export_checkpoint

    out = export_dir / "model.onnx"
    return export_checkpoint(checkpoint, out, metrics=metrics, ngram=ngram)
