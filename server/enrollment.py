"""Who may enroll a device: with the shared enrollment secret (FEDKEY_ENROLLMENT_SECRET), unless
the server takes minted tokens only (FEDKEY_ENROLLMENT=tokens), or with a single-use token the
operator minted (POST /v1/enrollment-tokens, `fedkey enroll-tokens N`), which enrolls one device
before it expires. Either goes in the enrollment's `enrollment_secret` field.

    credentials = Credentials(shared_secret)
    credentials.open(db)                  # at start: the minted tokens neither spent nor expired
    tokens, expires_at = await credentials.mint(count, ttl, writer)
    spent = credentials.take(credential)  # None: the shared secret; a minted token's hash; or 401
    credentials.settle(spent, ok)         # its device committed (ok) or not (the token is back)

A token is spent in the transaction that commits its device (fedkey.server.db.EnrollmentUse, whose key
is the token's hash), so it enrolls one device even across a crash; only hashes are stored.
"""

from __future__ import annotations

import hmac
import secrets
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from fedkey.server.db import BatchWriter, EnrollmentToken, EnrollmentUse, hash_token
from fedkey.server.round_state import ApiError

#: The most tokens one request mints, how long a token lives by default (a week) and at most (a
#: year), in seconds.
MAX_MINT = 100_000
DEFAULT_TOKEN_TTL = 7 * 24 * 3600.0
MAX_TTL = 365 * 24 * 3600.0


class Credentials:
    """The shared secret (None: minted tokens only) and the minted tokens not yet spent."""

    def __init__(self, shared_secret: str | None) -> None:
        self._secret = shared_secret
        self._unspent: dict[str, float] = {}  # token hash -> expires_at
        self._taken: dict[str, float] = {}  # tokens of enrollments being committed

    def open(self, db: Session) -> None:
        """The minted tokens of the database that are neither spent nor expired."""
        spent = set(db.scalars(select(EnrollmentUse.token_hash)))
        now = time.time()
        for token in db.scalars(select(EnrollmentToken)):
            if token.token_hash not in spent and token.expires_at > now:
                self._unspent[token.token_hash] = token.expires_at

    @property
    def unspent(self) -> int:
        return len(self._unspent)

    async def mint(self, count: int, ttl: float, writer: BatchWriter) -> tuple[list[str], float]:
        """`count` new tokens, each usable once within `ttl` seconds; (tokens, expires_at)."""
        if not 1 <= count <= MAX_MINT or not 0 < ttl <= MAX_TTL:
            raise ApiError(
                422,
                f"count must be 1 to {MAX_MINT} and ttl 0 to {MAX_TTL:.0f} seconds",
                "bad_request",
            )
        expires_at = time.time() + ttl
        tokens = [secrets.token_urlsafe(32) for _ in range(count)]
        rows = [EnrollmentToken(token_hash=hash_token(t), expires_at=expires_at) for t in tokens]
        await writer.add(*rows)
        self._unspent.update((row.token_hash, expires_at) for row in rows)
        return tokens, expires_at

    def take(self, credential: Any) -> str | None:
        """None for the shared secret, a minted token's hash (held until :meth:`settle`), or 401."""
        if isinstance(credential, str):
            encoded = credential.encode("utf-8", "surrogatepass")
            if self._secret is not None and hmac.compare_digest(encoded, self._secret.encode()):
                return None
            token_hash = hash_token(credential)
            expires_at = self._unspent.pop(token_hash, None)
            if expires_at is not None and expires_at > time.time():
                self._taken[token_hash] = expires_at
                return token_hash
        what = "enrollment secret or token" if self._secret is not None else "enrollment token"
        raise ApiError(401, f"wrong, spent, expired or missing {what}", "unauthorized")

    def use(self, spent: str | None, device_id: str) -> tuple[EnrollmentUse, ...]:
        """The rows that spend `spent` with `device_id`'s enrollment (none for the secret)."""
        return () if spent is None else (EnrollmentUse(token_hash=spent, device_id=device_id),)

    def settle(self, spent: str | None, ok: bool) -> None:
        """The enrollment that took `spent` is committed (`ok`) or failed: the token is then
        unspent again."""
        if spent is None:
            return
        expires_at = self._taken.pop(spent)
        if not ok:
            self._unspent[spent] = expires_at
