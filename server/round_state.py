"""The vocabulary the coordinator's parts share: the state machine, the open round and its
uploads, a refused request, where a round's uploads live, and `RoundNow`, what the upload inbox
and the views read of the round (the round driver, fedkey.server.round_driver, owns it and makes every
change)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Protocol

from fedkey.federation.plan import RoundPlan
from fedkey.federation.updates.validation import ValidationError


class RoundState(StrEnum):
    """The coordinator's state machine (fedkey.server.round_driver makes every transition): starting ->
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
    """A stored upload: its receipt, its file, and what its device declared."""

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
    """The round being collected: its plan and deadline, the loss reports and uploads so far."""

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

    def upload_flag(self, device_id: str, topk: bool) -> bool | None:
        """Whether `device_id` uploads in this round (None: the topK decision is pending)."""
        if device_id not in self.selected:
            return False
        if not topk:
            return True
        if self.uploaders is None:
            return None
        return device_id in self.uploaders

    def expected(self, topk: bool) -> list[str] | None:
        """Who must upload: the topK uploaders once chosen (None before), else the cohort."""
        if topk:
            return self.uploaders
        return self.plan.cohort


class RoundNow(Protocol):
    """What the upload inbox and the views read of the round; the round driver changes it."""

    @property
    def state(self) -> RoundState: ...

    @property
    def current(self) -> OpenRound | None: ...

    @property
    def next_attempt(self) -> int: ...


def round_dir(uploads_dir: Path, n: int) -> Path:
    """The folder of round `n`'s uploads (and of their temporary files)."""
    return uploads_dir / f"round_{n:04d}"
