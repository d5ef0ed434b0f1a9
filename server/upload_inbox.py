"""The upload inbox: requests of selected devices, loss reports (FedMed topK) and uploads,
validated, written atomically, one Receipt each. It only records what devices send in the open
round and pokes the round driver; the driver decides what happens next."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import delete

from fedkey.common.files import publish
from fedkey.federation.engine import Federation
from fedkey.federation.updates import store as upload_store
from fedkey.federation.updates import validation
from fedkey.federation.updates.validation import ValidationError
from fedkey.server.db import Receipt
from fedkey.server.device_views import LongPolls
from fedkey.server.events import EventBus
from fedkey.server.round_state import ApiError, OpenRound, RoundNow, RoundState, Upload, round_dir
from fedkey.server.runtime import disk_full as nospace
from fedkey.server.runtime.prometheus import Telemetry
from fedkey.server.runtime.slots import OnePerKey, acquire_within
from fedkey.server.settings import Settings

#: Seconds an upload waits for one of the settings.max_receiving slots before it is answered 503
#: with Retry-After: a safety net, past any phone's reply timeout (60 s in device_sim, 120 s in
#: bench load), so that the server does not keep the waits of phones that are long gone. Not
#: less: a slot is held while its body arrives, and at 10,000 phones on two cores a round's
#: 1,000 uploads at 64 at a time queued for more than 30 s, which a 30 s cap answered with 142
#: 503s in one run (fedkey bench load, cell slot-follows-2).
RECEIVE_WAIT = 300.0
#: The Retry-After of that 503, in seconds.
BUSY_RETRY_AFTER = 5
#: Seconds an upload body may take beyond what its size at settings.min_upload_rate needs.
UPLOAD_GRACE = 30.0


class UploadInbox:
    """POST /v1/rounds/{n}/loss and /v1/rounds/{n}/update: each request authenticated, checked
    against the open round, stored with its receipt, recorded in the round, announced."""

    def __init__(
        self,
        *,
        settings: Settings,
        fed: Federation,
        sessions: Any,  # sqlalchemy sessionmaker
        uploads_dir: Path,
        upload_limit: int,
        authenticate: Callable[[str | None], str],
        rounds: RoundNow,
        polls: LongPolls,
        poke: Callable[[], None],
        telemetry: Telemetry,
        events: EventBus,
    ):
        self._settings = settings
        self._topk = settings.topk
        self._fed = fed
        self._sessions = sessions
        self._uploads_dir = uploads_dir
        self.upload_limit = upload_limit  # bytes: the model's plus settings.max_upload_margin
        self._authenticate = authenticate  # the device registry's
        self._rounds = rounds  # the round driver's state
        self._polls = polls
        self._poke = poke  # wakes the round driver
        self._telemetry = telemetry
        self._events = events
        # upload bodies being read (settings.max_receiving at once): the server's memory
        self.receiving = asyncio.Semaphore(settings.max_receiving)
        self._receiving_from = OnePerKey()  # devices whose upload request is in progress
        # the longest one body may take once it has a slot: a grace, plus its largest size at
        # the slowest rate a phone may send (settings.min_upload_rate)
        self.body_seconds = UPLOAD_GRACE + upload_limit / settings.min_upload_rate

    # -- loss reports ----------------------------------------------------------------------------

    async def report_loss(
        self, authorization: str | None, n: int, body: bytes, wait: float = 0.0
    ) -> dict:
        """POST /v1/rounds/{n}/loss -> {"upload": true|false|null}."""
        device_id = None
        try:
            device_id = self._authenticate(authorization)
            r = self._open_round_for(device_id, n)
            loss = _parse_loss_body(body, self._settings.max_samples)
            if device_id in r.losses:
                if r.losses[device_id] != loss:
                    raise ApiError(
                        409,
                        f"device {device_id!r} already reported a different loss for round {n}",
                        "duplicate",
                    )
            else:
                await self._record_loss(r, device_id, n, loss)
        except ValidationError as e:
            self._reject(device_id, n, "loss", e)
            raise
        if wait > 0 and self._polls.can_wait(device_id):  # else answered at once
            await self._polls.wait_until(
                device_id,
                lambda: (
                    self._rounds.current is not r
                    or r.upload_flag(device_id, self._topk) is not None
                ),
                wait,
            )
        return {
            "upload": r.upload_flag(device_id, self._topk) if self._rounds.current is r else None
        }

    async def _record_loss(
        self, r: OpenRound, device_id: str, n: int, loss: tuple[float, int]
    ) -> None:
        """A first loss report: its receipt committed, then recorded in the round (unless the
        uploaders were chosen meanwhile), the driver poked."""
        _check_first_loss(r, device_id, n)
        train_loss, num_samples = loss
        receipt = Receipt(
            receipt=secrets.token_hex(16),
            round=n,
            attempt=r.attempt,
            device_id=device_id,
            kind="loss",
            train_loss=train_loss,
            num_samples=num_samples,
            created_at=time.time(),
        )
        with _storing(r, device_id), _disk_full_is("the loss report"):
            # the commit in a worker thread: the event loop serves others meanwhile
            await asyncio.to_thread(self._add_receipt, receipt)
        if self._rounds.current is not r or r.uploaders is not None:
            raise ApiError(
                409,
                f"round {n}'s uploaders were chosen while the loss report was stored",
                "stale_round",
            )
        r.losses[device_id] = loss
        self._telemetry.loss_reports.inc()
        self._polls.notify((device_id,))
        self._poke()

    # -- uploads ---------------------------------------------------------------------------------

    async def receive_update(
        self,
        authorization: str | None,
        n: int,
        headers: Mapping[str, str],
        body: AsyncIterator[bytes],
    ) -> dict:
        """POST /v1/rounds/{n}/update: stream the body to disk, validate it from there, commit
        its receipt, then rename it into place (fedkey.federation.updates.store). A repeat of an upload the
        round already holds is answered the same way whether or not the round has closed since:
        a phone whose answer was lost gets its receipt."""
        device_id = None
        try:
            device_id = self._authenticate(authorization)
            r = self._round_taking(device_id, n)
            # one request of a device at a time: one phone cannot hold every receiving slot
            with self._receiving_from.hold(device_id, lambda: _in_progress(device_id, n)):
                existing = r.uploads.get(device_id)
                received = await self._receive_body(existing, device_id, n, headers, body)
                with _removed(received.path):  # once renamed into place, nothing is left
                    up, fresh = await self._keep(r, existing, device_id, n, headers, received)
        except ValidationError as e:
            self._reject(device_id, n, "update", e)
            raise
        except Exception as e:
            if not nospace.out_of_space(e):
                raise
            err = nospace.no_space("the update")
            self._telemetry.storage_full.labels(what="update").inc()
            self._reject(device_id, n, "update", err)
            raise err from None
        if fresh:
            self._announce(r, device_id, up)
        return up.reply(n)

    def _round_taking(self, device_id: str, n: int) -> OpenRound:
        """The round an upload for round `n` goes to: the one that holds the device's upload
        already (open or being aggregated: a repeat), else the open round, when the device may
        upload and has no other upload in progress."""
        r = self._rounds.current
        if r is not None and r.number == n and device_id in r.uploads:
            return r
        r = self._open_round_for(device_id, n)
        self._check_may_upload(r, device_id)
        if device_id in r.storing:
            raise _in_progress(device_id, n)
        return r

    async def _receive_body(
        self,
        existing: Upload | None,
        device_id: str,
        n: int,
        headers: Mapping[str, str],
        body: AsyncIterator[bytes],
    ) -> upload_store.Received:
        """The body in a temporary file, read while one of the receiving slots is held (503
        when none comes free in time); too large: 413, or 409 for a repeat (surely not the same
        bytes)."""
        try:
            validation.check_content_length(headers.get("content-length"), self.upload_limit)
            # the server's memory: not one buffer per upload
            if not await acquire_within(self.receiving, RECEIVE_WAIT):
                raise _busy()
            try:
                return await upload_store.receive(
                    body,
                    round_dir(self._uploads_dir, n),
                    f".tmp-{device_id}-",
                    self.upload_limit,
                    deadline=asyncio.get_running_loop().time() + self.body_seconds,
                )
            finally:
                self.receiving.release()
        except ValidationError as e:
            if e.status == 413 and existing is not None:
                raise _different_duplicate(device_id, n) from None
            raise

    async def _keep(
        self,
        r: OpenRound,
        existing: Upload | None,
        device_id: str,
        n: int,
        headers: Mapping[str, str],
        received: upload_store.Received,
    ) -> tuple[Upload, bool]:
        """(the upload, whether it is new): a repeat answered with the upload the round holds
        (held to the same bytes and headers), else the body validated and stored."""
        max_samples = self._settings.max_samples
        if existing is not None:  # a retry: held to the same headers (422), not let through
            declared = _upload_headers(headers, max_samples)
            return _same_again(existing, received.sha256, declared, device_id, n), False
        await asyncio.to_thread(validation.check_update_file, received.path, self._fed.model_config)
        declared = _upload_headers(headers, max_samples)
        # The round may have moved on while the body streamed in: check again, then commit.
        r = self._still_open(r, device_id, n)
        existing = r.uploads.get(device_id)
        if existing is not None:  # uploaded meanwhile
            return _same_again(existing, received.sha256, declared, device_id, n), False
        return await self._store(r, device_id, n, declared, received), True

    async def _store(
        self,
        r: OpenRound,
        device_id: str,
        n: int,
        declared: tuple[int, float],
        received: upload_store.Received,
    ) -> Upload:
        """Commit the receipt and rename the file into place; recorded in the round, unless
        aggregation began meanwhile (then undone: 409)."""
        num_samples, train_loss = declared
        final = str(round_dir(self._uploads_dir, n) / f"{device_id}.safetensors")
        receipt = secrets.token_hex(16)
        up = Upload(receipt, received.sha256, received.size, final, num_samples, train_loss)
        with _storing(r, device_id):
            await asyncio.to_thread(self._commit, r, device_id, up, received.path)
        if self._rounds.current is not r or self._rounds.state != RoundState.OPEN:
            await asyncio.to_thread(self._uncommit, up)
            raise ApiError(409, f"round {n} closed while the update was stored", "stale_round")
        r.uploads[device_id] = up
        return up

    def _announce(self, r: OpenRound, device_id: str, up: Upload) -> None:
        """A new upload: counted, published, its device's long-polls woken, the driver poked."""
        self._telemetry.uploads_accepted.inc()
        expected = r.expected(self._topk)
        self._events.publish(
            "update_received",
            round=r.number,
            attempt=r.attempt,
            device_id=device_id,
            bytes=up.bytes,
            sha256=up.sha256,
            received=len(r.uploads),
            expected=len(expected) if expected is not None else None,
        )
        self._polls.notify((device_id,))
        self._poke()

    # -- the round a request is for --------------------------------------------------------------

    def _open_round_for(self, device_id: str, n: int) -> OpenRound:
        """The open round `n` with `device_id` selected, or 409 / 403."""
        r, state = self._rounds.current, self._rounds.state
        if state == RoundState.FINISHED:
            raise ApiError(409, f"the run is finished after round {self._fed.round}", "stale_round")
        if r is None:
            nxt = self._fed.round + 1
            reason = "stale_round" if n < nxt else "future_round" if n > nxt else "not_open"
            raise ApiError(409, f"round {n} is not open: round {nxt} has not opened yet", reason)
        if n != r.number:
            which = "stale" if n < r.number else "future"
            raise ApiError(
                409,
                f"round {n} is not the open round ({which}); round {r.number} is",
                f"{which}_round",
            )
        if state != RoundState.OPEN:
            raise ApiError(
                409, f"round {n} is closed and being aggregated; wait for the next", "stale_round"
            )
        if device_id not in r.selected:
            raise ApiError(
                403, f"device {device_id!r} is not selected in round {n}", "not_selected"
            )
        return r

    def _still_open(self, r: OpenRound, device_id: str, n: int) -> OpenRound:
        if self._rounds.current is not r:
            raise ApiError(409, f"round {n} closed while the update was received", "stale_round")
        return self._open_round_for(device_id, n)

    def _check_may_upload(self, r: OpenRound, device_id: str) -> None:
        flag = r.upload_flag(device_id, self._topk)
        if flag is None:
            raise ApiError(
                403,
                f"round {r.number}: the topK decision is pending; report your loss and poll "
                "/v1/rounds/current until 'upload' is true",
                "not_selected",
            )
        if flag is False:
            raise ApiError(
                403,
                f"device {device_id!r} was not chosen to upload in round {r.number} (topK)",
                "not_selected",
            )

    def _reject(self, device_id: str | None, n: int | None, kind: str, e: ValidationError) -> None:
        record_rejection(self._telemetry, self._events, device_id, n, kind, e)

    # -- receipts (in worker threads) ------------------------------------------------------------

    def _add_receipt(self, receipt: Receipt) -> None:
        with self._sessions.begin() as db:
            db.add(receipt)

    def _commit(self, r: OpenRound, device_id: str, up: Upload, tmp: Path) -> None:
        """Commit the receipt, then rename the file into place; if the rename fails the receipt
        is deleted again, so a failure leaves nothing behind (a crash between the two leaves a
        receipt without its file, which a restart drops)."""
        self._add_receipt(
            Receipt(
                receipt=up.receipt,
                round=r.number,
                attempt=r.attempt,
                device_id=device_id,
                kind="update",
                train_loss=up.train_loss,
                num_samples=up.num_samples,
                sha256=up.sha256,
                bytes=up.bytes,
                path=up.path,
                created_at=time.time(),
            )
        )
        try:
            publish(tmp, up.path)
        except BaseException:
            self._uncommit(up)
            raise

    def _uncommit(self, up: Upload) -> None:
        """Undo :meth:`_commit`: the receipt and the file."""
        with self._sessions.begin() as db:
            db.execute(delete(Receipt).where(Receipt.receipt == up.receipt))
        Path(up.path).unlink(missing_ok=True)


