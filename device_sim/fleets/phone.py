"""One simulated phone's protocol, written once for every way of running it.

A phone enrolls under its shard's name, long-polls the server for its view of the current round
and, when selected, downloads the global model, trains with the task's seed, reports its loss and
uploads if the server's topK decision (FedMed) says so; it misbehaves as its PhoneConfig says
(dropout, slow, attacks: fedkey.device_sim.attacks).

`PhoneLoop.run()` is that protocol as a generator ("sans I/O"): it yields what it needs done (a
client call, a training run, a pause) and receives the result, or has the exception thrown in.
The thread fleet drives it with the blocking client (`drive`, fedkey.device_sim.fleets.thread_fleet); the Ray fleet's
asyncio phones drive it with the async client and train on Ray actors (fedkey.device_sim.fleets.async_phone). Both
therefore send the same requests in the same order and upload the same bytes: what a phone
uploads depends only on the task and its shard.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from fedkey.common.task import RoundTask, still_selected
from fedkey.device_sim.attacks import apply_attack, backdoor_task, boost_factor
from fedkey.device_sim.client.http import ApiError, FedkeyError, GlobalModel, Stopped
from fedkey.device_sim.client.protocol import MAX_REENROLL, actionable, round_key
from fedkey.device_sim.config import PhoneConfig
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.device_sim.training.trainer import TrainResult

log = logging.getLogger("fedkey.device")

__all__ = [
    "Call",
    "DeviceReport",
    "Op",
    "Pause",
    "PhoneLoop",
    "Train",
    "advance",
    "drive",
    "failed",
    "num_samples",
]


@dataclass
class DeviceReport:
    """What one phone did; `rejections` maps "status detail" to a count."""

    name: str
    device_id: str | None = None
    rounds_seen: list[int] = field(default_factory=list)
    selected: int = 0  # (round, attempt) views in which it was selected and acted
    trained: int = 0
    uploads: int = 0  # accepted uploads
    dropped: int = 0  # vanished on purpose (dropout_rate)
    dropped_rounds: list[int] = field(default_factory=list)
    slowed: int = 0
    declined: int = 0  # topK said do not upload
    stale: int = 0  # 409: the round moved on before it finished
    rejections: dict[str, int] = field(default_factory=dict)
    receipts: list[dict] = field(default_factory=list)
    finished: bool = False  # saw state "finished"
    error: str | None = None
    precision: str | None = None  # what its last training ran in (the task's, resolved here)

    def to_dict(self) -> dict:
        return asdict(self)


def num_samples(shard: list[list[int]]) -> int:
    """A shard's training tokens (each sentence predicts all but its first token)."""
    return sum(len(s) - 1 for s in shard)


# -- what the protocol asks its driver to do ----------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A client method by name (enroll, current, download_model, report_loss, upload) and its
    arguments; the result is the method's."""

    method: str
    args: tuple = ()


@dataclass(frozen=True)
class Train:
    """Train `task` from `model`'s state; the result is a TrainResult."""

    task: LocalTask
    model: GlobalModel


@dataclass(frozen=True)
class Pause:
    """Wait `seconds`; the result is True when the phone was stopped meanwhile."""

    seconds: float


Op = Call | Train | Pause
Steps = Generator[Op, Any, Any]


class StopFlag(Protocol):
    """threading.Event or asyncio.Event: only is_set() is read."""

    def is_set(self) -> bool: ...


