"""Restart: reconcile the database with the checkpoint, the source of truth, and continue the
open round with the same cohort, attempt, receipts and uploads."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from sqlalchemy import delete, select

from server.db import Attempt, MetricRow, Receipt, Round
from server.rounds import CoordinatorState, OpenRound, RoundState, Upload

log = logging.getLogger("fedkey.server")


class RecoveryMixin(CoordinatorState):
    """Reconciliation on start (part of Coordinator)."""

    def _reconcile(self) -> None:
        fed = self.fed
        done = fed.round
        rows = fed.storage.read_metrics()  # already repaired by resume(): rounds 0..done
        with self.sessions.begin() as db:
            db.execute(delete(MetricRow))
            for row in rows:
                db.add(MetricRow(round=row["round"], row=row))
            # rounds the checkpoint holds but the database did not record as aggregated
            for r in db.scalars(select(Round).where(Round.number <= done)):
                if r.state in (Attempt.OPEN, Attempt.AGGREGATING):
                    r.state = Attempt.AGGREGATED
            db.execute(delete(Round).where(Round.number > done + 1))
            db.execute(delete(Receipt).where(Receipt.round > done + 1))
            pending = db.scalars(
                select(Round).where(Round.number == done + 1).order_by(Round.attempt)
            ).all()
            live = [r for r in pending if r.state in (Attempt.OPEN, Attempt.AGGREGATING)]
            for r in pending:
                if r.state == Attempt.AGGREGATED:  # the checkpoint does not have it: never applied
                    r.state = Attempt.FAILED
            self._next_attempt = max((r.attempt + 1 for r in pending), default=0)
            if live and not self._finished():
                row = live.pop()
                for earlier in pending:  # strategy.setup as the earlier attempts called it
                    if earlier.attempt < row.attempt:
                        self._setup_strategy(list(earlier.available))
                self._continue_round(db, row)
            for r in live:  # several open attempts, or a run already over: never applied
                r.state = Attempt.FAILED
        self._cleanup_uploads()
        if self.current is None:
            self.state = RoundState.FINISHED if self._finished() else RoundState.WAITING
            if self.state == RoundState.FINISHED:
                self.finish_reason = self._finish_reason()
        self._set_round_gauge()

    def _continue_round(self, db, row: Round) -> None:
        """Rebuild the open round `row` from the database: cohort, attempt, receipts, uploads."""
        fed = self.fed
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
        row.state = Attempt.OPEN
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
        self.state = RoundState.OPEN
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
            if n <= self.fed.round:
                shutil.rmtree(d, ignore_errors=True)
        cur = self.current
        if cur is not None:  # stale temp files of an interrupted upload
            for tmp in self._round_dir(cur.number).glob(".tmp-*"):
                tmp.unlink(missing_ok=True)