def _check_first_loss(r: OpenRound, device_id: str, n: int) -> None:
    """403 once the uploaders are chosen, 409 while another report of the device is stored."""
    if r.uploaders is not None:
        raise ApiError(
            403,
            f"round {n}'s uploaders were already chosen without device {device_id!r}",
            "not_selected",
        )
    if device_id in r.storing:
        raise ApiError(
            409,
            f"device {device_id!r} has a loss report for round {n} in progress",
            "duplicate",
        )


def _in_progress(device_id: str, n: int) -> ApiError:
    return ApiError(
        409, f"device {device_id!r} has an upload for round {n} in progress", "duplicate"
    )


def record_rejection(
    telemetry: Telemetry,
    events: EventBus,
    device_id: str | None,
    n: int | None,
    kind: str,
    e: ValidationError,
) -> None:
    """A refused loss report or upload (`kind`): counted and published."""
    telemetry.uploads_rejected.labels(reason=e.reason, kind=kind).inc()
    events.publish(
        "update_rejected",
        round=n,
        device_id=device_id,
        kind=kind,
        reason=e.reason,
        status=e.status,
        detail=e.message,
    )


@contextlib.contextmanager
def _storing(r: OpenRound, device_id: str) -> Iterator[None]:
    """`device_id`'s request is being committed (in a worker thread) meanwhile."""
    r.storing.add(device_id)
    try:
        yield
    finally:
        r.storing.discard(device_id)


