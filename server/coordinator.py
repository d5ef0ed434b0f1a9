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
               (fedkey.server.aggregator; checkpoint, metrics), the result adopted here
    fail       at the deadline with < quorum: nothing applied, the round is opened again with
               attempt + 1 (a fresh draw)

One driver task makes every transition, so transitions never race; request handlers only record
what devices send and poke it. Long-polls wait on a change notification.

Restart: the checkpoint is the source of truth. On start, federation.resume() restores the
weights and the strategy/accountant memory; the database's metrics table is rebuilt from the
repaired metrics.jsonl; a round the database still calls open but the checkpoint already holds
(a crash between the checkpoint write and the database commit) is marked aggregated; the open
round after the checkpoint is continued with the same cohort, attempt, receipts and uploads.

The parts, one job each, are objects the Coordinator builds and wires, each given what it uses:

    fedkey.server.devices.DeviceRegistry   enrollment, bearer tokens, last_seen
    fedkey.server.upload_inbox.UploadInbox      loss reports and uploads of the open round
    fedkey.server.round_driver.RoundDriver       the round state and every transition
    fedkey.server.device_views                    a device's view of the round; the long-polls (LongPolls)
    fedkey.server.global_model.GlobalModel the model served and exported
    fedkey.server.recovery                 reconciliation on restart (functions)
    fedkey.server.runtime.prometheus                the metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select

from fedkey.common.files import atomic_write
from fedkey.corpora.dataset import server_data
from fedkey.federation.engine import Federation
from fedkey.federation.metrics_row import dp_events, public_row
from fedkey.federation.storage import RunStorage
from fedkey.federation.updates.validation import ValidationError
from fedkey.models.exposure import ExposureProbe
from fedkey.server import recovery
from fedkey.server.aggregator import Aggregator
from fedkey.server.db import BatchWriter, MetricRow, finite_json, make_sessionmaker
from fedkey.server.device_views import LongPolls, RoundViews
from fedkey.server.devices import DEVICE_NAME, DeviceRegistry, bearer_token
from fedkey.server.events import EventBus
from fedkey.server.global_model import GlobalModel
from fedkey.server.round_driver import RoundDriver
from fedkey.server.round_state import ApiError, OpenRound, RoundState, Upload
from fedkey.server.runtime.prometheus import Telemetry, watch_loop_lag
from fedkey.server.runtime.worker_threads import io_executor
from fedkey.server.settings import Settings
from fedkey.server.upload_inbox import UploadInbox, record_rejection

log = logging.getLogger("fedkey.server")
#: Where a server started without FEDKEY_ENROLLMENT_SECRET writes the one it generated (0600).
ENROLLMENT_SECRET_FILE = "enrollment_secret"


def shared_secret(settings: Settings) -> str | None:
    """The shared enrollment secret: the configured one, or one generated now; None when only
    minted tokens enroll (fedkey.server.enrollment)."""
    if settings.enrollment == "tokens":
        return None
    secret = settings.enrollment_secret
    return secret.get_secret_value() if secret else secrets.token_urlsafe(16)


__all__ = ["DEVICE_NAME", "ApiError", "Coordinator", "OpenRound", "Telemetry", "Upload"]


@dataclass(frozen=True)
class Parts:
    """What start() builds once the federation and the database are there."""

    driver: RoundDriver
    inbox: UploadInbox
    views: RoundViews
    model: GlobalModel


