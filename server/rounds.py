"""What the coordinator holds: the open round and its uploads, a refused request, and the state
its parts share (server.devices, server.uploads, server.driver, server.recovery are mixins of
server.coordinator.Coordinator over one `CoordinatorState`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.engine import RoundPlan
from server.validation import ValidationError

if TYPE_CHECKING:
    from server.aggregator import Aggregator
    from server.db import BatchWriter
    from server.engine import Federation
    from server.events import EventBus
    from server.settings import Settings
    from server.telemetry import Telemetry


class RoundState(StrEnum):
    """The coordinator's state machine (server.driver makes every transition): starting ->
    waiting -> open -> aggregating -> waiting ... -> finished; open -> waiting when a round
    fails its quorum. A device's view of the round carries it as a string."""

    STARTING = "starting"
    WAITING = "waiting"  # for enough devices, or for the next round to open
    OPEN = "open"  # collecting loss reports and uploads
    AGGREGATING = "aggregating"
    FINISHED = "finished"


class ApiError(ValidationError):
    """A refused request: HTTP status, a message for people, a short reason for metrics/events."""


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
    storing: set[str] = field(default_factory=set)  # uploads being committed (worker threads)

    @property
    def number(self) -> int:
        return self.plan.round

    @cached_property
    def selected(self) -> frozenset[str]:
        """The cohort as a set: every request of a selected device asks (10,000 phones poll)."""
        return frozenset(self.plan.cohort)

    @property
    def attempt(self) -> int:
        return self.plan.attempt


class CoordinatorState:
    """The state the coordinator's parts share; Coordinator.__init__ and start() set it. Request
    handlers only record what devices send and poke the driver; the driver makes every
    transition. The methods one part calls on another are declared at the end (for the type
    checker only; the mixins define them)."""

    settings: Settings
    telemetry: Telemetry
    events: EventBus
    root: Path
    uploads_dir: Path
    enrollment_secret: str
    upload_limit: int  # bytes of an upload: the model's plus settings.max_upload_margin
    state: RoundState
    current: OpenRound | None
    federation: Federation | None
    aggregator: Aggregator | None  # completes rounds (server.aggregator)
    sessions: Any  # sqlalchemy sessionmaker
    db_writer: BatchWriter  # group commits of enrollments
    on_finished: Callable[[], None] | None  # serve() shuts uvicorn down with it
    devices: dict[str, int]  # device id -> num_samples
    finish_reason: str | None
    _tokens: dict[str, str]  # token hash -> device id
    _enrolling: set[str]  # names whose enrollment is being committed
    _last_seen: dict[str, float]
    _seen_unwritten: set[str]  # devices whose _last_seen is not in the database yet
    _stopped: asyncio.Event  # set by stop(): background tasks end
    _given: dict[str, dict]  # device id -> the view it was last answered
    _next_attempt: int
    _retry_aggregation_at: float  # time.time() before which a postponed aggregation waits
    _unrecorded: list[tuple[int, dict]]  # aggregated rounds' (row id, metrics row) not in the db
    _deletions: set[asyncio.Task]  # aggregated rounds' uploads being deleted (worker threads)
    _waiters: dict[str, asyncio.Event]  # device id -> what its long-polls wait on
    _poke: asyncio.Event  # wakes the driver
    _receiving: asyncio.Semaphore  # upload bodies being read (settings.max_receiving at once)
    _stopping: bool

    @property
    def fed(self) -> Federation:
        """The federation start() built; asking for it earlier is a programming error."""
        if self.federation is None:
            raise RuntimeError("the coordinator is not started: start() builds the federation")
        return self.federation

    if TYPE_CHECKING:
        # server.devices.DevicesMixin
        def authenticate(self, authorization: str | None) -> str: ...
        def _upload_flag(self, r: OpenRound, device_id: str) -> bool | None: ...
        async def _wait_until(
            self, device_id: str, predicate: Callable[[], bool], wait: float
        ) -> bool: ...
        def _notify(self, devices: Iterable[str] | None = None) -> None: ...
        def health(self) -> dict: ...

        # server.uploads.UploadsMixin
        def _round_dir(self, n: int) -> Path: ...

        # server.driver.DriverMixin
        def _expected(self, r: OpenRound) -> list[str] | None: ...
        def _finished(self) -> bool: ...
        def _finish_reason(self) -> str: ...
        def _setup_strategy(self, available: list[str]) -> None: ...
        def _set_round_gauge(self) -> None: ...

        # server.coordinator.Coordinator
        def _load_model(self) -> None: ...
        def _schedule_export(self) -> None: ...
