"""Restart: reconcile the database with the checkpoint, the source of truth, and find the open
round to continue with the same cohort, attempt, receipts and uploads. Plain functions, called
once by Coordinator.start() before the round driver runs."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from fedkey.federation.engine import Federation
from fedkey.server.db import Attempt, MetricRow, Receipt, Round
from fedkey.server.round_driver import run_over, setup_strategy
from fedkey.server.round_state import OpenRound, Upload, round_dir
from fedkey.server.settings import Settings

log = logging.getLogger("fedkey.server")


@dataclass(frozen=True)
class Resumed:
    """What the round driver continues with: the open round (None: none) and the next attempt."""

    current: OpenRound | None
    next_attempt: int


def forget_rounds(db: Session) -> None:
    """A fresh run: forget the rounds of an earlier one (the devices stay enrolled)."""
    db.execute(delete(Receipt))
    db.execute(delete(Round))
    db.execute(delete(MetricRow))


def reconcile(
    *,
    fed: Federation,
    sessions: Any,  # sqlalchemy sessionmaker
    settings: Settings,
    devices: Mapping[str, int],
    uploads_dir: Path,
) -> Resumed:
    """The database made to agree with the checkpoint (metrics, rounds, receipts), the uploads
    of rounds it holds removed; the open round after it rebuilt, when there is one to continue.
    `devices`: the enrolled devices (id -> num_samples), for strategy.setup."""
    done = fed.round
    rows = fed.storage.read_metrics()  # already repaired by resume(): rounds 0..done
    with sessions.begin() as db:
        _settle_done_rounds(db, rows, done)
        pending = db.scalars(
            select(Round).where(Round.number == done + 1).order_by(Round.attempt)
        ).all()
        live = [r for r in pending if r.state in (Attempt.OPEN, Attempt.AGGREGATING)]
        for r in pending:
            if r.state == Attempt.AGGREGATED:  # the checkpoint does not have it: never applied
                r.state = Attempt.FAILED
        next_attempt = max((r.attempt + 1 for r in pending), default=0)
        current = None
        if live and not run_over(fed):
            row = live.pop()
            for earlier in pending:  # strategy.setup as the earlier attempts called it
                if earlier.attempt < row.attempt:
                    setup_strategy(fed, devices, list(earlier.available))
            current = _continue_round(db, row, fed, settings, devices)
        for r in live:  # several open attempts, or a run already over: never applied
            r.state = Attempt.FAILED
    _cleanup_uploads(settings, fed, uploads_dir, current)
    return Resumed(current, next_attempt)


def _settle_done_rounds(db: Session, rows: list[dict], done: int) -> None:
    """The metrics table rebuilt from metrics.jsonl's `rows`; the rounds up to `done` (the
    checkpoint's) marked aggregated; rows and receipts past the next round dropped."""
    db.execute(delete(MetricRow))
    for row in rows:
        db.add(MetricRow(round=row["round"], row=row))
    # rounds the checkpoint holds but the database did not record as aggregated
    for r in db.scalars(select(Round).where(Round.number <= done)):
        if r.state in (Attempt.OPEN, Attempt.AGGREGATING):
            r.state = Attempt.AGGREGATED
    db.execute(delete(Round).where(Round.number > done + 1))
    db.execute(delete(Receipt).where(Receipt.round > done + 1))


def _continue_round(
    db, row: Round, fed: Federation, settings: Settings, devices: Mapping[str, int]
) -> OpenRound:
    """Rebuild the open round `row` from the database: cohort, attempt, receipts, uploads."""
    # Replay the draw exactly as it was made: same devices known, same attempt.
    setup_strategy(fed, devices, list(row.available))
    plan = fed.plan_round(list(row.available), row.attempt)
    if plan.cohort != list(row.cohort):
        log.warning(
            "round %d: replayed draw %s differs from the stored cohort", row.number, plan.cohort
        )
    plan.cohort = list(row.cohort)
    now = time.time()
    grace = min(settings.upload_grace, settings.round_deadline)
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
    log.info(
        "continuing round %d (attempt %d): %d/%d uploads in",
        r.number,
        r.attempt,
        len(r.uploads),
        len(plan.cohort),
    )
    return r


def _cleanup_uploads(
    settings: Settings, fed: Federation, uploads_dir: Path, current: OpenRound | None
) -> None:
    """Remove upload folders of rounds already in the checkpoint (unless keep_uploads), and the
    temporary files of uploads the stop interrupted."""
    if settings.keep_uploads or not uploads_dir.exists():
        return
    for d in uploads_dir.glob("round_*"):
        try:
            n = int(d.name.split("_", 1)[1])
        except ValueError:
            continue
        if n <= fed.round:
            shutil.rmtree(d, ignore_errors=True)
    if current is not None:  # stale temp files of an interrupted upload
        for tmp in round_dir(uploads_dir, current.number).glob(".tmp-*"):
            tmp.unlink(missing_ok=True)