@contextlib.contextmanager
def _disk_full_is(what: str) -> Iterator[None]:
    """A full disk meanwhile is answered 507 (fedkey.server.runtime.disk_full), saying `what` was not stored."""
    try:
        yield
    except Exception as e:
        if nospace.out_of_space(e):
            raise nospace.no_space(what) from None
        raise


@contextlib.contextmanager
def _removed(path: Path) -> Iterator[None]:
    """`path` removed at the end, however it ends."""
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _upload_headers(headers: Mapping[str, str], max_samples: int) -> tuple[int, float]:
    """An upload's X-Fedkey-Num-Samples and X-Fedkey-Train-Loss, or 422 saying what is wrong."""
    num_samples = validation.parse_num_samples(
        headers.get(validation.NUM_SAMPLES_HEADER), max_samples
    )
    return num_samples, validation.parse_train_loss(headers.get(validation.TRAIN_LOSS_HEADER))


def _same_again(
    existing: Upload, sha256: str, declared: tuple[int, float], device_id: str, n: int
) -> Upload:
    """A second upload for the round: the first one when it is the same upload again (the same
    bytes and the same declared sample count and loss: a retry), else 409."""
    if existing.sha256 == sha256 and (existing.num_samples, existing.train_loss) == declared:
        return existing
    raise _different_duplicate(device_id, n)


