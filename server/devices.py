"""The device registry: enrollment (fedkey.server.enrollment says with what credential), the devices'
bearer tokens, their expiry (FEDKEY_DEVICE_TOKEN_TTL) and revocation, the cap on how many may
enroll (FEDKEY_MAX_DEVICES), and when each device was last seen."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fedkey.federation.updates.validation import shown
from fedkey.server.db import BatchWriter, Device, EnrollmentUse, hash_token
from fedkey.server.enrollment import Credentials
from fedkey.server.events import EventBus
from fedkey.server.round_state import ApiError
from fedkey.server.runtime.disk_full import no_space, out_of_space
from fedkey.server.runtime.prometheus import Telemetry
from fedkey.server.settings import Settings

log = logging.getLogger("fedkey.server")

#: Seconds between two writes of a device's last_seen (written in batches, off the event loop).
LAST_SEEN_EVERY = 30.0

DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: How a revoked device's row marks its token (followed by random hex, so no token matches it).
REVOKED = "revoked:"


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
        enrollment_secret: str | None,
        telemetry: Telemetry,
        events: EventBus,
        on_enrolled: Callable[[], None],
    ):
        """`enrollment_secret`: the shared secret that enrolls, or None for minted tokens only."""
        self._settings = settings
        self.credentials = Credentials(enrollment_secret)
        self._sessions: Any = None  # sqlalchemy sessionmaker
        self._db_writer: BatchWriter | None = None  # group commits of enrollments
        self._telemetry = telemetry
        self._events = events
        self._on_enrolled = on_enrolled  # pokes the round driver
        self.devices: dict[str, int] = {}  # device id -> num_samples
        self._tokens: dict[str, str] = {}  # token hash -> device id
        self._token_of: dict[str, str] = {}  # device id -> token hash
        self._enrolled_at: dict[str, float] = {}  # every device not revoked -> its token's birth
        self._enrolling: set[str] = set()  # names whose enrollment is being committed
        self.last_seen: dict[str, float] = {}
        self._seen_unwritten: set[str] = set()  # devices whose last_seen is not in the db yet

    def open(self, sessions: Any, db_writer: BatchWriter, db: Session) -> None:
        """At start: the database to write to, and the devices enrolled before a restart with
        their tokens, read in the transaction `db`."""
        self._sessions, self._db_writer = sessions, db_writer
        self.credentials.open(db)
        for d in db.scalars(select(Device)):
            if not d.token_hash.startswith(REVOKED):
                self._adopt(d.id, d.token_hash, d.num_samples, d.enrolled_at)

    # -- enrollment ------------------------------------------------------------------------------

    async def enroll(self, credential: Any, name: Any = None, num_samples: Any = None) -> dict:
        """POST /v1/devices -> {"device_id", "token"}, or 401 / 403 / 409 / 422 / 507. A name
        whose token expired is enrolled again, with a new token."""
        spent = self.credentials.take(credential)
        try:
            num_samples = self._check_enrollment(name, num_samples)
            device_id = name or f"dev-{secrets.token_hex(6)}"
            renew = self._check_room(device_id)
            token = secrets.token_urlsafe(32)
            token_hash = hash_token(token)
            uses = self.credentials.use(spent, device_id)
            await self._commit(device_id, token_hash, num_samples, uses, renew)
        except BaseException:
            self.credentials.settle(spent, ok=False)
            raise
        self.credentials.settle(spent, ok=True)
        self._forget(device_id)  # a renewed device's old token
        self._adopt(device_id, token_hash, num_samples, time.time())
        self._telemetry.devices.set(len(self.devices))
        self._events.publish("device_enrolled", device_id=device_id, devices=len(self.devices))
        self._on_enrolled()
        return {"device_id": device_id, "token": token}

    def _check_room(self, device_id: str) -> bool:
        """Whether `device_id` enrolls again (its token expired); 409 when the name is taken,
        403 past the cap on devices."""
        if device_id in self._enrolling:
            raise _name_taken(device_id)
        if device_id in self._enrolled_at:
            if not self._expired(device_id):
                raise _name_taken(device_id)
            return True
        cap = self._settings.max_devices
        if cap is not None and len(self._enrolled_at) + len(self._enrolling) >= cap:
            raise ApiError(
                403,
                f"this server enrolls at most {cap} devices (FEDKEY_MAX_DEVICES)",
                "device_cap",
            )
        return False

    def _adopt(self, device_id: str, token_hash: str, num_samples: int, at: float) -> None:
        self.devices[device_id] = num_samples
        self._tokens[token_hash] = device_id
        self._token_of[device_id] = token_hash
        self._enrolled_at[device_id] = at

    def _forget(self, device_id: str) -> None:
        """Drop `device_id` from memory: its token, its place in the rounds."""
        self._tokens.pop(self._token_of.pop(device_id, ""), None)
        self.devices.pop(device_id, None)
        self._enrolled_at.pop(device_id, None)
        self.last_seen.pop(device_id, None)

    def _expired(self, device_id: str) -> bool:
        ttl = self._settings.device_token_ttl
        return ttl is not None and time.time() - self._enrolled_at[device_id] > ttl

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

    async def _commit(
        self,
        device_id: str,
        token_hash: str,
        num_samples: int,
        uses: tuple[EnrollmentUse, ...],
        renew: bool,
    ) -> None:
        """The device's row (a new one, or with `renew` its new token), committed with `uses`
        (the minted token it spends): new rows with the others enrolling meanwhile, in a worker
        thread."""
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
            if renew:
                await asyncio.to_thread(self._write_renewal, device, uses)
            else:
                await self._db_writer.add(device, *uses)
        except IntegrityError:
            raise _name_taken(device_id) from None
        except Exception as e:
            if out_of_space(e):
                raise no_space("the enrollment") from None
            raise
        finally:
            self._enrolling.discard(device_id)

    def _write_renewal(self, device: Device, uses: tuple[EnrollmentUse, ...]) -> None:
        with self._sessions.begin() as db:
            db.merge(device)
            db.add_all(uses)

    # -- the operator's ---------------------------------------------------------------------------

    async def mint(self, count: Any, ttl: Any) -> dict:
        """POST /v1/enrollment-tokens -> {"tokens", "expires_at"}, or 422."""
        if self._db_writer is None:
            raise RuntimeError("the coordinator is not started: start() opens the registry")
        if not _is_int(count) or not isinstance(ttl, int | float) or isinstance(ttl, bool):
            raise ApiError(422, "count must be an integer and ttl a number", "bad_request")
        tokens, expires_at = await self.credentials.mint(count, float(ttl), self._db_writer)
        log.info("minted %d enrollment tokens, valid until %.0f", count, expires_at)
        return {"tokens": tokens, "expires_at": expires_at}

    async def revoke(self, device_id: str) -> dict:
        """DELETE /v1/devices/{id}: the device's token stops working at once, it is selected no
        more, and its name stays taken; 404 for a device not enrolled (or revoked already)."""
        if device_id not in self._enrolled_at or device_id in self._enrolling:
            raise ApiError(404, f"no enrolled device {shown(device_id)}", "not_found")
        revoked = REVOKED + secrets.token_hex(24)
        await asyncio.to_thread(self._write_revoked, device_id, revoked)
        self._forget(device_id)
        self._telemetry.devices.set(len(self.devices))
        self._events.publish("device_revoked", device_id=device_id, devices=len(self.devices))
        log.info("device %s revoked", device_id)
        return {"device_id": device_id, "revoked": True}

    def _write_revoked(self, device_id: str, revoked: str) -> None:
        with self._sessions.begin() as db:
            db.execute(update(Device).where(Device.id == device_id).values(token_hash=revoked))

    # -- authentication and last_seen ----------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str:
        """`Authorization: Bearer <token>` -> device id, or 401."""
        device_id = self._tokens.get(hash_token(bearer_token(authorization)))
        if device_id is None:
            raise ApiError(401, "unknown device token: enroll first", "unauthorized")
        if self._expired(device_id):
            self.devices.pop(device_id, None)  # selected no more until it enrolls again
            raise ApiError(401, "the device token expired: enroll again", "unauthorized")
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _name_taken(device_id: str) -> ApiError:
    return ApiError(409, f"device name {device_id!r} is already enrolled", "name_taken")