class Coordinator:
    """The round lifecycle of `fedkey server`: builds its parts and wires them (start), stops
    them (stop); the routes of server/api/ call its public methods, which hand each request to
    the part whose job it is."""

    def __init__(self, settings: Settings, telemetry: Telemetry | None = None):
        self.settings = settings
        self.telemetry = telemetry or Telemetry()
        self.privacy = settings.privacy_config()
        # Under DP the stream publishes an allow-list (fedkey.federation.metrics_row.DP_EVENTS): no phone
        # named, no free text, nothing scored on the phones' text (public_row's argument).
        self.events = EventBus(settings.event_queue_size, allow=dp_events(self.privacy))
        self.root = Path(settings.storage).resolve()
        self.uploads_dir = self.root / "uploads"
        self.enrollment_secret = shared_secret(settings)
        self.generated_secret = (
            self.enrollment_secret is not None and not settings.enrollment_secret
        )
        self.on_finished: Callable[[], None] | None = None  # serve() shuts uvicorn down with it
        self.federation: Federation | None = None
        self.aggregator: Aggregator | None = None
        self.sessions: Any = None  # sqlalchemy sessionmaker
        self.db_writer: BatchWriter | None = None  # group commits of enrollments
        self.parts: Parts | None = None
        # GET /v1/metrics's rows, with the driver's count of recorded rows they were read at
        self._rows_cache: tuple[int, list[dict]] | None = None
        self._stopped = asyncio.Event()  # set when a shutdown begins: background tasks end
        self._poke = asyncio.Event()  # wakes the round driver
        self.polls = LongPolls(self._stopped, settings.polls_per_device)
        self.registry = DeviceRegistry(
            settings=settings,
            enrollment_secret=self.enrollment_secret,
            telemetry=self.telemetry,
            events=self.events,
            on_enrolled=self._poke.set,
        )
        # GET /v1/model bodies being sent (settings.max_sending at once): taken and released by
        # the route's response (fedkey.server.api.routes_model), which knows nothing else of the round.
        self.sending = asyncio.Semaphore(settings.max_sending)
        self._tasks: list[asyncio.Task] = []  # the driver, the last_seen writer, the lag watch

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the data, build or resume the federation, reconcile the database, start driving."""
        torch.set_num_threads(1)
        asyncio.get_running_loop().set_default_executor(io_executor())
        self.root.mkdir(parents=True, exist_ok=True)
        self.sessions = make_sessionmaker(self.settings.db_url)
        db_writer = self.db_writer = BatchWriter(self.sessions)
        if self.generated_secret:  # to a file only its owner reads, never to the log
            path = self.root / ENROLLMENT_SECRET_FILE
            await asyncio.to_thread(atomic_write, path, self.enrollment_secret or "", mode=0o600)
            log.warning("no enrollment secret configured; generated one, in %s", path)
        fed, resumed = await self._build_federation()
        parts = self.parts = self._build_parts(fed, resumed, db_writer)
        await asyncio.to_thread(self._aggregator().start)
        parts.model.refresh()
        self.telemetry.devices.set(len(self.registry.devices))
        log.info(
            "%s at round %d; %d devices enrolled; state %s",
            "resumed" if resumed else "started",
            fed.round,
            len(self.registry.devices),
            parts.driver.state,
        )
        self._start_tasks(self.registry, parts.driver)
        if parts.driver.state == RoundState.FINISHED:
            self._run_finished()  # restarted after the run was over: nothing to do

    async def _build_federation(self) -> tuple[Federation, bool]:
        """The engine's Federation and its aggregator: resumed from the checkpoint (True), or a
        fresh run's (False)."""
        s = self.settings
        corpus, tokenizer = await asyncio.to_thread(server_data, s.data_config())
        storage = RunStorage(self.root)
        secret = s.canary_secret()  # --canary: the phones plant it, every row has its exposure
        spec: dict[str, Any] = dict(
            config=s.federation_config(),
            model_config=s.build_model_config(tokenizer.vocab_size),
            tokenizer=tokenizer,
            client_sizes={},  # sizes come from enrollment (strategy.setup before each plan_round)
            valid=corpus.valid,
            test=corpus.test,
            storage=storage,
            probes=[ExposureProbe(s.canary_spec(), secret)] if secret else [],
            data=corpus.name,
        )
        fed = self.federation = Federation(**spec)
        self.aggregator = Aggregator(fed, spec, s.aggregate_in)
        resumed = await asyncio.to_thread(fed.resume)
        if not resumed:
            storage.reset()
            await asyncio.to_thread(fed.start)
        return fed, resumed

    def _build_parts(self, fed: Federation, resumed: bool, db_writer: BatchWriter) -> Parts:
        """The registry opened, the database reconciled with the checkpoint (fedkey.server.recovery),
        the driver resumed where it was, the parts wired."""
        registry = self.registry
        with self.sessions.begin() as db:
            registry.open(self.sessions, db_writer, db)
            if not resumed:
                recovery.forget_rounds(db)
        model = GlobalModel(fed, self.events, self.settings.export_dir, self.settings.export_latest)
        driver = self._driver(fed, registry.devices, model.refresh)
        reconciled = recovery.reconcile(
            fed=fed,
            sessions=self.sessions,
            settings=self.settings,
            devices=registry.devices,
            uploads_dir=self.uploads_dir,
        )
        driver.resume(reconciled.current, reconciled.next_attempt)
        return self._wire(fed, registry, driver, model)

    def _driver(
        self, fed: Federation, devices: Mapping[str, int], on_new_model: Callable[[], None]
    ) -> RoundDriver:
        return RoundDriver(
            settings=self.settings,
            fed=fed,
            aggregator=self._aggregator(),
            sessions=self.sessions,
            devices=devices,
            uploads_dir=self.uploads_dir,
            polls=self.polls,
            poke=self._poke,
            stopped=self._stopped,
            on_new_model=on_new_model,
            on_finished=self._run_finished,
            telemetry=self.telemetry,
            events=self.events,
        )

    def _wire(
        self, fed: Federation, registry: DeviceRegistry, driver: RoundDriver, model: GlobalModel
    ) -> Parts:
        """The parts that read the round (the inbox, the views) joined to the driver and model."""
        inbox = UploadInbox(
            settings=self.settings,
            fed=fed,
            sessions=self.sessions,
            uploads_dir=self.uploads_dir,
            upload_limit=fed.model_bytes + self.settings.max_upload_margin,
            authenticate=registry.authenticate,
            rounds=driver,
            polls=self.polls,
            poke=self._poke.set,
            telemetry=self.telemetry,
            events=self.events,
        )
        views = RoundViews(fed, driver, registry.devices, self.polls, self.settings.topk)
        return Parts(driver, inbox, views, model)

    def _start_tasks(self, registry: DeviceRegistry, driver: RoundDriver) -> None:
        self._tasks = [
            asyncio.create_task(driver.run(), name="fedkey-round-driver"),
            asyncio.create_task(
                registry.write_last_seen_every(self._stopped), name="fedkey-last-seen"
            ),
            asyncio.create_task(
                watch_loop_lag(self.telemetry.loop_lag, self._stopped), name="fedkey-loop-lag"
            ),
        ]

    def _run_finished(self) -> None:
        if self.settings.exit_when_done and self.on_finished is not None:
            self.on_finished()

    def begin_shutdown(self) -> None:
        """Wake every long-poll so connections close promptly (the driver finishes its step)."""
        self._stopped.set()
        self.polls.notify()
        self._poke.set()

    async def stop(self) -> None:
        """Stop after the current step; an aggregation in progress is completed, not abandoned."""
        self.begin_shutdown()
        for task in self._tasks:  # in order: the driver's step, the last_seen batch, the lag
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.parts is not None:
            await self.parts.driver.wait_deletions()
        if self.aggregator is not None:
            await asyncio.to_thread(self.aggregator.close)
        self.events.close()
        if self.sessions is not None:
            self.sessions.kw["bind"].dispose()

    # -- the parts, once started ---------------------------------------------------------------------

    def _parts(self) -> Parts:
        if self.parts is None:
            raise RuntimeError("the coordinator is not started: start() builds its parts")
        return self.parts

    def _aggregator(self) -> Aggregator:
        if self.aggregator is None:
            raise RuntimeError("the coordinator is not started: start() makes the aggregator")
        return self.aggregator

    # -- what the routes call ------------------------------------------------------------------------

    async def enroll(self, secret: Any, name: Any = None, num_samples: Any = None) -> dict:
        """POST /v1/devices (fedkey.server.devices)."""
        return await self.registry.enroll(secret, name, num_samples)

    def authenticate(self, authorization: str | None) -> str:
        """`Authorization: Bearer <token>` -> device id, or 401 (fedkey.server.devices)."""
        return self.registry.authenticate(authorization)

    async def mint_enrollment_tokens(self, count: Any, ttl: Any) -> dict:
        """POST /v1/enrollment-tokens, for the operator (fedkey.server.devices)."""
        return await self.registry.mint(count, ttl)

    async def revoke(self, device_id: str) -> dict:
        """DELETE /v1/devices/{device_id}, for the operator (fedkey.server.devices)."""
        return await self.registry.revoke(device_id)

    def view(self, device_id: str) -> dict:
        """GET /v1/rounds/current for `device_id`, at once (fedkey.server.device_views)."""
        return self._parts().views.view(device_id)

    async def wait_view(self, device_id: str, wait: float) -> dict:
        """GET /v1/rounds/current?wait= for `device_id`: the long-poll (fedkey.server.device_views)."""
        return await self._parts().views.wait_view(device_id, wait)

    def everyone_told_finished(self) -> bool:
        """The run is finished and every enrolled device has been answered so."""
        return self._parts().views.everyone_told_finished()

    async def report_loss(
        self, authorization: str | None, n: int, body: bytes, wait: float = 0.0
    ) -> dict:
        """POST /v1/rounds/{n}/loss (fedkey.server.upload_inbox)."""
        return await self._inbox(authorization, n, "loss").report_loss(authorization, n, body, wait)

    async def receive_update(
        self,
        authorization: str | None,
        n: int,
        headers: Mapping[str, str],
        body: AsyncIterator[bytes],
    ) -> dict:
        """POST /v1/rounds/{n}/update (fedkey.server.upload_inbox)."""
        inbox = self._inbox(authorization, n, "update")
        return await inbox.receive_update(authorization, n, headers, body)

    def _inbox(self, authorization: str | None, n: int, kind: str) -> UploadInbox:
        """The inbox; before start() (an app served without its lifespan) nobody is enrolled,
        and the request is refused as the inbox refuses an unknown token."""
        if self.parts is not None:
            return self.parts.inbox
        try:
            self.registry.authenticate(authorization)
        except ValidationError as e:
            record_rejection(self.telemetry, self.events, None, n, kind, e)
            raise
        raise RuntimeError("the coordinator is not started: start() builds the inbox")

    def model(self) -> tuple[int, bytes, str]:
        """(round, checkpoint bytes, sha256) of the current global model."""
        if self.parts is None:
            raise RuntimeError("the coordinator is not started: start() loads the global model")
        return self.parts.model.current()

    def health(self) -> dict:
        """GET /healthz: the round devices are told of, and the state."""
        if self.parts is None:
            return {"status": "ok", "round": 0, "state": RoundState.STARTING}
        driver = self.parts.driver
        return {"status": "ok", "round": driver.shown_round(), "state": driver.state}

    def check_operator(self, authorization: str | None) -> None:
        """GET /metrics's gate: with an operator token set (FEDKEY_OPERATOR_TOKEN), 401 without
        `Authorization: Bearer <it>`; without one, open, but 403 under DP: the counters are
        exact counts of what the phones did (uploads refused by reason, loss reports), which no
        epsilon pays for (fedkey.federation.metrics_row.public_info's argument), so only an operator
        holding the token may read them."""
        if self.settings.operator_token is None and self.privacy.dp:
            raise ApiError(
                403,
                "under DP the Prometheus counters are exact counts of the phones' doings: "
                "start the server with FEDKEY_OPERATOR_TOKEN set and scrape with "
                "'Authorization: Bearer <that token>'",
                "forbidden",
            )
        self.check_observer(authorization, "GET /metrics")

    def check_observer(self, authorization: str | None, what: str) -> None:
        """The gate of what observers read (GET /v1/metrics, WS /v1/events, and GET /metrics):
        open without an operator token; with one set, 401 unless `authorization` is
        `Bearer <it>` (`what` names the request in the answer)."""
        token = self.settings.operator_token
        if token is None:
            return
        given = bearer_token(authorization, "<FEDKEY_OPERATOR_TOKEN>").encode()
        if not hmac.compare_digest(given, token.get_secret_value().encode()):
            raise ApiError(401, f"{what}: not the FEDKEY_OPERATOR_TOKEN", "unauthorized")

    def check_operator_action(self, authorization: str | None, what: str) -> None:
        """The gate of what only the operator does (minting enrollment tokens, revoking a
        device): 403 when the server has no operator token, else 401 without it."""
        if self.settings.operator_token is None:
            raise ApiError(
                403,
                f"{what} is the operator's: start the server with FEDKEY_OPERATOR_TOKEN set and "
                "send 'Authorization: Bearer <that token>'",
                "forbidden",
            )
        self.check_observer(authorization, what)

    def check_model_reader(self, authorization: str | None) -> None:
        """GET /v1/model's gate: open, or with private_model a device's token or the operator's
        (401 otherwise)."""
        if not self.settings.private_model:
            return
        token = self.settings.operator_token
        if token is not None:
            given = bearer_token(authorization, "<device or operator token>").encode()
            if hmac.compare_digest(given, token.get_secret_value().encode()):
                return
        self.authenticate(authorization)

    async def metrics_rows(self) -> list[dict]:
        """The metrics rows as published (fedkey.federation.metrics_row.public_row: under DP an
        allow-list), NaN and infinities (a diverged run) as null: JSON has neither, and
        PostgreSQL stores them so (fedkey.server.db.finite_json). Read from the database in a thread
        once per recorded round, then served from memory: a flood of GET /v1/metrics costs the
        event loop a list, not a query each."""
        # The rows change only when the driver records one (on this loop, as this runs).
        key = self.parts.driver.recorded if self.parts is not None else None
        cached = self._rows_cache
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        rows = await asyncio.to_thread(self._read_rows)
        if key is not None:
            self._rows_cache = (key, rows)
        return rows

    def _read_rows(self) -> list[dict]:
        with self.sessions() as db:
            rows = [m.row for m in db.scalars(select(MetricRow).order_by(MetricRow.round))]
        return [finite_json(public_row(row, self.privacy)) for row in rows]