def _different_duplicate(device_id: str, n: int) -> ApiError:
    return ApiError(
        409,
        f"device {device_id!r} already uploaded a different update for round {n}",
        "duplicate",
    )


def _parse_loss_body(raw: bytes, max_samples: int) -> tuple[float, int]:
    body = validation.parse_json_object(
        raw, '{"train_loss": float, "num_samples": int}', "bad_loss"
    )
    loss, n = body.get("train_loss"), body.get("num_samples")
    if isinstance(loss, bool) or not isinstance(loss, int | float):
        raise ApiError(422, "train_loss must be a number", "bad_loss")
    if isinstance(n, bool) or not isinstance(n, int):
        raise ApiError(422, "num_samples must be an integer", "bad_loss")
    try:
        if isinstance(loss, int) and abs(loss) > 2**1000:  # float() would overflow
            raise ValidationError(422, "train_loss must be a finite number", "bad_loss")
        validation.check_loss_report(float(loss), n, max_samples)
    except ValidationError as e:
        raise ApiError(e.status, e.message, e.reason) from None
    return float(loss), n


def _busy() -> ApiError:
    """503: no upload slot came free in time; nothing was read or stored."""
    return ApiError(
        503,
        f"no upload slot came free within {RECEIVE_WAIT:g} s: the server is busy; nothing was "
        "stored; retry after Retry-After",
        "busy",
        {"Retry-After": str(BUSY_RETRY_AFTER)},
    )
