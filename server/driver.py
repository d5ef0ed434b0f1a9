"""The round driver: one asyncio task makes every transition of the round lifecycle (open, the
FedMed topK decision, aggregate, fail, finish), so transitions never race."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path

from server.db import Attempt, MetricRow, Round
from server.engine import RoundPlan
from server.nospace import out_of_space
from server.rounds import CoordinatorState, OpenRound, RoundState, Upload
from server.strategies.selection import cohort_size
from server.threads import aggregation_executor

log = logging.getLogger("fedkey.server")

#: Seconds before an aggregation the full disk refused is tried again.
AGGREGATION_RETRY = 10.0


class DriverMixin(CoordinatorState):
    """The transitions of the round lifecycle (part of Coordinator)."""

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
            if self.state == RoundState.OPEN and self.current is not None:
                timeout = max(0.0, self.current.deadline - time.time()) + 0.01
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), timeout)

    async def _step(self) -> bool:
        """Make at most one transition; True when something changed (then step again)."""
        self._record_aggregated()
        if self.state == RoundState.FINISHED:
            return False
        if self.state == RoundState.WAITING:
            if self._finished():
                self._finish()
                return True
            if len(self.devices) >= self.settings.wait_devices:
                self._open_round()
                return True
            return False
        r = self.current
        if self.state != RoundState.OPEN or r is None:
            return False
        now = time.time()
        if self.settings.topk and r.uploaders is None:
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
        expected = self._expected(r)
        if expected is None:  # the topK branch above returns until the uploaders are chosen
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
        fed = self.fed
        return fed.round >= fed.config.rounds or fed.budget_spent

    def _finish_reason(self) -> str:
        fed = self.fed
        if fed.round >= fed.config.rounds:
            return f"all {fed.config.rounds} rounds done"
        return (
            f"privacy budget: another round would pass epsilon {fed.config.privacy.target_epsilon}"
        )

    def _finish(self) -> None:
        self.state = RoundState.FINISHED
        self.current = None
        self.finish_reason = self._finish_reason()
        self._set_round_gauge()
        log.info("run finished: %s", self.finish_reason)
        self.events.publish("run_finished", round=self.fed.round, reason=self.finish_reason)
        self._notify()
        if self.settings.exit_when_done and self.on_finished is not None:
            self.on_finished()

    def _setup_strategy(self, available: list[str]) -> None:
        """strategy.setup for devices it has not seen yet (AdaFL's n_k), before a plan_round."""
        strategy = self.fed.strategy
        new = {d: self.devices.get(d, 1) for d in available if d not in strategy.client_sizes}
        if new:
            strategy.setup(new, self.fed.config.rounds)

    def _open_round(self) -> None:
        fed = self.fed
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
        self.events.publish(
            "round_opened",
            round=plan.round,
            attempt=attempt,
            cohort=plan.cohort,
            deadline=deadline,
            model_round=fed.round,
        )
        self._notify(plan.cohort)

    def _decide(self, r: OpenRound, now: float) -> list[str]:
        """FedMed topK: the engine chooses the uploaders among the devices that reported; they
        are recorded in `r` and returned."""
        losses = {d: loss for d, (loss, _) in r.losses.items()}
        uploaders = self.fed.choose_uploaders(r.plan, losses)
        deadline = max(r.deadline, now + self.settings.upload_grace)
        with self.sessions.begin() as db:  # recorded first: a failed write changes nothing
            row = db.get(Round, r.row_id)
            row.uploaders = uploaders
            row.deadline = deadline
        r.uploaders, r.deadline = uploaders, deadline
        log.info("round %d: topK chose %s of %d reporters", r.number, r.uploaders, len(losses))
        self._notify(r.selected)
        return uploaders

    def _fail(self, r: OpenRound, why: str) -> None:
        """Quorum missed: nothing applied; the same round opens again with attempt + 1."""
        self._set_round_row_state(r.row_id, Attempt.FAILED)
        for up in r.uploads.values():
            Path(up.path).unlink(missing_ok=True)
        self.current = None
        self.state = RoundState.WAITING
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
        self._notify(r.selected)

    async def _aggregate(self, r: OpenRound) -> None:
        try:  # the database first: if it cannot record the transition, nothing changes
            await asyncio.to_thread(self._set_round_row_state, r.row_id, Attempt.AGGREGATING)
        except Exception as e:
            if not out_of_space(e):
                raise
            self._postpone(r, e)
            return
        self.state = RoundState.AGGREGATING
        self._notify(r.selected)
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
        self.telemetry.aggregation_seconds.observe(time.perf_counter() - start)
        # The checkpoint and metrics.jsonl are written: the round is applied whatever the
        # database says; recording it is retried until it succeeds (a restart reconciles too).
        self._unrecorded.append((r.row_id, row))
        self._record_aggregated()
        self._load_model()
        self._schedule_export()
        # The round is over for the devices at once, with the new model: no view may offer its
        # task (whose model is gone) while its uploads are deleted.
        self.current = None
        self.state = RoundState.WAITING
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
        self._notify(r.selected)
        if not self.settings.keep_uploads:
            self._delete_in_background(self._round_dir(r.number))

    def _delete_in_background(self, path: Path) -> None:
        """Delete an aggregated round's uploads in a worker thread while the next round opens:
        on the loop it held the loop 0.3 s a round at 100 uploads of 4.4 MB (py-spy, fedkey
        bench load), and awaited it kept the devices in "waiting" (and woke their long-polls
        once more) between two rounds. Awaited by stop()."""
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
                with self.sessions.begin() as db:
                    db.get(Round, row_id).state = Attempt.AGGREGATED
                    db.merge(MetricRow(round=row["round"], row=row))
            except Exception:
                log.exception("round %d: recording it in the database failed", row["round"])
                return
            self._unrecorded.pop(0)

    def _postpone(self, r: OpenRound, e: BaseException) -> None:
        """The disk is full: the round stays open with its uploads, aggregation is tried again
        in ``AGGREGATION_RETRY`` seconds (the deadline waits for it)."""
        self._retry_aggregation_at = time.time() + AGGREGATION_RETRY
        r.deadline = max(r.deadline, self._retry_aggregation_at)
        self.telemetry.storage_full.labels(what="aggregation").inc()
        log.error(
            "round %d: the disk is full (%s); aggregation retried in %.0f s",
            r.number,
            e,
            AGGREGATION_RETRY,
        )
        self.events.publish(
            "aggregation_postponed",
            round=r.number,
            attempt=r.attempt,
            reason="disk full",
            retry_in=AGGREGATION_RETRY,
        )
        self._notify(r.selected)

    def _set_round_row_state(self, row_id: int, state: str) -> None:
        with self.sessions.begin() as db:
            db.get(Round, row_id).state = state

    def _complete(self, plan: RoundPlan, uploads: list[tuple[str, Upload]]) -> dict:
        """In the aggregation thread: the round completed where settings.aggregate_in says
        (server.aggregator), its result adopted by this process's Federation."""
        if self.aggregator is None:
            raise RuntimeError("the coordinator is not started: start() makes the aggregator")
        return self.aggregator.complete(plan, uploads)

    def _set_round_gauge(self) -> None:
        self.telemetry.current_round.set(self.health()["round"])