class PhoneLoop:
    """The protocol of one phone as a generator (see the module docstring): `run()`."""

    def __init__(
        self,
        name: str,
        shard: list[list[int]],
        secret: str,
        phone: PhoneConfig,
        stop: StopFlag | None,
        report: DeviceReport,
    ) -> None:
        self.name = name
        self.shard = shard
        self.secret = secret
        self.phone = phone
        self.stop = stop
        self.report = report
        self.num_samples = num_samples(shard)
        self.handled: set[tuple[int, int]] = set()  # (round, attempt) this phone is done with
        self.trained: tuple[tuple, TrainResult] | None = None  # the last training, by task
        self.reenrolled = 0
        self.tries: Counter[tuple[int, int]] = Counter()
        self.selected: set[tuple[int, int]] = set()

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def run(self) -> Steps:
        """The phone's life: enroll, then follow the rounds until "finished" (or stopped)."""
        try:
            yield from self.follow()
        except Stopped:
            return  # asked to stop while waiting on the server: not an error

    def enroll(self) -> Steps:
        device_id, _ = yield Call("enroll", (self.secret, self.name, self.num_samples))
        self.report.device_id = device_id

    def call(self, method: str, *args: Any) -> Steps:
        """A bearer call; a 401 (the server lost this device, e.g. a restart on a fresh store)
        re-enrolls under the same name and tries once more."""
        try:
            return (yield Call(method, args))
        except ApiError as e:
            if e.status != 401 or self.reenrolled >= MAX_REENROLL:
                raise
            self.reenrolled += 1
            log.warning("%s: %s; enrolling again", self.name, e)
            yield from self.enroll()
            return (yield Call(method, args))

    def follow(self) -> Steps:
        yield from self.enroll()
        view = yield from self.call("current", 0)
        while not self.stopped():
            self.see(view)
            if view.get("state") == "finished":
                self.report.finished = True
                return
            key = round_key(view)
            if self.trained is not None and self.trained[0][0] != key:
                self.trained = None  # a new round: free the last trained weights
            if actionable(view, key, self.handled, self.tries):
                self.tries[key] += 1
                try:
                    newer = yield from self.participate(view, key)
                except ApiError as e:
                    self.handled.add(key)
                    if e.status == 409:  # the round moved on: not an error
                        self.report.stale += 1
                        log.info("%s: round %d moved on (%s)", self.name, key[0], e.detail)
                    else:  # e.g. 403 on the loss report: the server does not want this phone
                        self.reject(e, key[0], "loss report")
                    newer = None
                view = newer if newer is not None else (yield from self.call("current", 0))
                continue
            started, before = time.monotonic(), view
            view = yield from self.call("current", self.phone.poll_wait)
            if view == before and time.monotonic() - started < 0.05:
                yield Pause(min(0.5, self.phone.poll_wait))  # a server that does not long-poll

    def reject(self, e: ApiError, r: int, what: str) -> None:
        reason = f"{e.status} {e.detail}"
        self.report.rejections[reason] = self.report.rejections.get(reason, 0) + 1
        log.warning("%s: %s for round %d rejected: %s", self.name, what, r, reason)

    def see(self, view: dict) -> None:
        r = view.get("round")
        if isinstance(r, int) and (not self.report.rounds_seen or self.report.rounds_seen[-1] != r):
            self.report.rounds_seen.append(r)

    def local_task(self, task: RoundTask, model: GlobalModel) -> LocalTask:
        """What this phone trains for `task`: its shard (mixed with poison for a backdoor)."""
        local = LocalTask(
            device_id=self.name,
            shard=self.shard,
            seed=task.seed,
            model_config=model.config,
            train=task.train,
            beta=task.beta,
            sigma=task.sigma,
            device=self.phone.device,
        )
        if self.phone.attack == "backdoor":  # its shard mixed with poisoned sentences
            local = backdoor_task(local, model.tokenizer, self.phone.backdoor)
        return local

    def train(self, task: RoundTask, key: tuple[int, int], model: GlobalModel) -> Steps:
        task_key = (key, model.round, repr(task))
        if self.trained is not None and self.trained[0] == task_key:
            return self.trained[1]
        result: TrainResult = yield Train(self.local_task(task, model), model)
        if self.phone.attack == "backdoor":  # it declares its own shard's size, as if honest
            result = dataclasses.replace(result, num_tokens=self.num_samples)
        self.report.trained += 1
        self.report.precision = result.precision
        self.trained = (task_key, result)
        return result

    def participate(self, view: dict, key: tuple[int, int]) -> Steps:
        """Act on a task; returns a newer view when one was fetched on the way."""
        r, attempt = key
        task = RoundTask.from_json(view["task"])
        draws = random.Random(f"fedkey-phone:{self.phone.seed}:{self.name}:{r}:{attempt}")
        vanish = draws.random() < self.phone.dropout_rate
        slow = draws.random() < self.phone.slow_rate
        self.selected.add(key)
        self.report.selected = len(self.selected)
        if vanish:
            self.report.dropped += 1
            self.report.dropped_rounds.append(r)
            self.handled.add(key)
            log.info("%s: vanishes from round %d (dropout)", self.name, r)
            return None
        model: GlobalModel = yield Call("download_model")
        want = task.model_round
        if model.round != want:
            # The global model is not the one the task is for: look at the round again.
            log.info("%s: task wants model %s, server has %s", self.name, want, model.round)
            self.tries[key] -= 1
            yield Pause(0.2)
            return None
        result = yield from self.train(task, key, model)
        decision = view.get("upload")
        if not view.get("loss_reported"):
            decision = yield from self.call(
                "report_loss", r, result.train_loss, result.num_tokens, self.phone.loss_wait
            )
        while decision is None:
            if self.stopped():
                return None
            newer = yield from self.call("current", self.phone.loss_wait)
            self.see(newer)
            if not still_selected(newer, r, attempt) or newer.get("uploaded"):
                return newer
            decision = newer.get("upload")
        if decision is False:
            self.handled.add(key)
            self.report.declined += 1
            return None
        if slow:
            self.report.slowed += 1
            log.info(
                "%s: slow, waiting %.1f s before uploading", self.name, self.phone.slow_seconds
            )
            if (yield Pause(self.phone.slow_seconds)):
                return None
        boost = boost_factor(self.phone.backdoor, cohort=1)  # the fleet sets boost (its size)
        state = apply_attack(self.phone.attack, result.state, model.state, boost)
        try:
            receipt = yield from self.call("upload", r, state, result.num_tokens, result.train_loss)
        except ApiError as e:
            if e.status == 409:
                raise
            self.handled.add(key)
            self.reject(e, r, "upload")
            return None
        # Not `handled`: if a restarted server lost the upload, its view says so and the phone
        # sends the same bytes again (at most MAX_TRIES times).
        self.report.uploads += 1
        self.report.receipts.append(receipt)
        return None


def advance(steps: Steps, value: Any, error: Exception | None) -> Op | None:
    """The protocol's next op, given the last op's result (or its exception, raised inside the
    protocol where the phone would have met it); None once the phone is done."""
    try:
        return steps.throw(error) if error is not None else steps.send(value)
    except StopIteration:
        return None


def drive(steps: Steps, execute: Callable[[Op], Any]) -> None:
    """Run a phone's protocol with a blocking `execute` (an op -> its result)."""
    value: Any = None
    error: Exception | None = None
    while (op := advance(steps, value, error)) is not None:
        try:
            value, error = execute(op), None
        except Exception as e:
            value, error = None, e


def failed(report: DeviceReport, e: Exception, stop: StopFlag | None) -> None:
    """A phone's end by an exception, in its report (a fleet's phones never take each other
    down): the server's refusal or absence (FedkeyError) unless the fleet was stopping, or a bug."""
    if isinstance(e, FedkeyError):
        if stop is None or not stop.is_set():
            report.error = str(e)
            log.error("%s: %s", report.name, e)
    else:
        report.error = f"{type(e).__name__}: {e}"
        log.exception("%s crashed", report.name, exc_info=e)
