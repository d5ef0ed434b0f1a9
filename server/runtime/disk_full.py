"""A full disk, told apart from other failures: the server answers it with 507 and Retry-After
(nothing stored, the device retries) and postpones an aggregation (the round stays open with its
uploads) instead of failing anything."""

from __future__ import annotations

import errno
import sqlite3

from fedkey.federation.updates.validation import ValidationError

_NO_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
#: PostgreSQL's SQLSTATE for disk_full.
_PG_DISK_FULL = "53100"


def out_of_space(exc: BaseException) -> bool:
    """Whether `exc` says the disk (or the database's disk) is full: OSError ENOSPC/EDQUOT,
    SQLite's SQLITE_FULL, PostgreSQL's disk_full, as raised directly or wrapped by SQLAlchemy."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            return True
        if isinstance(e, sqlite3.Error) and getattr(e, "sqlite_errorcode", None) == (
            sqlite3.SQLITE_FULL
        ):
            return True
        if getattr(e, "sqlstate", None) == _PG_DISK_FULL:
            return True
        e = getattr(e, "orig", None) or e.__cause__ or e.__context__
    return False


def no_space(what: str) -> ValidationError:
    """507: the server's disk is full; nothing was stored, the device may retry later."""
    return ValidationError(
        507,
        f"the server's disk is full: {what} was not stored; retry in a minute",
        "no_space",
        headers={"Retry-After": "60"},
    )
