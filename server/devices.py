"""The device registry: enrollment, bearer tokens, and when each device was last seen."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.db import BatchWriter, Device, hash_token
from server.events import EventBus
from server.nospace import no_space, out_of_space
from server.rounds import ApiError
from server.settings import Settings
from server.telemetry import Telemetry
from server.validation import shown

log = logging.getLogger("fedkey.server")

#: Seconds between two writes of a device's last_seen (written in batches, off the event loop).
LAST_SEEN_EVERY = 30.0

DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def bearer_token(authorization: str | None, what: str = "<token>") -> str:
    """The token of an `Authorization: Bearer <token>` header, or 401 saying what the header
    must be (`what`: the token's name there). The scheme is matched in any case (RFC 7235,
    section 2.1: "case-insensitive"); the token is stripped of surrounding spaces."""
    if not authorization:
        raise ApiError(401, f"missing 'Authorization: Bearer {what}' header", "unauthorized")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, f"the Authorization header must be 'Bearer {what}'", "unauthorized")
    return token.strip()


class DeviceRegistry:
    """Who is enrolled: enrollment (POST /v1/devices), the bearer token of every request, and the
    devices' last_seen, written in batches by :meth:`write_last_seen_every`. Until :meth:`open`
    gives it the database nobody is enrolled: every token is refused."""

    def __init__(
        self,
        *,
        settings: Settings,
        enrollment_secret: str,
        telemetry: Telemetry,
        events: EventBus,
        on_enrolled: Callable[[], None],
    ):
        self._settings = settings
        self._secret = enrollment_secret
        self._sessions: Any = None  # sqlalchemy sessionmaker
        self._db_writer: BatchWriter | None = None  # group commits of enrollments
        self._telemetry = telemetry
        self._events = events
        self._on_enrolled = on_enrolled  # pokes the round driver
        self.devices: dict[str, int] = {}  # device id -> num_samples
        self._tokens: dict[str, str] = {}  # token hash -> device id
        self._enrolling: set[str] = set()  # names whose enrollment is being committed
        self.last_seen: dict[str, float] = {}
        self._seen_unwritten: set[str] = set()  # devices whose last_seen is not in the db yet

    def open(self, sessions: Any, db_writer: BatchWriter, db: Session) -> None:
        """At start: the database to write to, and the devices enrolled before a restart with
        their tokens, read in the transaction `db`."""
        self._sessions, self._db_writer = sessions, db_writer
        for d in db.scalars(select(Device)):
            self.devices[d.id] = d.num_samples
            self._tokens[d.token_hash] = d.id

    # -- enrollment ------------------------------------------------------------------------------

    async def enroll(self, secret: Any, name: Any = None, num_samples: Any = None) -> dict:
        """POST /v1/devices -> {"device_id", "token"}, or 401 / 409 / 422 / 507."""
        self._check_secret(secret)
        num_samples = self._check_enrollment(name, num_samples)
        device_id = name or f"dev-{secrets.token_hex(6)}"
        if device_id in self.devices or device_id in self._enrolling:
            raise _name_taken(device_id)
        token = secrets.token_urlsafe(32)
        token_hash = hash_token(token)
        await self._commit(device_id, token_hash, num_samples)
        self.devices[device_id] = num_samples
        self._tokens[token_hash] = device_id
        self._telemetry.devices.set(len(self.devices))
        self._events.publish("device_enrolled", device_id=device_id, devices=len(self.devices))
        self._on_enrolled()
        return {"device_id": device_id, "token": token}

    def _check_secret(self, secret: Any) -> None:
        # surrogatepass: a JSON "\ud800" is a str that plain UTF-8 cannot encode
        if not isinstance(secret, str) or not hmac.compare_digest(
            secret.encode("utf-8", "surrogatepass"), self._secret.encode()
        ):
            raise ApiError(401, "wrong or missing enrollment secret", "unauthorized")

    def _check_enrollment(self, name: Any, num_samples: Any) -> int:
        """422 for a bad name or sample count; the sample count (1 when not given)."""
        if name is not None and (not isinstance(name, str) or not DEVICE_NAME.fullmatch(name)):
            raise ApiError(
                422,
                "name must be 1-64 characters: letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                "bad_request",
            )
        if num_samples is None:
            return 1
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ApiError(422, "num_samples must be a non-negative integer", "bad_request")
        if num_samples > self._settings.max_samples:
            raise ApiError(
                422,
                f"num_samples {shown(num_samples)} is more than this server accepts "
                f"({self._settings.max_samples}, --max-samples)",
                "bad_request",
            )
        return num_samples

    async def _commit(self, device_id: str, token_hash: str, num_samples: int) -> None:
        """The device's row, committed with the others enrolling meanwhile in a worker thread."""
        now = time.time()
        device = Device(
            id=device_id,
            name=device_id,
            token_hash=token_hash,
            num_samples=num_samples,
            enrolled_at=now,
            last_seen=now,
        )
        if self._db_writer is None:
            raise RuntimeError("the coordinator is not started: start() opens the registry")
        self._enrolling.add(device_id)
        try:
            await self._db_writer.add(device)
        except IntegrityError:
            raise _name_taken(device_id) from None
        except Exception as e:
            if out_of_space(e):
                raise no_space("the enrollment") from None
            raise
        finally:
            self._enrolling.discard(device_id)

    # -- authentication and last_seen ----------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str:
        """`Authorization: Bearer <token>` -> device id, or 401."""
        device_id = self._tokens.get(hash_token(bearer_token(authorization)))
        if device_id is None:
            raise ApiError(401, "unknown device token: enroll first", "unauthorized")
        now = time.time()
        if now - self.last_seen.get(device_id, 0.0) > LAST_SEEN_EVERY:
            self.last_seen[device_id] = now
            self._seen_unwritten.add(device_id)  # written in batches: write_last_seen
        return device_id

    async def write_last_seen_every(self, stopped: asyncio.Event) -> None:
        """Every LAST_SEEN_EVERY seconds, the devices seen since are written in one transaction,
        in a worker thread: authenticating a request never waits for the database. The last
        batch once `stopped` is set."""
        while not stopped.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LAST_SEEN_EVERY):
                    await stopped.wait()
            await self.write_last_seen()

    async def write_last_seen(self) -> None:
        seen, self._seen_unwritten = self._seen_unwritten, set()
        if not seen:
            return
        batch = [{"id": d, "last_seen": self.last_seen[d]} for d in seen]
        try:
            await asyncio.to_thread(self._update_last_seen, batch)
        except Exception:  # e.g. a full disk: logged, tried again with the next batch
            log.exception("writing last_seen of %d devices failed", len(batch))
            self._seen_unwritten |= seen

    def _update_last_seen(self, batch: list[dict]) -> None:
        with self._sessions.begin() as db:
            db.execute(update(Device), batch)


def _name_taken(device_id: str) -> ApiError:
    return ApiError(409, f"device name {device_id!r} is already enrolled", "name_taken")
