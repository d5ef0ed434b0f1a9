"""The round driver: it owns the round state, and one asyncio task of it makes every transition
of the round lifecycle (open, the FedMed topK decision, aggregate, fail, finish), so transitions
never race. The inbox (fedkey.server.upload_inbox) and the views (fedkey.server.device_views) only read the state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedkey.federation.engine import Federation
from fedkey.federation.plan import RoundPlan
from fedkey.federation.strategies.selection import cohort_size
from fedkey.server.aggregator import Aggregator
from fedkey.server.db import Attempt, MetricRow, Round
from fedkey.server.device_views import LongPolls
from fedkey.server.events import EventBus
from fedkey.server.round_state import OpenRound, RoundState, Upload, round_dir
from fedkey.server.runtime.disk_full import out_of_space
from fedkey.server.runtime.prometheus import Telemetry
from fedkey.server.runtime.worker_threads import aggregation_executor
from fedkey.server.settings import Settings

log = logging.getLogger("fedkey.server")

#: Seconds before an aggregation the full disk refused is tried again.
AGGREGATION_RETRY = 10.0


def run_over(fed: Federation) -> bool:
    """Every round is done, or another would pass the privacy budget."""
    return fed.round >= fed.config.rounds or fed.budget_spent


def finish_reason(fed: Federation) -> str:
    """Why the run is over (:func:`run_over`), in words."""
    if fed.round >= fed.config.rounds:
        return f"all {fed.config.rounds} rounds done"
    return f"privacy budget: another round would pass epsilon {fed.config.privacy.target_epsilon}"


def setup_strategy(fed: Federation, devices: Mapping[str, int], available: list[str]) -> None:
    """strategy.setup for devices it has not seen yet (AdaFL's n_k), before a plan_round;
    `devices`: device id -> num_samples."""
    strategy = fed.strategy
    new = {d: devices.get(d, 1) for d in available if d not in strategy.client_sizes}
    if new:
        strategy.setup(new, fed.config.rounds)


class RoundDriver:
    """The round lifecycle: the state (`state`, `current`, `next_attempt`, `finish_reason`) and
    the task (:meth:`run`) that changes it, woken by `poke` (an enrollment, a loss report, an
    upload) or by the open round's deadline."""

    def __init__(
        self,
        *,
        settings: Settings,
        fed: Federation,
        aggregator: Aggregator,
        sessions: Any,  # sqlalchemy sessionmaker
        devices: Mapping[str, int],
        uploads_dir: Path,
        polls: LongPolls,
        poke: asyncio.Event,
        stopped: asyncio.Event,
        on_new_model: Callable[[], None],
        on_finished: Callable[[], None],
        telemetry: Telemetry,
        events: EventBus,
    ):
        self._settings = settings
        self._fed = fed
        self._aggregator = aggregator  # completes rounds (fedkey.server.aggregator)
        self._sessions = sessions
        self._devices = devices  # the enrolled devices (fedkey.server.devices.DeviceRegistry's)
        self._uploads_dir = uploads_dir
        self._polls = polls
        self._poke = poke  # set: step again
        self._stopped = stopped  # set: stop after the current step
        self._on_new_model = on_new_model  # a round was aggregated: serve and export its model
        self._on_finished = on_finished
        self._telemetry = telemetry
        self._events = events
        self.state = RoundState.STARTING  # waiting | open | aggregating | finished
        self.current: OpenRound | None = None
        self.next_attempt = 0
        self.finish_reason: str | None = None
        self._retry_aggregation_at = 0.0  # time.time() before which a postponed one waits
        self._unrecorded: list[tuple[int, dict]] = []  # aggregated (row id, metrics row) not in db
        self.recorded = 0  # metrics rows this driver has written to the database
        self._deletions: set[asyncio.Task] = set()  # aggregated rounds' uploads being deleted

    # -- start, the task, stop -------------------------------------------------------------------

    def resume(self, current: OpenRound | None, next_attempt: int) -> None:
        """The state fedkey.server.recovery reconciled on start: the round to continue, if any."""
        self.current, self.next_attempt = current, next_attempt
        if current is not None:
            self.state = RoundState.OPEN
        elif run_over(self._fed):
            self.state = RoundState.FINISHED
            self.finish_reason = finish_reason(self._fed)
        else:
            self.state = RoundState.WAITING
        self._set_round_gauge()

    async def run(self) -> None:
        """Step while something changes, then wait for a poke or the deadline; until stopped."""
        while not self._stopped.is_set():
            self._poke.clear()
            try:
                while not self._stopped.is_set() and await self._step():
                    pass
            except Exception:  # keep serving; the next poke or deadline tries again
                log.exception("round driver step failed")
                await asyncio.sleep(1.0)
            if self._stopped.is_set():
                break
            timeout = None
            if self.state == RoundState.OPEN and self.current is not None:
                timeout = max(0.0, self.current.deadline - time.time()) + 0.01
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), timeout)

    async def wait_deletions(self) -> None:
        """Until the aggregated rounds' uploads being deleted are."""
        await asyncio.gather(*self._deletions, return_exceptions=True)

    def shown_round(self) -> int:
        """The round devices are told of: the open one, else the next (the last once finished)."""
        if self.current is not None:
            return self.current.number
        return self._fed.round + (0 if self.state == RoundState.FINISHED else 1)

    # -- one step --------------------------------------------------------------------------------

    async def _step(self) -> bool:
        """Make at most one transition; True when something changed (then step again)."""
        self._record_aggregated()
        if self.state == RoundState.FINISHED:
            return False
        if self.state == RoundState.WAITING:
            return self._step_waiting()
        r = self.current
        if self.state != RoundState.OPEN or r is None:
            return False
        now = time.time()
        if self._settings.topk and r.uploaders is None:
            return self._step_choosing(r, now)
        return await self._step_collecting(r, now)

    def _step_waiting(self) -> bool:
        """Finish the run, or open a round once enough devices are enrolled."""
        if run_over(self._fed):
            self._finish()
            return True
        if len(self._devices) >= self._settings.wait_devices:
            self._open_round()
            return True
        return False

    def _step_choosing(self, r: OpenRound, now: float) -> bool:
        """FedMed topK: choose the uploaders once the cohort reported (or at the deadline)."""
        if r.selected <= r.losses.keys():
            self._decide(r, now)
            return True
        if now < r.deadline:
            return False
        if not r.losses:
            self._fail(r, "no loss reports before the deadline")
            return True
        uploaders = self._decide(r, now)
        quorum = self._quorum(r)
        if len(uploaders) < quorum:
            self._fail(r, f"{len(uploaders)} uploaders chosen, quorum {quorum}")
        return True

    async def _step_collecting(self, r: OpenRound, now: float) -> bool:
        """Aggregate once every expected upload is in, or at the deadline with a quorum; fail at
        the deadline without one."""
        expected = r.expected(self._settings.topk)
        if expected is None:  # _step chooses the uploaders first
            raise RuntimeError(f"round {r.number}: the uploaders are not chosen yet")
        if now < self._retry_aggregation_at:
            return False  # the disk was full: the deadline, moved to the retry time, wakes us
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

    def _quorum(self, r: OpenRound) -> int:
        if self._settings.topk:
            expected = cohort_size(self._settings.topk_beta, len(r.plan.cohort))
        else:
            expected = len(r.plan.cohort)
        return self._settings.quorum_for(expected)

    # -- the transitions -------------------------------------------------------------------------

    def _finish(self) -> None:
        self.state = RoundState.FINISHED
        self.current = None
        self.finish_reason = finish_reason(self._fed)
        self._set_round_gauge()
        log.info("run finished: %s", self.finish_reason)
        self._events.publish("run_finished", round=self._fed.round, reason=self.finish_reason)
        self._polls.notify()
        self._on_finished()

    def _open_round(self) -> None:
        fed = self._fed
        available = sorted(self._devices)
        setup_strategy(fed, self._devices, available)
        attempt = self.next_attempt
        plan = fed.plan_round(available, attempt)
        now = time.time()
        deadline = now + self._settings.round_deadline
        with self._sessions.begin() as db:
            row = Round(
                number=plan.round,
                attempt=attempt,
                state=Attempt.OPEN,
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
        self.state = RoundState.OPEN
        self._set_round_gauge()
        log.info(
            "round %d (attempt %d) open: %d of %d devices selected",
            plan.round,
            attempt,
            len(plan.cohort),
            len(available),
        )
        self._events.publish(
            "round_opened",
            round=plan.round,
            attempt=attempt,
            cohort=plan.cohort,
            deadline=deadline,
            model_round=fed.round,
        )
        self._polls.notify(plan.cohort)

    def _decide(self, r: OpenRound, now: float) -> list[str]:
        """FedMed topK: the engine chooses the uploaders among the devices that reported; they
        are recorded in `r` and returned."""
        losses = {d: loss for d, (loss, _) in r.losses.items()}
        uploaders = self._fed.choose_uploaders(r.plan, losses)
        deadline = max(r.deadline, now + self._settings.upload_grace)
        with self._sessions.begin() as db:  # recorded first: a failed write changes nothing
            row = db.get(Round, r.row_id)
            row.uploaders = uploaders
            row.deadline = deadline
        r.uploaders, r.deadline = uploaders, deadline
        log.info("round %d: topK chose %s of %d reporters", r.number, r.uploaders, len(losses))
        self._polls.notify(r.selected)
        return uploaders

    def _fail(self, r: OpenRound, why: str) -> None:
        """Quorum missed: nothing applied; the same round opens again with attempt + 1."""
        self._set_round_row_state(r.row_id, Attempt.FAILED)
        for up in r.uploads.values():
            Path(up.path).unlink(missing_ok=True)
        self.current = None
        self.state = RoundState.WAITING
        self.next_attempt = r.attempt + 1
        self._telemetry.rounds_failed.inc()
        log.warning("round %d attempt %d failed: %s", r.number, r.attempt, why)
        self._events.publish(
            "round_failed",
            round=r.number,
            attempt=r.attempt,
            reason=why,
            received=len(r.uploads),
            quorum=self._quorum(r),
        )
        self._polls.notify(r.selected)

    # -- aggregation -----------------------------------------------------------------------------

    async def _aggregate(self, r: OpenRound) -> None:
        """The round recorded as aggregating, completed in the aggregation thread, its result
        adopted; a full disk postpones it, another failure fails the round."""
        try:  # the database first: if it cannot record the transition, nothing changes
            await asyncio.to_thread(self._set_round_row_state, r.row_id, Attempt.AGGREGATING)
        except Exception as e:
            if not out_of_space(e):
                raise
            self._postpone(r, e)
            return
        self.state = RoundState.AGGREGATING
        self._polls.notify(r.selected)
        uploads = sorted(r.uploads.items())
        start = time.perf_counter()
        try:
            row = await asyncio.get_running_loop().run_in_executor(
                aggregation_executor(), self._complete, r.plan, uploads
            )
        except Exception as e:  # all or nothing: the engine left everything as before
            self.state = RoundState.OPEN
            if out_of_space(e):  # keep the uploads: the round completes once space is back
                self._postpone(r, e)
                return
            log.exception("round %d: aggregation failed", r.number)
            self._fail(r, f"aggregation failed: {type(e).__name__}: {e}")
            return
        self._telemetry.aggregation_seconds.observe(time.perf_counter() - start)
        self._adopt(r, row)

    def _complete(self, plan: RoundPlan, uploads: list[tuple[str, Upload]]) -> dict:
        """In the aggregation thread: the round completed where settings.aggregate_in says
        (fedkey.server.aggregator), its result adopted by this process's Federation."""
        return self._aggregator.complete(plan, uploads)

    def _adopt(self, r: OpenRound, row: dict) -> None:
        """The checkpoint and metrics.jsonl are written: the round is applied whatever the
        database says; recording it is retried until it succeeds (a restart reconciles too)."""
        self._unrecorded.append((r.row_id, row))
        self._record_aggregated()
        self._on_new_model()
        # The round is over for the devices at once, with the new model: no view may offer its
        # task (whose model is gone) while its uploads are deleted.
        self.current = None
        self.state = RoundState.WAITING
        self.next_attempt = 0
        self._telemetry.rounds_completed.inc()
        log.info(
            "round %d aggregated %d of %d updates: val_ppl %.2f test_ppl %.2f",
            row["round"],
            len(row["aggregated"]),
            len(row["uploaded"]),
            row["val_ppl"],
            row["test_ppl"],
        )
        self._events.publish(
            "round_aggregated",
            round=row["round"],
            attempt=r.attempt,
            aggregated=row["aggregated"],
            val_ppl=row["val_ppl"],
            test_ppl=row["test_ppl"],
            epsilon=row["epsilon"],
        )
        self._polls.notify(r.selected)
        if not self._settings.keep_uploads:
            self._delete_in_background(round_dir(self._uploads_dir, r.number))

    def _delete_in_background(self, path: Path) -> None:
        """Delete an aggregated round's uploads in a worker thread while the next round opens:
        on the loop it held the loop 0.3 s a round at 100 uploads of 4.4 MB (py-spy, fedkey
        bench load), and awaited it kept the devices in "waiting" (and woke their long-polls
        once more) between two rounds. Awaited by :meth:`wait_deletions`."""
        task = asyncio.create_task(
            asyncio.to_thread(shutil.rmtree, path, ignore_errors=True),
            name=f"fedkey-delete-{path.name}",
        )
        self._deletions.add(task)
        task.add_done_callback(self._deletions.discard)

    def _record_aggregated(self) -> None:
        """Mark the aggregated rounds' rows and copy their metrics into the database; a failure
        (a full disk) is logged and retried at the next step."""
        while self._unrecorded:
            row_id, row = self._unrecorded[0]
            try:
                with self._sessions.begin() as db:
                    db.get(Round, row_id).state = Attempt.AGGREGATED
                    db.merge(MetricRow(round=row["round"], row=row))
            except Exception:
                log.exception("round %d: recording it in the database failed", row["round"])
                return
            self._unrecorded.pop(0)
            self.recorded += 1

    def _postpone(self, r: OpenRound, e: BaseException) -> None:
        """The disk is full: the round stays open with its uploads, aggregation is tried again
        in ``AGGREGATION_RETRY`` seconds (the deadline waits for it)."""
        self._retry_aggregation_at = time.time() + AGGREGATION_RETRY
        r.deadline = max(r.deadline, self._retry_aggregation_at)
        self._telemetry.storage_full.labels(what="aggregation").inc()
        log.error(
            "round %d: the disk is full (%s); aggregation retried in %.0f s",
            r.number,
            e,
            AGGREGATION_RETRY,
        )
        self._events.publish(
            "aggregation_postponed",
            round=r.number,
            attempt=r.attempt,
            reason="disk full",
            retry_in=AGGREGATION_RETRY,
        )
        self._polls.notify(r.selected)

    def _set_round_row_state(self, row_id: int, state: str) -> None:
        with self._sessions.begin() as db:
            db.get(Round, row_id).state = state

    def _set_round_gauge(self) -> None:
        self._telemetry.current_round.set(self.shown_round())
