"""The server's database: devices, rounds, receipts and metrics rows (SQLAlchemy 2 ORM).

SQLite by default (``<storage>/fedkey.db``); PostgreSQL with the pinned psycopg 3 driver
(``FEDKEY_DATABASE_URL=postgresql+psycopg://user:pass@host/db``; tests/server/test_postgres.py runs
the server against a real one). Times are unix seconds (floats: double precision on PostgreSQL) so
every backend stores them the same way. Sample counts and byte sizes are BigInteger (PostgreSQL's
INTEGER is 32-bit; --max-samples goes up to 2**62); upload paths are Text (PostgreSQL enforces
VARCHAR lengths, SQLite does not). PostgreSQL's json type refuses NaN and Infinity, which a diverged
run's perplexity can be: on PostgreSQL they are stored as null (metrics.jsonl keeps them).

The checkpoints are the source of truth for the model and the rounds it has seen; the database
holds what the checkpoints do not: the enrolled devices (tokens stored as sha256 hashes only),
the open round (cohort, attempt, deadline, topK decision), the receipts of loss reports and
uploads, and a copy of the metrics rows for the API.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


class Base(DeclarativeBase):
    pass


class Device(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    num_samples: Mapped[int] = mapped_column(BigInteger, default=1)
    enrolled_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float | None] = mapped_column(Float, nullable=True)


class EnrollmentToken(Base):
    """A single-use enrollment token the operator minted (POST /v1/enrollment-tokens): its
    hash and when it expires."""

    __tablename__ = "enrollment_tokens"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Float)


class EnrollmentUse(Base):
    """A minted token spent: committed with the device it enrolled, so it enrolls one only."""

    __tablename__ = "enrollment_uses"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    device_id: Mapped[str] = mapped_column(String(64))


class Attempt(StrEnum):
    """The state of one attempt at a round, as its row records it."""

    OPEN = "open"
    AGGREGATING = "aggregating"
    AGGREGATED = "aggregated"
    FAILED = "failed"


class Round(Base):
    """One attempt at a round: state open -> aggregating -> aggregated, or failed."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("number", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    number: Mapped[int] = mapped_column(Integer, index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16))  # an Attempt
    available: Mapped[list] = mapped_column(JSON)  # the enrolled devices it was drawn from
    cohort: Mapped[list] = mapped_column(JSON)
    uploaders: Mapped[list | None] = mapped_column(JSON, nullable=True)  # topK decision
    opened_at: Mapped[float] = mapped_column(Float)
    deadline: Mapped[float] = mapped_column(Float)


class Receipt(Base):
    """A device's loss report (kind 'loss') or accepted upload (kind 'update') for a round."""

    __tablename__ = "receipts"
    __table_args__ = (UniqueConstraint("round", "attempt", "device_id", "kind"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    receipt: Mapped[str] = mapped_column(String(40), unique=True)
    round: Mapped[int] = mapped_column(Integer, index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    device_id: Mapped[str] = mapped_column(String(64), ForeignKey("devices.id"))
    kind: Mapped[str] = mapped_column(String(8))  # 'loss' | 'update'
    train_loss: Mapped[float] = mapped_column(Float)
    num_samples: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    path: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class MetricRow(Base):
    """A copy of one metrics.jsonl row (the checkpoint is the source of truth)."""

    __tablename__ = "metrics"

    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    row: Mapped[dict[str, Any]] = mapped_column(JSON)


class BatchWriter:
    """Group commit: rows added while a transaction is being written go into the next one, in
    a worker thread. 10,000 phones enrolling at once make a few dozen commits (each an fsync
    under SQLite's synchronous=FULL), not 10,000, and the event loop writes none of them.

        await writer.add(Device(...))   # returns once the row is committed; raises its error
        await writer.add(a, b)          # rows committed together, in one transaction

    When a batch fails (a name taken), its rows are committed one by one, so each caller gets
    its own row's outcome."""

    def __init__(self, sessions: sessionmaker):
        self.sessions = sessions
        self._pending: list[tuple[tuple[Base, ...], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    async def add(self, *rows: Base) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((rows, done))
        if self._task is None:
            self._task = asyncio.create_task(self._write(), name="fedkey-db-writer")
        await done

    async def _write(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await asyncio.to_thread(self._commit, [r for rows, _ in batch for r in rows])
                    outcomes: list[BaseException | None] = [None] * len(batch)
                except Exception as e:
                    if len(batch) == 1:
                        outcomes = [e]
                    else:  # find whose row failed: one transaction each
                        outcomes = [await self._alone(rows) for rows, _ in batch]
                for (_, done), outcome in zip(batch, outcomes, strict=True):
                    if done.done():  # the request was cancelled meanwhile
                        continue
                    if outcome is None:
                        done.set_result(None)
                    else:
                        done.set_exception(outcome)
        finally:
            self._task = None

    async def _alone(self, rows: tuple[Base, ...]) -> BaseException | None:
        try:
            await asyncio.to_thread(self._commit, list(rows))
        except Exception as e:
            return e
        return None

    def _commit(self, rows: list[Base]) -> None:
        with self.sessions.begin() as db:
            db.add_all(rows)


def hash_token(token: str) -> str:
    """The stored hash of a bearer token or an enrollment credential (surrogatepass: a JSON
    "\\ud800" is a str that plain UTF-8 cannot encode)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinite float (in dicts and lists) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def json_strict(value: Any) -> str:
    """JSON that PostgreSQL's json type accepts: NaN and Infinity become null."""
    return json.dumps(finite_json(value), allow_nan=False)


#: Seconds a SQLite writer waits for the write lock.
SQLITE_LOCK_TIMEOUT = 30.0


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets its directory created, WAL and cross-thread use; any
    other backend (a server) gets pre-pinged connections and strict JSON."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # timeout: how long a writer waits for SQLite's one write lock before "database is
        # locked" (the driver's default 5 s is passed under thousands of phones' writes).
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": SQLITE_LOCK_TIMEOUT}
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # made here, 0600, so SQLite opens it and its WAL files readable by the owner alone
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    else:  # a restarted database server or an idle-closed connection: reconnect, do not 500
        kwargs["pool_pre_ping"] = True
        kwargs["json_serializer"] = json_strict
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # pragma: no cover - trivial
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.close()

    return engine


def make_sessionmaker(url: str) -> sessionmaker:
    """Create the tables if needed and return a session factory (expire_on_commit=False)."""
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    return sessionmaker(engine, expire_on_commit=False)
