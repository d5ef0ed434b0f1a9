"""Requests of selected devices: loss reports (FedMed topK) and uploads, validated, written
atomically, one Receipt each. They only record what devices send and poke the driver."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from sqlalchemy import delete

from common.files import publish
from server import nospace, upload_store, validation
from server.db import Receipt
from server.rounds import ApiError, CoordinatorState, OpenRound, RoundState, Upload
from server.slots import acquire_within
from server.validation import ValidationError

#: Seconds an upload waits for one of the settings.max_receiving slots before it is answered 503
#: with Retry-After: a safety net, past any phone's reply timeout (60 s in device_sim, 120 s in
#: bench load), so that the server does not keep the waits of phones that are long gone. Not
#: less: a slot is held while its body arrives, and at 10,000 phones on two cores a round's
#: 1,000 uploads at 64 at a time queued for more than 30 s, which a 30 s cap answered with 142
#: 503s in one run (fedkey bench load, cell slot-follows-2).
RECEIVE_WAIT = 300.0
#: The Retry-After of that 503, in seconds.
BUSY_RETRY_AFTER = 5


class UploadsMixin(CoordinatorState):
    """POST /v1/rounds/{n}/loss and /v1/rounds/{n}/update (part of Coordinator)."""

    def _open_round_for(self, device_id: str, n: int) -> OpenRound:
        """The open round `n` with `device_id` selected, or 409 / 403."""
        r = self.current
        if self.state == RoundState.FINISHED:
            raise ApiError(409, f"the run is finished after round {self.fed.round}", "stale_round")
        if r is None:
            nxt = self.fed.round + 1
            reason = "stale_round" if n < nxt else "future_round" if n > nxt else "not_open"
            raise ApiError(409, f"round {n} is not open: round {nxt} has not opened yet", reason)
        if n != r.number:
            which = "stale" if n < r.number else "future"
            raise ApiError(
                409,
                f"round {n} is not the open round ({which}); round {r.number} is",
                f"{which}_round",
            )
        if self.state != RoundState.OPEN:
            raise ApiError(
                409, f"round {n} is closed and being aggregated; wait for the next", "stale_round"
            )
        if device_id not in r.selected:
            raise ApiError(
                403, f"device {device_id!r} is not selected in round {n}", "not_selected"
            )
        return r

    def _reject(self, device_id: str | None, n: int | None, kind: str, e: ValidationError) -> None:
        self.telemetry.uploads_rejected.labels(reason=e.reason, kind=kind).inc()
        self.events.publish(
            "update_rejected",
            round=n,
            device_id=device_id,
            kind=kind,
            reason=e.reason,
            status=e.status,
            detail=e.message,
        )

    async def report_loss(
        self, authorization: str | None, n: int, body: bytes, wait: float = 0.0
    ) -> dict:
        """POST /v1/rounds/{n}/loss -> {"upload": true|false|null}."""
        device_id = None
        try:
            device_id = self.authenticate(authorization)
            r = self._open_round_for(device_id, n)
            train_loss, num_samples = _parse_loss_body(body, self.settings.max_samples)
            if device_id in r.losses:
                if r.losses[device_id] != (train_loss, num_samples):
                    raise ApiError(
                        409,
                        f"device {device_id!r} already reported a different loss for round {n}",
                        "duplicate",
                    )
            else:
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
                r.storing.add(device_id)
                try:  # the commit in a worker thread: the event loop serves others meanwhile
                    await asyncio.to_thread(self._add_receipt, receipt)
                except Exception as e:
                    if nospace.out_of_space(e):
                        raise nospace.no_space("the loss report") from None
                    raise
                finally:
                    r.storing.discard(device_id)
                if self.current is not r or r.uploaders is not None:
                    raise ApiError(
                        409,
                        f"round {n}'s uploaders were chosen while the loss report was stored",
                        "stale_round",
                    )
                r.losses[device_id] = (train_loss, num_samples)
                self.telemetry.loss_reports.inc()
                self._notify((device_id,))
                self._poke.set()
        except ValidationError as e:
            self._reject(device_id, n, "loss", e)
            raise
        if wait > 0:
            await self._wait_until(
                device_id,
                lambda: self.current is not r or self._upload_flag(r, device_id) is not None,
                wait,
            )
        return {"upload": self._upload_flag(r, device_id) if self.current is r else None}

    async def receive_update(
        self,
        authorization: str | None,
        n: int,
        headers: Mapping[str, str],
        body: AsyncIterator[bytes],
    ) -> dict:
        """POST /v1/rounds/{n}/update: stream the body to disk, validate it from there, commit
        its receipt, then rename it into place (server.upload_store)."""
        device_id = None
        received: upload_store.Received | None = None
        try:
            device_id = self.authenticate(authorization)
            # A repeat of an upload the round already holds is answered the same way whether or
            # not the round has closed since: a phone whose answer was lost gets its receipt.
            r = self._held(device_id, n)
            if r is None:
                r = self._open_round_for(device_id, n)
                self._check_may_upload(r, device_id)
                if device_id in r.storing:
                    raise ApiError(
                        409,
                        f"device {device_id!r} has an upload for round {n} in progress",
                        "duplicate",
                    )
            existing = r.uploads.get(device_id)
            try:
                validation.check_content_length(headers.get("content-length"), self.upload_limit)
                # the server's memory: not one buffer per upload
                if not await acquire_within(self._receiving, RECEIVE_WAIT):
                    raise _busy()
                try:
                    received = await upload_store.receive(
                        body, self._round_dir(n), f".tmp-{device_id}-", self.upload_limit
                    )
                finally:
                    self._receiving.release()
            except ValidationError as e:
                if e.status == 413 and existing is not None:  # surely not the same bytes
                    raise _different_duplicate(device_id, n) from None
                raise
            if existing is not None:  # a retry: held to the same headers (422), not let through
                declared = _upload_headers(headers, self.settings.max_samples)
                return _same_again(existing, received.sha256, declared, device_id, n)
            await asyncio.to_thread(
                validation.check_update_file, received.path, self.fed.model_config
            )
            num_samples, train_loss = _upload_headers(headers, self.settings.max_samples)
            # The round may have moved on while the body streamed in: check again, then commit.
            r = self._still_open(r, device_id, n)
            existing = r.uploads.get(device_id)
            if existing is not None:  # uploaded meanwhile
                return _same_again(
                    existing, received.sha256, (num_samples, train_loss), device_id, n
                )
            final = self._round_dir(n) / f"{device_id}.safetensors"
            up = Upload(
                secrets.token_hex(16),
                received.sha256,
                received.size,
                str(final),
                num_samples,
                train_loss,
            )
            r.storing.add(device_id)
            try:
                await asyncio.to_thread(self._store, r, device_id, up, received.path)
            finally:
                r.storing.discard(device_id)
            received = None  # renamed into place
            if (
                self.current is not r or self.state != RoundState.OPEN
            ):  # aggregation began meanwhile
                await asyncio.to_thread(self._unstore, up)
                raise ApiError(409, f"round {n} closed while the update was stored", "stale_round")
            r.uploads[device_id] = up
        except ValidationError as e:
            self._reject(device_id, n, "update", e)
            raise
        except Exception as e:
            if not nospace.out_of_space(e):
                raise
            err = nospace.no_space("the update")
            self.telemetry.storage_full.labels(what="update").inc()
            self._reject(device_id, n, "update", err)
            raise err from None
        finally:
            if received is not None:
                received.path.unlink(missing_ok=True)
        self.telemetry.uploads_accepted.inc()
        expected = self._expected(r)
        self.events.publish(
            "update_received",
            round=n,
            attempt=r.attempt,
            device_id=device_id,
            bytes=up.bytes,
            sha256=up.sha256,
            received=len(r.uploads),
            expected=len(expected) if expected is not None else None,
        )
        self._notify((device_id,))
        self._poke.set()
        return up.reply(n)

    def _still_open(self, r: OpenRound, device_id: str, n: int) -> OpenRound:
        if self.current is not r:
            raise ApiError(409, f"round {n} closed while the update was received", "stale_round")
        return self._open_round_for(device_id, n)

    def _store(self, r: OpenRound, device_id: str, up: Upload, tmp: Path) -> None:
        """In a worker thread: commit the receipt, then rename the file into place; if the
        rename fails the receipt is deleted again, so a failure leaves nothing behind (a crash
        between the two leaves a receipt without its file, which a restart drops)."""
        with self.sessions.begin() as db:
            db.add(
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
            self._unstore(up)
            raise

    def _add_receipt(self, receipt: Receipt) -> None:
        with self.sessions.begin() as db:
            db.add(receipt)

    def _unstore(self, up: Upload) -> None:
        """Undo :meth:`_store`: the receipt and the file."""
        with self.sessions.begin() as db:
            db.execute(delete(Receipt).where(Receipt.receipt == up.receipt))
        Path(up.path).unlink(missing_ok=True)

    def _held(self, device_id: str, n: int) -> OpenRound | None:
        """Round `n` when it holds an upload from `device_id` (open or being aggregated)."""
        r = self.current
        if r is not None and r.number == n and device_id in r.uploads:
            return r
        return None

    def _check_may_upload(self, r: OpenRound, device_id: str) -> None:
        flag = self._upload_flag(r, device_id)
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

    def _round_dir(self, n: int) -> Path:
        return self.uploads_dir / f"round_{n:04d}"


def _upload_headers(headers: Mapping[str, str], max_samples: int) -> tuple[int, float]:
    """An upload's X-Fedkey-Num-Samples and X-Fedkey-Train-Loss, or 422 saying what is wrong."""
    num_samples = validation.parse_num_samples(
        headers.get(validation.NUM_SAMPLES_HEADER), max_samples
    )
    return num_samples, validation.parse_train_loss(headers.get(validation.TRAIN_LOSS_HEADER))


def _same_again(
    existing: Upload, sha256: str, declared: tuple[int, float], device_id: str, n: int
) -> dict:
    """A second upload for the round: the first receipt when it is the same upload again (the
    same bytes and the same declared sample count and loss: a retry), else 409."""
    if existing.sha256 == sha256 and (existing.num_samples, existing.train_loss) == declared:
        return existing.reply(n)
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
