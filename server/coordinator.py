"""The round lifecycle of `fedkey server`: the engine's Federation driven by devices over HTTP.

The routes in server/api/ are thin; everything here is plain asyncio logic, driven the same
way `fedkey simulate` drives the engine so the same seed gives bitwise-identical global weights:

    open       federation.plan_round(enrolled devices, attempt) -> cohort; each selected device
               gets its task (TrainConfig of the plan, seed client_seed(seed, round, device))
    collect    loss reports and uploads (validated, written atomically, one Receipt each);
               FedMed topK: once every selected device reported (or at the deadline)
               federation.choose_uploaders decides who uploads; otherwise everyone uploads
    aggregate  when every expected upload is in, or at the deadline with >= quorum:
               federation.complete_round(plan, updates) in the aggregation process
               (server.aggregator; checkpoint, metrics), the result adopted here
    fail       at the deadline with < quorum: nothing applied, the round is opened again with
               attempt + 1 (a fresh draw)

One driver task makes every transition, so transitions never race; request handlers only record
what devices send and poke it. Long-polls wait on a change notification.

Restart: the checkpoint is the source of truth. On start, federation.resume() restores the
weights and the strategy/accountant memory; the database's metrics table is rebuilt from the
repaired metrics.jsonl; a round the database still calls open but the checkpoint already holds
(a crash between the checkpoint write and the database commit) is marked aggregated; the open
round after the checkpoint is continued with the same cohort, attempt, receipts and uploads.

The parts, one job each, are mixins of Coordinator over one shared state (server.rounds):
server.devices (enrollment, views, long-polls), server.uploads (loss reports, uploads),
server.driver (the transitions), server.recovery (restart); server.telemetry the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import delete, select

from corpora.dataset import server_data
from models.exposure import ExposureProbe
from server.aggregator import Aggregator
from server.db import BatchWriter, Device, MetricRow, Receipt, Round, finite_json, make_sessionmaker
from server.devices import DEVICE_NAME, DevicesMixin
from server.driver import DriverMixin
from server.engine import Federation
from server.events import EventBus
from server.recovery import RecoveryMixin
from server.rounds import ApiError, OpenRound, RoundState, Upload
from server.settings import Settings
from server.storage import RunStorage
from server.telemetry import Telemetry, watch_loop_lag
from server.threads import io_executor
from server.uploads import UploadsMixin

log = logging.getLogger("fedkey.server")

__all__ = ["DEVICE_NAME", "ApiError", "Coordinator", "OpenRound", "Telemetry", "Upload"]


class Coordinator(DevicesMixin, UploadsMixin, DriverMixin, RecoveryMixin):
    """The round lifecycle of `fedkey server`; the routes of server/api/ call its public methods."""

    def __init__(self, settings: Settings, telemetry: Telemetry | None = None):
        self.settings = settings
        self.telemetry = telemetry or Telemetry()
        self.events = EventBus(settings.event_queue_size)
        self.root = Path(settings.storage).resolve()
        self.uploads_dir = self.root / "uploads"
        secret = settings.enrollment_secret
        self.enrollment_secret = secret.get_secret_value() if secret else secrets.token_urlsafe(16)
        self.generated_secret = secret is None
        self.on_finished: Callable[[], None] | None = None  # serve() shuts uvicorn down with it

        self.state = RoundState.STARTING  # waiting | open | aggregating | finished
        self.current: OpenRound | None = None
        self.federation: Federation | None = None
        self.aggregator: Aggregator | None = None
        self.sessions = None
        self.devices: dict[str, int] = {}  # device id -> num_samples
        self._tokens: dict[str, str] = {}  # token hash -> device id
        self._enrolling: set[str] = set()
        self._last_seen: dict[str, float] = {}
        self._seen_unwritten: set[str] = set()
        self._stopped = asyncio.Event()
        self._last_seen_task: asyncio.Task | None = None
        self._lag_task: asyncio.Task | None = None
        self._given: dict[str, dict] = {}  # device id -> the view it was last answered
        self._next_attempt = 0
        self._retry_aggregation_at = 0.0
        self._unrecorded: list[tuple[int, dict]] = []
        self._model: tuple[int, bytes, str] | None = None  # (round, checkpoint bytes, sha256)
        self._exporting: asyncio.Task | None = None
        self._deletions: set[asyncio.Task] = set()  # aggregated rounds' uploads being deleted
        self._exported_round: int | None = None
        self._waiters: dict[str, asyncio.Event] = {}
        self._poke = asyncio.Event()
        self._receiving = asyncio.Semaphore(settings.max_receiving)
        # GET /v1/model bodies being sent (settings.max_sending at once): taken and released by
        # the route's response (server.api.routes_model), which knows nothing else of the round.
        self.sending = asyncio.Semaphore(settings.max_sending)
        self._stopping = False
        self._driver: asyncio.Task | None = None
        self.finish_reason: str | None = None

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the data, build or resume the federation, reconcile the database, start driving."""
        torch.set_num_threads(1)
        asyncio.get_running_loop().set_default_executor(io_executor())
        s = self.settings
        self.root.mkdir(parents=True, exist_ok=True)
        self.sessions = make_sessionmaker(s.db_url)
        self.db_writer = BatchWriter(self.sessions)
        if self.generated_secret:
            log.warning(
                "no enrollment secret configured; generated one: %s", self.enrollment_secret
            )
        corpus, tokenizer = await asyncio.to_thread(server_data, s.data_config())
        model_config = s.build_model_config(tokenizer.vocab_size)
        storage = RunStorage(self.root)
        secret = s.canary_secret()  # --canary: the phones plant it, every row has its exposure
        spec: dict[str, Any] = dict(
            config=s.federation_config(),
            model_config=model_config,
            tokenizer=tokenizer,
            client_sizes={},  # sizes come from enrollment (strategy.setup before each plan_round)
            valid=corpus.valid,
            test=corpus.test,
            storage=storage,
            probes=[ExposureProbe(s.canary_spec(), secret)] if secret else [],
        )
        fed = Federation(**spec)
        self.federation = fed
        self.aggregator = Aggregator(fed, spec, s.aggregate_in)
        resumed = await asyncio.to_thread(fed.resume)
        if not resumed:
            storage.reset()
            await asyncio.to_thread(fed.start)
        self.upload_limit = fed.model_bytes + s.max_upload_margin
        with self.sessions.begin() as db:
            for d in db.scalars(select(Device)):
                self.devices[d.id] = d.num_samples
                self._tokens[d.token_hash] = d.id
            if not resumed:  # a fresh run: forget rounds of an earlier one, keep the devices
                db.execute(delete(Receipt))
                db.execute(delete(Round))
                db.execute(delete(MetricRow))
        self._reconcile()
        await asyncio.to_thread(self.aggregator.start)
        self._load_model()
        self._schedule_export()
        self.telemetry.devices.set(len(self.devices))
        log.info(
            "%s at round %d; %d devices enrolled; state %s",
            "resumed" if resumed else "started",
            fed.round,
            len(self.devices),
            self.state,
        )
        self._driver = asyncio.create_task(self._drive(), name="fedkey-round-driver")
        self._last_seen_task = asyncio.create_task(
            self._last_seen_writer(), name="fedkey-last-seen"
        )
        self._lag_task = asyncio.create_task(
            watch_loop_lag(self.telemetry.loop_lag, self._stopped), name="fedkey-loop-lag"
        )
        if self.state == RoundState.FINISHED and self.settings.exit_when_done and self.on_finished:
            self.on_finished()  # restarted after the run was over: nothing to do

    def begin_shutdown(self) -> None:
        """Wake every long-poll so connections close promptly (the driver finishes its step)."""
        self._stopping = True
        self._stopped.set()
        self._notify()
        self._poke.set()

    async def stop(self) -> None:
        """Stop after the current step; an aggregation in progress is completed, not abandoned."""
        self.begin_shutdown()
        if self._driver is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        if self._last_seen_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._last_seen_task  # its last batch is written
            self._last_seen_task = None
        if self._lag_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag_task
            self._lag_task = None
        await asyncio.gather(*self._deletions, return_exceptions=True)
        if self.aggregator is not None:
            await asyncio.to_thread(self.aggregator.close)
        self.events.close()
        if self.sessions is not None:
            self.sessions.kw["bind"].dispose()

    # -- the global model ------------------------------------------------------------------------

    def _load_model(self) -> None:
        fed = self.fed
        data = fed.public_checkpoint()
        self._model = (fed.round, data, hashlib.sha256(data).hexdigest())

    # -- ONNX exports for the keyboard ------------------------------------------------------------

    def _schedule_export(self) -> None:
        """With export_dir, export the newest global model to ONNX in the background: one export
        at a time, always of the newest round (rounds finished meanwhile are skipped)."""
        export_dir = self.settings.export_dir
        if export_dir is None or self._exporting:
            return
        self._exporting = asyncio.create_task(self._export_newest(export_dir), name="fedkey-export")

    async def _export_newest(self, export_dir: Path) -> None:
        try:
            while self._exported_round != self.fed.round:
                r = self.fed.round
                path = self.fed.storage.checkpoint_path(r)
                try:
                    report = await asyncio.to_thread(self._export, path, export_dir)
                except Exception as e:  # an export failure never stops the federation
                    log.exception("round %d: ONNX export failed", r)
                    self.events.publish("export_failed", round=r, reason=f"{type(e).__name__}: {e}")
                    return
                self._exported_round = r
                self.events.publish(
                    "model_exported", round=r, path=str(report.path), bytes=report.bytes
                )
        finally:
            self._exporting = None

    def _export(self, checkpoint: Path, export_dir: Path):
        from export.onnx_export import export_checkpoint

        out = export_dir / "model.onnx"
        return export_checkpoint(checkpoint, out)

    def model(self) -> tuple[int, bytes, str]:
        """(round, checkpoint bytes, sha256) of the current global model."""
        if self._model is None:
            raise RuntimeError("the coordinator is not started: start() loads the global model")
        return self._model

    def metrics_rows(self) -> list[dict]:
        """The metrics rows, NaN and infinities (a diverged run) as null: JSON has neither, and
        PostgreSQL stores them so (server.db.finite_json)."""
        with self.sessions() as db:
            rows = [m.row for m in db.scalars(select(MetricRow).order_by(MetricRow.round))]
        return [finite_json(row) for row in rows]
