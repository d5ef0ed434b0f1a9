"""The round lifecycle of `fedkey server`: the engine's Federation driven by devices over HTTP.

The routes in server/app.py are thin; everything here is plain asyncio logic, driven the same
way `fedkey simulate` drives the engine so the same seed gives bitwise-identical global weights:

    open       federation.plan_round(enrolled devices, attempt) -> cohort; each selected device
               gets its task (TrainConfig of the plan, seed client_seed(seed, round, device))
    collect    loss reports and uploads (validated, written atomically, one Receipt each);
               FedMed topK: once every selected device reported (or at the deadline)
               federation.choose_uploaders decides who uploads; otherwise everyone uploads
    aggregate  when every expected upload is in, or at the deadline with >= quorum:
               federation.complete_round(plan, updates) in a worker thread (checkpoint, metrics)
    fail       at the deadline with < quorum: nothing applied, the round is opened again with
               attempt + 1 (a fresh draw)

One driver task makes every transition, so transitions never race; request handlers only record
what devices send and poke it. Long-polls wait on a change notification.

Restart: the checkpoint is the source of truth. On start, federation.resume() restores the
weights and the strategy/accountant memory; the database's metrics table is rebuilt from the
repaired metrics.jsonl; a round the database still calls open but the checkpoint already holds
(a crash between the checkpoint write and the database commit) is marked aggregated; the open
round after the checkpoint is continued with the same cohort, attempt, receipts and uploads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from safetensors.torch import load as st_load
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from corpora.dataset import server_data
from models.checkpoint import public_bytes
from server import validation
from server.db import Device, MetricRow, Receipt, Round, hash_token, make_sessionmaker
from server.engine import Federation, RoundPlan, client_seed
from server.events import EventBus
from server.settings import MAX_WAIT, Settings
from server.storage import RunStorage
from server.strategies import ClientUpdate
from server.strategies.selection import cohort_size
from server.validation import ValidationError

log = logging.getLogger("fedkey.server")

DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ApiError(ValidationError):
    """A refused request: HTTP status, a message for people, a short reason for metrics/events."""


class Telemetry:
    """Prometheus metrics in a registry of their own (several apps can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.uploads_accepted = Counter(
            "fedkey_uploads_accepted", "Updates accepted (duplicates not counted)", registry=r
        )
        self.uploads_rejected = Counter(
            "fedkey_uploads_rejected",
            "Updates (kind=update) and loss reports (kind=loss) refused",
            ["reason", "kind"],
            registry=r,
        )
        self.loss_reports = Counter("fedkey_loss_reports", "Loss reports accepted", registry=r)
        self.rounds_completed = Counter(
            "fedkey_rounds_completed", "Rounds aggregated into the global model", registry=r
        )
        self.rounds_failed = Counter(
            "fedkey_rounds_failed", "Round attempts that missed their quorum", registry=r
        )
        self.current_round = Gauge("fedkey_current_round", "The round open or next", registry=r)
        self.devices = Gauge("fedkey_devices_enrolled", "Enrolled devices", registry=r)
        self.aggregation_seconds = Histogram(
            "fedkey_aggregation_seconds",
            "Aggregate + privacy + evaluate + checkpoint, per round",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )


@dataclass
class Upload:
    receipt: str
    sha256: str
    bytes: int
    path: str
    num_samples: int
    train_loss: float

    def reply(self, round_idx: int) -> dict:
        return {
            "receipt": self.receipt,
            "round": round_idx,
            "sha256": self.sha256,
            "bytes": self.bytes,
        }


@dataclass
class OpenRound:
    row_id: int
    plan: RoundPlan
    opened_at: float
    deadline: float
    losses: dict[str, tuple[float, int]] = field(default_factory=dict)
    uploaders: list[str] | None = None  # the topK decision (None: pending, or no topK)
    uploads: dict[str, Upload] = field(default_factory=dict)

    @property
    def number(self) -> int:
        return self.plan.round

    @property
    def attempt(self) -> int:
        return self.plan.attempt


class Coordinator:
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

        self.state = "starting"  # waiting | open | aggregating | finished
        self.current: OpenRound | None = None
        self.federation: Federation | None = None
        self.sessions = None
        self.devices: dict[str, int] = {}  # device id -> num_samples
        self._tokens: dict[str, str] = {}  # token hash -> device id
        self._last_seen: dict[str, float] = {}
        self._given: dict[str, dict] = {}  # device id -> the view it was last answered
        self._next_attempt = 0
        self._model: tuple[int, bytes, str] | None = None  # (round, checkpoint bytes, sha256)
        self._exporting: asyncio.Task | None = None
        self._exported_round: int | None = None
        self._changed = asyncio.Event()
        self._poke = asyncio.Event()
        self._stopping = False
        self._driver: asyncio.Task | None = None
        self.finish_reason: str | None = None

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the data, build or resume the federation, reconcile the database, start driving."""
        torch.set_num_threads(1)
        s = self.settings
        self.root.mkdir(parents=True, exist_ok=True)
        self.sessions = make_sessionmaker(s.db_url)
        if self.generated_secret:
            log.warning(
                "no enrollment secret configured; generated one: %s", self.enrollment_secret
            )
        corpus, tokenizer = await asyncio.to_thread(server_data, s.data_config())
        model_config = s.build_model_config(tokenizer.vocab_size)
        storage = RunStorage(self.root)
        fed = Federation(
            s.federation_config(),
            model_config,
            tokenizer,
            {},  # sizes come from enrollment (strategy.setup before each plan_round)
            corpus.valid,
            corpus.test,
            storage,
        )
        self.federation = fed
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
        if self.state == "finished" and self.settings.exit_when_done and self.on_finished:
            self.on_finished()  # restarted after the run was over: nothing to do

    def begin_shutdown(self) -> None:
        """Wake every long-poll so connections close promptly (the driver finishes its step)."""
        self._stopping = True
        self._notify()
        self._poke.set()

    async def stop(self) -> None:
        """Stop after the current step; an aggregation in progress is completed, not abandoned."""
        self.begin_shutdown()
        if self._driver is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        self.events.close()
        if self.sessions is not None:
            self.sessions.kw["bind"].dispose()

    # -- reconciliation on start -------------------------------------------------------------------

    def _reconcile(self) -> None:
        fed = self.federation
        done = fed.round
        rows = fed.storage.read_metrics()  # already repaired by resume(): rounds 0..done
        with self.sessions.begin() as db:
            db.execute(delete(MetricRow))
            for row in rows:
                db.add(MetricRow(round=row["round"], row=row))
            # rounds the checkpoint holds but the database did not record as aggregated
            for r in db.scalars(select(Round).where(Round.number <= done)):
                if r.state in ("open", "aggregating"):
                    r.state = "aggregated"
            db.execute(delete(Round).where(Round.number > done + 1))
            db.execute(delete(Receipt).where(Receipt.round > done + 1))
            pending = db.scalars(
                select(Round).where(Round.number == done + 1).order_by(Round.attempt)
            ).all()
            live = [r for r in pending if r.state in ("open", "aggregating")]
            for r in pending:
                if r.state == "aggregated":  # the checkpoint does not have it: never applied
                    r.state = "failed"
            self._next_attempt = max((r.attempt + 1 for r in pending), default=0)
            if live and not self._finished():
                row = live.pop()
                for earlier in pending:  # strategy.setup as the earlier attempts called it
                    if earlier.attempt < row.attempt:
                        self._setup_strategy(list(earlier.available))
                self._continue_round(db, row)
            for r in live:  # several open attempts, or a run already over: never applied
                r.state = "failed"
        self._cleanup_uploads()
        if self.current is None:
            self.state = "finished" if self._finished() else "waiting"
            if self.state == "finished":
                self.finish_reason = self._finish_reason()
        self._set_round_gauge()

    def _continue_round(self, db, row: Round) -> None:
        """Rebuild the open round `row` from the database: cohort, attempt, receipts, uploads."""
        fed = self.federation
        # Replay the draw exactly as it was made: same devices known, same attempt.
        self._setup_strategy(list(row.available))
        plan = fed.plan_round(list(row.available), row.attempt)
        if plan.cohort != list(row.cohort):
            log.warning(
                "round %d: replayed draw %s differs from the stored cohort", row.number, plan.cohort
            )
        plan.cohort = list(row.cohort)
        now = time.time()
        grace = min(self.settings.upload_grace, self.settings.round_deadline)
        row.deadline = max(row.deadline, now + grace)  # devices could not reach a dead server
        row.state = "open"
        r = OpenRound(row.id, plan, row.opened_at, row.deadline, uploaders=row.uploaders)
        receipts = db.scalars(
            select(Receipt).where(Receipt.round == row.number, Receipt.attempt == row.attempt)
        ).all()
        for rec in receipts:
            if rec.kind == "loss":
                r.losses[rec.device_id] = (rec.train_loss, rec.num_samples)
            elif rec.path and Path(rec.path).exists():
                r.uploads[rec.device_id] = Upload(
                    rec.receipt, rec.sha256, rec.bytes, rec.path, rec.num_samples, rec.train_loss
                )
            else:  # the file is gone: let the device upload again
                db.delete(rec)
        self.current = r
        self.state = "open"
        log.info(
            "continuing round %d (attempt %d): %d/%d uploads in",
            r.number,
            r.attempt,
            len(r.uploads),
            len(plan.cohort),
        )

    def _cleanup_uploads(self) -> None:
        """Remove upload folders of rounds already in the checkpoint (unless keep_uploads)."""
        if self.settings.keep_uploads or not self.uploads_dir.exists():
            return
        for d in self.uploads_dir.glob("round_*"):
            try:
                n = int(d.name.split("_", 1)[1])
            except ValueError:
                continue
            if n <= self.federation.round:
                shutil.rmtree(d, ignore_errors=True)
        cur = self.current
        if cur is not None:  # stale temp files of an interrupted upload
            for tmp in self._round_dir(cur.number).glob(".tmp-*"):
                tmp.unlink(missing_ok=True)

    # -- the global model ------------------------------------------------------------------------

    def _load_model(self) -> None:
        fed = self.federation
        data = public_bytes(fed.storage.checkpoint_path(fed.round))
        self._model = (fed.round, data, hashlib.sha256(data).hexdigest())

    # -- ONNX exports for the keyboard ------------------------------------------------------------

    def _schedule_export(self) -> None:
        """With export_dir, export the newest global model to ONNX in the background: one export
        at a time, always of the newest round (rounds finished meanwhile are skipped)."""
        if self.settings.export_dir is None or self._exporting:
            return
        self._exporting = asyncio.create_task(self._export_newest(), name="fedkey-export")

    async def _export_newest(self) -> None:
        try:
            while self._exported_round != self.federation.round:
                r = self.federation.round
                path = self.federation.storage.checkpoint_path(r)
                try:
                    report = await asyncio.to_thread(self._export, path)
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

    def _export(self, checkpoint: Path):
        from export.onnx_export import export_checkpoint

        out = Path(self.settings.export_dir) / "model.onnx"
        return export_checkpoint(checkpoint, out)

    def model(self) -> tuple[int, bytes, str]:
        """(round, checkpoint bytes, sha256) of the current global model."""
        return self._model

    # -- devices -----------------------------------------------------------------------------------

    def enroll(self, secret: Any, name: Any = None, num_samples: Any = None) -> dict:
        if not isinstance(secret, str) or not hmac.compare_digest(
            secret.encode(), self.enrollment_secret.encode()
        ):
            raise ApiError(401, "wrong or missing enrollment secret", "unauthorized")
        if name is not None and (not isinstance(name, str) or not DEVICE_NAME.match(name)):
            raise ApiError(
                422,
                "name must be 1-64 characters: letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                "bad_request",
            )
        if num_samples is None:
            num_samples = 1
        elif isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ApiError(422, "num_samples must be a non-negative integer", "bad_request")
        device_id = name or f"dev-{secrets.token_hex(6)}"
        if device_id in self.devices:
            raise ApiError(409, f"device name {device_id!r} is already enrolled", "name_taken")
        token = secrets.token_urlsafe(32)
        token_hash = hash_token(token)
        now = time.time()
        try:
            with self.sessions.begin() as db:
                db.add(
                    Device(
                        id=device_id,
                        name=device_id,
                        token_hash=token_hash,
                        num_samples=num_samples,
                        enrolled_at=now,
                        last_seen=now,
                    )
                )
        except IntegrityError:
            raise ApiError(
                409, f"device name {device_id!r} is already enrolled", "name_taken"
            ) from None
        self.devices[device_id] = num_samples
        self._tokens[token_hash] = device_id
        self.telemetry.devices.set(len(self.devices))
        self.events.publish("device_enrolled", device_id=device_id, devices=len(self.devices))
        self._poke.set()
        return {"device_id": device_id, "token": token}

    def authenticate(self, authorization: str | None) -> str:
        """`Authorization: Bearer <token>` -> device id, or 401."""
        if not authorization:
            raise ApiError(401, "missing 'Authorization: Bearer <token>' header", "unauthorized")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "the Authorization header must be 'Bearer <token>'", "unauthorized")
        device_id = self._tokens.get(hash_token(token.strip()))
        if device_id is None:
            raise ApiError(401, "unknown device token: enroll first", "unauthorized")
        now = time.time()
        if now - self._last_seen.get(device_id, 0.0) > 30:
            self._last_seen[device_id] = now
            with self.sessions.begin() as db:
                dev = db.get(Device, device_id)
                if dev is not None:
                    dev.last_seen = now
        return device_id

    # -- what a device sees --------------------------------------------------------------------------

    def _upload_flag(self, r: OpenRound, device_id: str) -> bool | None:
        if device_id not in r.plan.cohort:
            return False
        if not self.settings.topk:
            return True
        if r.uploaders is None:
            return None
        return device_id in r.uploaders

    def task(self, r: OpenRound, device_id: str) -> dict:
        t = r.plan.train
        p = self.federation.config.privacy
        return {
            "local_epochs": t.epochs,
            "batch_size": t.batch_size,
            "lr": t.lr,
            "momentum": t.momentum,
            "clip": t.clip,
            "max_len": t.max_len,
            "batching": t.batching,
            "seed": client_seed(self.federation.config.seed, r.number, device_id),
            "beta": p.beta,
            "sigma": p.sigma,
            "deadline": r.deadline,
            "model_round": r.number - 1,
        }

    def view(self, device_id: str) -> dict:
        """GET /v1/rounds/current for `device_id`."""
        r = self.current
        if r is None:
            done = self.federation.round
            return {
                "round": done if self.state == "finished" else done + 1,
                "attempt": 0 if self.state == "finished" else self._next_attempt,
                "state": self.state,
                "selected": False,
                "task": None,
                "loss_reported": False,
                "uploaded": False,
                "upload": False,
            }
        selected = device_id in r.plan.cohort
        return {
            "round": r.number,
            "attempt": r.attempt,
            "state": self.state,
            "selected": selected,
            "task": self.task(r, device_id) if selected else None,
            "loss_reported": device_id in r.losses,
            "uploaded": device_id in r.uploads,
            "upload": self._upload_flag(r, device_id),
        }

    def everyone_told_finished(self) -> bool:
        """The run is finished and every enrolled device has been answered so."""
        return self.state == "finished" and all(
            self._given.get(d, {}).get("state") == "finished" for d in self.devices
        )

    async def wait_view(self, device_id: str, wait: float) -> dict:
        """Long-poll: at once when the view differs from the one this device was last given
        (so no transition is missed between two polls), else the first change within `wait`."""
        view = self.view(device_id)
        if wait > 0 and view == self._given.get(device_id):
            await self._wait_until(lambda: self.view(device_id) != view, wait)
            view = self.view(device_id)
        self._given[device_id] = view
        return view

    async def _wait_until(self, predicate: Callable[[], bool], wait: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, min(float(wait), MAX_WAIT))
        while not predicate():
            remaining = end - loop.time()
            if remaining <= 0 or self._stopping:
                return False
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        return True

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def health(self) -> dict:
        r = self.current
        if r is not None:
            n = r.number
        elif self.federation is None:
            n = 0
        else:
            n = self.federation.round + (0 if self.state == "finished" else 1)
        return {"status": "ok", "round": n, "state": self.state}

    def metrics_rows(self) -> list[dict]:
        with self.sessions() as db:
            return [m.row for m in db.scalars(select(MetricRow).order_by(MetricRow.round))]

    # -- requests: loss reports and uploads ----------------------------------------------------------

    def _open_round_for(self, device_id: str, n: int) -> OpenRound:
        """The open round `n` with `device_id` selected, or 409 / 403."""
        r = self.current
        if self.state == "finished":
            raise ApiError(
                409, f"the run is finished after round {self.federation.round}", "stale_round"
            )
        if r is None:
            nxt = self.federation.round + 1
            reason = "stale_round" if n < nxt else "future_round" if n > nxt else "not_open"
            raise ApiError(409, f"round {n} is not open: round {nxt} has not opened yet", reason)
        if n != r.number:
            which = "stale" if n < r.number else "future"
            raise ApiError(
                409,
                f"round {n} is not the open round ({which}); round {r.number} is",
                f"{which}_round",
            )
        if self.state != "open":
            raise ApiError(
                409, f"round {n} is closed and being aggregated; wait for the next", "stale_round"
            )
        if device_id not in r.plan.cohort:
            raise ApiError(
                403, f"device {device_id!r} is not selected in round {n}", "not_selected"
            )
        return r

    def _reject(self, device_id: str | None, n: int | None, kind: str, e: ValidationError) -> None:
        self.telemetry.uploads_rejected.labels(reason=e.reason, kind=kind).inc()
        self.events.publish(
            "update_rejected",
            round=n,
            device_id=device_id,
            kind=kind,
            reason=e.reason,
            status=e.status,
            detail=e.message,
        )

    async def report_loss(
        self, authorization: str | None, n: int, body: bytes, wait: float = 0.0
    ) -> dict:
        """POST /v1/rounds/{n}/loss -> {"upload": true|false|null}."""
        device_id = None
        try:
            device_id = self.authenticate(authorization)
            r = self._open_round_for(device_id, n)
            train_loss, num_samples = _parse_loss_body(body)
            if device_id in r.losses:
                if r.losses[device_id] != (train_loss, num_samples):
                    raise ApiError(
                        409,
                        f"device {device_id!r} already reported a different loss for round {n}",
                        "duplicate",
                    )
            else:
                if r.uploaders is not None:
                    raise ApiError(
                        403,
                        f"round {n}'s uploaders were already chosen without device {device_id!r}",
                        "not_selected",
                    )
                now = time.time()
                with self.sessions.begin() as db:
                    db.add(
                        Receipt(
                            receipt=secrets.token_hex(16),
                            round=n,
                            attempt=r.attempt,
                            device_id=device_id,
                            kind="loss",
                            train_loss=train_loss,
                            num_samples=num_samples,
                            created_at=now,
                        )
                    )
                r.losses[device_id] = (train_loss, num_samples)
                self.telemetry.loss_reports.inc()
                self._notify()
                self._poke.set()
        except ValidationError as e:
            self._reject(device_id, n, "loss", e)
            raise
        if wait > 0:
            await self._wait_until(
                lambda: self.current is not r or self._upload_flag(r, device_id) is not None, wait
            )
        return {"upload": self._upload_flag(r, device_id) if self.current is r else None}

    async def receive_update(
        self,
        authorization: str | None,
        n: int,
        headers: Mapping[str, str],
        body: AsyncIterator[bytes],
    ) -> dict:
        """POST /v1/rounds/{n}/update: validate, store atomically, record a receipt."""
        device_id = None
        tmp: Path | None = None
        try:
            device_id = self.authenticate(authorization)
            r = self._open_round_for(device_id, n)
            self._check_may_upload(r, device_id)
            existing = r.uploads.get(device_id)
            try:
                validation.check_content_length(headers.get("content-length"), self.upload_limit)
                data = await validation.read_limited(body, self.upload_limit)
            except ValidationError as e:
                if e.status == 413 and existing is not None:  # surely not the same bytes
                    raise _different_duplicate(device_id, n) from None
                raise
            sha = hashlib.sha256(data).hexdigest()
            if existing is not None:
                if existing.sha256 == sha:
                    return existing.reply(n)
                raise _different_duplicate(device_id, n)
            config = self.federation.model_config
            await asyncio.to_thread(validation.parse_update, data, config)
            num_samples = validation.parse_num_samples(headers.get(validation.NUM_SAMPLES_HEADER))
            train_loss = validation.parse_train_loss(headers.get(validation.TRAIN_LOSS_HEADER))
            tmp = await asyncio.to_thread(self._write_temp, n, device_id, data)
            # The round may have moved on while the body streamed in: check again, then commit.
            if self.current is not r:
                raise ApiError(
                    409, f"round {n} closed while the update was received", "stale_round"
                )
            r = self._open_round_for(device_id, n)
            existing = r.uploads.get(device_id)
            if existing is not None:
                if existing.sha256 == sha:
                    return existing.reply(n)
                raise _different_duplicate(device_id, n)
            final = self._round_dir(n) / f"{device_id}.safetensors"
            os.replace(tmp, final)
            tmp = None
            up = Upload(secrets.token_hex(16), sha, len(data), str(final), num_samples, train_loss)
            with self.sessions.begin() as db:
                db.add(
                    Receipt(
                        receipt=up.receipt,
                        round=n,
                        attempt=r.attempt,
                        device_id=device_id,
                        kind="update",
                        train_loss=train_loss,
                        num_samples=num_samples,
                        sha256=sha,
                        bytes=len(data),
                        path=str(final),
                        created_at=time.time(),
                    )
                )
            r.uploads[device_id] = up
        except ValidationError as e:
            self._reject(device_id, n, "update", e)
            raise
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        self.telemetry.uploads_accepted.inc()
        self.events.publish(
            "update_received",
            round=n,
            attempt=r.attempt,
            device_id=device_id,
            bytes=up.bytes,
            sha256=sha,
            received=len(r.uploads),
            expected=len(self._expected(r)) if self._expected(r) is not None else None,
        )
        self._notify()
        self._poke.set()
        return up.reply(n)

    def _check_may_upload(self, r: OpenRound, device_id: str) -> None:
        flag = self._upload_flag(r, device_id)
        if flag is None:
            raise ApiError(
                403,
                f"round {r.number}: the topK decision is pending; report your loss and poll "
                "/v1/rounds/current until 'upload' is true",
                "not_selected",
            )
        if flag is False:
            raise ApiError(
                403,
                f"device {device_id!r} was not chosen to upload in round {r.number} (topK)",
                "not_selected",
            )

    def _round_dir(self, n: int) -> Path:
        return self.uploads_dir / f"round_{n:04d}"

    def _write_temp(self, n: int, device_id: str, data: bytes) -> Path:
        d = self._round_dir(n)
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".tmp-{device_id}-", suffix=".safetensors")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return Path(tmp)

    # -- the driver: every transition happens here ---------------------------------------------------

    async def _drive(self) -> None:
        while not self._stopping:
            self._poke.clear()
            try:
                while not self._stopping and await self._step():
                    pass
            except Exception:  # keep serving; the next poke or deadline tries again
                log.exception("round driver step failed")
                await asyncio.sleep(1.0)
            if self._stopping:
                break
            timeout = None
            if self.state == "open" and self.current is not None:
                timeout = max(0.0, self.current.deadline - time.time()) + 0.01
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), timeout)

    async def _step(self) -> bool:
        """Make at most one transition; True when something changed (then step again)."""
        if self.state == "finished":
            return False
        if self.state == "waiting":
            if self._finished():
                self._finish()
                return True
            if len(self.devices) >= self.settings.wait_devices:
                self._open_round()
                return True
            return False
        r = self.current
        if self.state != "open" or r is None:
            return False
        now = time.time()
        if self.settings.topk and r.uploaders is None:
            if set(r.losses) >= set(r.plan.cohort):
                self._decide(r, now)
                return True
            if now < r.deadline:
                return False
            if not r.losses:
                self._fail(r, "no loss reports before the deadline")
                return True
            self._decide(r, now)
            quorum = self._quorum(r)
            if len(r.uploaders) < quorum:
                self._fail(r, f"{len(r.uploaders)} uploaders chosen, quorum {quorum}")
            return True
        expected = self._expected(r)
        if set(r.uploads) >= set(expected):
            await self._aggregate(r)
            return True
        if now >= r.deadline:
            quorum = self._quorum(r)
            if len(r.uploads) >= quorum:
                await self._aggregate(r)
            else:
                self._fail(r, f"{len(r.uploads)} updates received, quorum {quorum}")
            return True
        return False

    def _expected(self, r: OpenRound) -> list[str] | None:
        """Who must upload: the topK uploaders once chosen (None before), else the cohort."""
        if self.settings.topk:
            return r.uploaders
        return r.plan.cohort

    def _quorum(self, r: OpenRound) -> int:
        if self.settings.topk:
            expected = cohort_size(self.settings.topk_beta, len(r.plan.cohort))
        else:
            expected = len(r.plan.cohort)
        return self.settings.quorum_for(expected)

    def _finished(self) -> bool:
        fed = self.federation
        return fed.round >= fed.config.rounds or fed.budget_spent

    def _finish_reason(self) -> str:
        fed = self.federation
        if fed.round >= fed.config.rounds:
            return f"all {fed.config.rounds} rounds done"
        return (
            f"privacy budget: another round would pass epsilon {fed.config.privacy.target_epsilon}"
        )

    def _finish(self) -> None:
        self.state = "finished"
        self.current = None
        self.finish_reason = self._finish_reason()
        self._set_round_gauge()
        log.info("run finished: %s", self.finish_reason)
        self.events.publish("run_finished", round=self.federation.round, reason=self.finish_reason)
        self._notify()
        if self.settings.exit_when_done and self.on_finished is not None:
            self.on_finished()

    def _setup_strategy(self, available: list[str]) -> None:
        """strategy.setup for devices it has not seen yet (AdaFL's n_k), before a plan_round."""
        strategy = self.federation.strategy
        new = {d: self.devices.get(d, 1) for d in available if d not in strategy.client_sizes}
        if new:
            strategy.setup(new, self.federation.config.rounds)

    def _open_round(self) -> None:
        fed = self.federation
        available = sorted(self.devices)
        self._setup_strategy(available)
        attempt = self._next_attempt
        plan = fed.plan_round(available, attempt)
        now = time.time()
        deadline = now + self.settings.round_deadline
        with self.sessions.begin() as db:
            row = Round(
                number=plan.round,
                attempt=attempt,
                state="open",
                available=available,
                cohort=plan.cohort,
                uploaders=None,
                opened_at=now,
                deadline=deadline,
            )
            db.add(row)
            db.flush()
            row_id = row.id
        self.current = OpenRound(row_id, plan, now, deadline)
        self.state = "open"
        self._set_round_gauge()
        log.info(
            "round %d (attempt %d) open: %d of %d devices selected",
            plan.round,
            attempt,
            len(plan.cohort),
            len(available),
        )
        self.events.publish(
            "round_opened",
            round=plan.round,
            attempt=attempt,
            cohort=plan.cohort,
            deadline=deadline,
            model_round=fed.round,
        )
        self._notify()

    def _decide(self, r: OpenRound, now: float) -> None:
        """FedMed topK: the engine chooses the uploaders among the devices that reported."""
        losses = {d: loss for d, (loss, _) in r.losses.items()}
        r.uploaders = self.federation.choose_uploaders(r.plan, losses)
        r.deadline = max(r.deadline, now + self.settings.upload_grace)
        with self.sessions.begin() as db:
            row = db.get(Round, r.row_id)
            row.uploaders = r.uploaders
            row.deadline = r.deadline
        log.info("round %d: topK chose %s of %d reporters", r.number, r.uploaders, len(losses))
        self._notify()

    def _fail(self, r: OpenRound, why: str) -> None:
        """Quorum missed: nothing applied; the same round opens again with attempt + 1."""
        with self.sessions.begin() as db:
            db.get(Round, r.row_id).state = "failed"
        for up in r.uploads.values():
            Path(up.path).unlink(missing_ok=True)
        self.current = None
        self.state = "waiting"
        self._next_attempt = r.attempt + 1
        self.telemetry.rounds_failed.inc()
        log.warning("round %d attempt %d failed: %s", r.number, r.attempt, why)
        self.events.publish(
            "round_failed",
            round=r.number,
            attempt=r.attempt,
            reason=why,
            received=len(r.uploads),
            quorum=self._quorum(r),
        )
        self._notify()

    async def _aggregate(self, r: OpenRound) -> None:
        self.state = "aggregating"
        with self.sessions.begin() as db:
            db.get(Round, r.row_id).state = "aggregating"
        self._notify()
        uploads = sorted(r.uploads.items())
        start = time.perf_counter()
        try:
            row = await asyncio.to_thread(self._complete, r.plan, uploads)
        except Exception as e:  # all or nothing: the engine left everything as before
            log.exception("round %d: aggregation failed", r.number)
            self.state = "open"
            self._fail(r, f"aggregation failed: {type(e).__name__}: {e}")
            return
        self.telemetry.aggregation_seconds.observe(time.perf_counter() - start)
        # The checkpoint and metrics.jsonl are written: record it (a crash here is reconciled).
        with self.sessions.begin() as db:
            db.get(Round, r.row_id).state = "aggregated"
            db.merge(MetricRow(round=row["round"], row=row))
        self._load_model()
        self._schedule_export()
        if not self.settings.keep_uploads:
            shutil.rmtree(self._round_dir(r.number), ignore_errors=True)
        self.current = None
        self.state = "waiting"
        self._next_attempt = 0
        self.telemetry.rounds_completed.inc()
        log.info(
            "round %d aggregated %d updates: val_ppl %.2f test_ppl %.2f",
            row["round"],
            len(row["aggregated"]),
            row["val_ppl"],
            row["test_ppl"],
        )
        self.events.publish(
            "round_aggregated",
            round=row["round"],
            attempt=r.attempt,
            aggregated=row["aggregated"],
            val_ppl=row["val_ppl"],
            test_ppl=row["test_ppl"],
            epsilon=row["epsilon"],
        )
        self._notify()

    def _complete(self, plan: RoundPlan, uploads: list[tuple[str, Upload]]) -> dict:
        """In a worker thread: load the uploads and let the engine complete the round."""
        updates = [
            ClientUpdate(
                state=st_load(Path(up.path).read_bytes()),
                num_samples=up.num_samples,
                train_loss=up.train_loss,
                device_id=device_id,
            )
            for device_id, up in uploads
        ]
        return self.federation.complete_round(plan, updates)

    def _set_round_gauge(self) -> None:
        self.telemetry.current_round.set(self.health()["round"])


def _different_duplicate(device_id: str, n: int) -> ApiError:
    return ApiError(
        409,
        f"device {device_id!r} already uploaded a different update for round {n}",
        "duplicate",
    )


def _parse_loss_body(raw: bytes) -> tuple[float, int]:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ApiError(
            422,
            'the body must be a JSON object {"train_loss": float, "num_samples": int}',
            "bad_loss",
        )
    loss, n = body.get("train_loss"), body.get("num_samples")
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        raise ApiError(422, "train_loss must be a number", "bad_loss")
    if isinstance(n, bool) or not isinstance(n, int):
        raise ApiError(422, "num_samples must be an integer", "bad_loss")
    try:
        validation.check_loss_report(float(loss), n)
    except ValidationError as e:
        raise ApiError(e.status, e.message, e.reason) from None
    return float(loss), n
