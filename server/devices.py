"""Devices: enrollment, bearer tokens, and what a device sees of the round (its view, its task,
the long-poll that waits for the view to change)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from common.task import RoundTask
from server.db import Device, hash_token
from server.engine import client_seed
from server.nospace import no_space, out_of_space
from server.rounds import ApiError, CoordinatorState, OpenRound, RoundState
from server.settings import MAX_WAIT
from server.validation import shown

log = logging.getLogger("fedkey.server")

#: Seconds between two writes of a device's last_seen (written in batches, off the event loop).
LAST_SEEN_EVERY = 30.0
#: Long-polls woken in one event-loop iteration at a transition (the rest in the next ones).
WAKE_BATCH = 32

DEVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class DevicesMixin(CoordinatorState):
    """Enrollment, authentication and the views of the round (part of Coordinator)."""

    # -- devices -----------------------------------------------------------------------------------

    async def enroll(self, secret: Any, name: Any = None, num_samples: Any = None) -> dict:
        # surrogatepass: a JSON "\ud800" is a str that plain UTF-8 cannot encode
        if not isinstance(secret, str) or not hmac.compare_digest(
            secret.encode("utf-8", "surrogatepass"), self.enrollment_secret.encode()
        ):
            raise ApiError(401, "wrong or missing enrollment secret", "unauthorized")
        if name is not None and (not isinstance(name, str) or not DEVICE_NAME.fullmatch(name)):
            raise ApiError(
                422,
                "name must be 1-64 characters: letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                "bad_request",
            )
        if num_samples is None:
            num_samples = 1
        elif isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ApiError(422, "num_samples must be a non-negative integer", "bad_request")
        elif num_samples > self.settings.max_samples:
            raise ApiError(
                422,
                f"num_samples {shown(num_samples)} is more than this server accepts "
                f"({self.settings.max_samples}, --max-samples)",
                "bad_request",
            )
        device_id = name or f"dev-{secrets.token_hex(6)}"
        if device_id in self.devices or device_id in self._enrolling:
            raise ApiError(409, f"device name {device_id!r} is already enrolled", "name_taken")
        token = secrets.token_urlsafe(32)
        token_hash = hash_token(token)
        now = time.time()
        device = Device(
            id=device_id,
            name=device_id,
            token_hash=token_hash,
            num_samples=num_samples,
            enrolled_at=now,
            last_seen=now,
        )
        self._enrolling.add(device_id)
        try:  # committed with the others enrolling meanwhile, in a worker thread
            await self.db_writer.add(device)
        except IntegrityError:
            raise ApiError(
                409, f"device name {device_id!r} is already enrolled", "name_taken"
            ) from None
        except Exception as e:
            if out_of_space(e):
                raise no_space("the enrollment") from None
            raise
        finally:
            self._enrolling.discard(device_id)
        self.devices[device_id] = num_samples
        self._tokens[token_hash] = device_id
        self.telemetry.devices.set(len(self.devices))
        self.events.publish("device_enrolled", device_id=device_id, devices=len(self.devices))
        self._poke.set()
        return {"device_id": device_id, "token": token}

    def authenticate(self, authorization: str | None) -> str:
        """`Authorization: Bearer <token>` -> device id, or 401."""
        if not authorization:
            raise ApiError(401, "missing 'Authorization: Bearer <token>' header", "unauthorized")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "the Authorization header must be 'Bearer <token>'", "unauthorized")
        device_id = self._tokens.get(hash_token(token.strip()))
        if device_id is None:
            raise ApiError(401, "unknown device token: enroll first", "unauthorized")
        now = time.time()
        if now - self._last_seen.get(device_id, 0.0) > LAST_SEEN_EVERY:
            self._last_seen[device_id] = now
            self._seen_unwritten.add(device_id)  # written in batches: _write_last_seen
        return device_id

    async def _last_seen_writer(self) -> None:
        """Every LAST_SEEN_EVERY seconds, the devices seen since are written in one transaction,
        in a worker thread: authenticating a request never waits for the database."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LAST_SEEN_EVERY):
                    await self._stopped.wait()
            await self._write_last_seen()

    async def _write_last_seen(self) -> None:
        seen, self._seen_unwritten = self._seen_unwritten, set()
        if not seen:
            return
        batch = [{"id": d, "last_seen": self._last_seen[d]} for d in seen]
        try:
            await asyncio.to_thread(self._update_last_seen, batch)
        except Exception:  # e.g. a full disk: logged, tried again with the next batch
            log.exception("writing last_seen of %d devices failed", len(batch))
            self._seen_unwritten |= seen

    def _update_last_seen(self, batch: list[dict]) -> None:
        with self.sessions.begin() as db:
            db.execute(update(Device), batch)

    # -- what a device sees --------------------------------------------------------------------------

    def _upload_flag(self, r: OpenRound, device_id: str) -> bool | None:
        if device_id not in r.selected:
            return False
        if not self.settings.topk:
            return True
        if r.uploaders is None:
            return None
        return device_id in r.uploaders

    def task(self, r: OpenRound, device_id: str) -> dict:
        p = self.fed.config.privacy
        return RoundTask(
            train=r.plan.train,
            seed=client_seed(self.fed.config.seed, r.number, device_id),
            beta=p.beta,
            sigma=p.sigma,
            deadline=r.deadline,
            model_round=r.number - 1,
        ).to_json()

    def view(self, device_id: str) -> dict:
        """GET /v1/rounds/current for `device_id`."""
        r = self.current
        if r is None:
            done = self.fed.round
            return {
                "round": done if self.state == RoundState.FINISHED else done + 1,
                "attempt": 0 if self.state == RoundState.FINISHED else self._next_attempt,
                "state": self.state,
                "selected": False,
                "task": None,
                "loss_reported": False,
                "uploaded": False,
                "upload": False,
            }
        selected = device_id in r.selected
        return {
            "round": r.number,
            "attempt": r.attempt,
            "state": self.state,
            "selected": selected,
            "task": self.task(r, device_id) if selected else None,
            "loss_reported": device_id in r.losses,
            "uploaded": device_id in r.uploads,
            "upload": self._upload_flag(r, device_id),
        }

    def everyone_told_finished(self) -> bool:
        """The run is finished and every enrolled device has been answered so."""
        return self.state == RoundState.FINISHED and all(
            self._given.get(d, {}).get("state") == RoundState.FINISHED for d in self.devices
        )

    async def wait_view(self, device_id: str, wait: float) -> dict:
        """Long-poll: at once when the view differs in what concerns the device (:func:`concern`)
        from the one it was last given (so no transition is missed between two polls), else at
        the first such change within `wait`, else the current view at the end of `wait`."""
        view = self.view(device_id)
        given = concern(view)
        if wait > 0 and given == concern(self._given.get(device_id)):
            await self._wait_until(device_id, lambda: concern(self.view(device_id)) != given, wait)
            view = self.view(device_id)
        self._given[device_id] = view
        return view

    async def _wait_until(self, device_id: str, predicate: Callable[[], bool], wait: float) -> bool:
        """Wait (at most `wait` s) until `predicate()` holds, re-checking it whenever the round
        changes for this device (:meth:`_notify`)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, min(float(wait), MAX_WAIT))
        while not predicate():
            remaining = end - loop.time()
            if remaining <= 0 or self._stopping:
                return False
            changed = self._waiters.get(device_id)
            if changed is None:
                changed = self._waiters[device_id] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
        return True

    def _notify(self, devices: Iterable[str] | None = None) -> None:
        """The round changed for `devices` (a transition: its cohort; one device: its loss report
        or its upload; None: every device, as when the run finishes or the server stops): wake
        their long-polls, ``WAKE_BATCH`` a loop iteration. Woken all at once, their thousands of
        answers ran in one iteration while every other request (a /healthz) waited for its
        end."""
        if devices is None:
            woken, self._waiters = list(self._waiters.values()), {}
        else:
            woken = [e for d in devices if (e := self._waiters.pop(d, None)) is not None]
        _wake(woken, 0)

    def health(self) -> dict:
        r = self.current
        if r is not None:
            n = r.number
        elif self.federation is None:
            n = 0
        else:
            n = self.federation.round + (0 if self.state == RoundState.FINISHED else 1)
        return {"status": "ok", "round": n, "state": self.state}


def concern(view: dict | None) -> object:
    """What of a view its device's long-poll waits to change. A device with nothing to do (not
    selected, the run not finished) is concerned only by getting something to do: the rounds it
    is not in pass without waking it (at 10,000 phones every transition answered every long-poll,
    30,000 answers a round where 3,000 concern the cohort). Any other view concerns it whole."""
    if view is None:
        return None
    if view["selected"] or view["state"] == RoundState.FINISHED:
        return view
    return "nothing to do"


def _wake(events: list[asyncio.Event], start: int) -> None:
    """Set ``events[start:start + WAKE_BATCH]``, and the rest in later loop iterations (asyncio
    runs what `call_soon` adds during an iteration in the next one, after polling the sockets)."""
    for changed in events[start : start + WAKE_BATCH]:
        changed.set()
    if start + WAKE_BATCH < len(events):
        asyncio.get_running_loop().call_soon(_wake, events, start + WAKE_BATCH)
