"""fedkey.server.db.BatchWriter: enrollments arriving together are committed together, and each caller
still gets its own row's outcome."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from fedkey.server.db import BatchWriter, Device, make_sessionmaker


def _device(name: str) -> Device:
    return Device(id=name, name=name, token_hash=f"hash-{name}", num_samples=1, enrolled_at=0.0)


def _count(sessions) -> int:
    with sessions() as db:
        return db.scalar(select(func.count()).select_from(Device))


def test_rows_added_together_are_committed_in_a_few_transactions(tmp_path):
    sessions = make_sessionmaker(f"sqlite:///{tmp_path / 'db.sqlite'}")
    writer = BatchWriter(sessions)
    commits: list[int] = []
    commit = writer._commit

    def counted(rows):
        commits.append(len(rows))
        commit(rows)

    writer._commit = counted  # type: ignore[method-assign]

    async def enroll_many():
        await asyncio.gather(*(writer.add(_device(f"phone-{i}")) for i in range(200)))

    asyncio.run(enroll_many())
    assert _count(sessions) == 200
    assert sum(commits) == 200 and len(commits) <= 3, commits  # the first alone, then batches


def test_a_failing_row_fails_alone(tmp_path):
    sessions = make_sessionmaker(f"sqlite:///{tmp_path / 'db.sqlite'}")
    writer = BatchWriter(sessions)

    async def enroll():
        await writer.add(_device("taken"))
        return await asyncio.gather(
            *(writer.add(_device(n)) for n in ["a", "taken", "b"]), return_exceptions=True
        )

    a, taken, b = asyncio.run(enroll())
    assert a is None and b is None
    assert isinstance(taken, IntegrityError)
    assert _count(sessions) == 3
    with pytest.raises(IntegrityError):  # and the writer keeps working after it
        asyncio.run(writer.add(_device("taken")))
