"""The global model: GET /v1/model."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter
from starlette.types import Message, Receive, Scope, Send

from fedkey.server.api.deps import AuthorizationDep, CoordinatorDep
from fedkey.server.api.schemas import OVERLOADED, errors
from fedkey.server.runtime.slots import acquire_within

router = APIRouter(tags=["model"])
log = logging.getLogger("fedkey.server")

#: Bytes per write of a model download. uvicorn waits for a connection's transport to drain
#: between writes, so a download holds about this plus the transport's high-water mark (64 KB)
#: in memory. A whole-body Response put all of a slow reader's 4.4 MB (and h11's copy of it) in
#: its transport at once: the round's 1,000 downloads took the server of 10,000 phones from 0.74
#: to 1.3 GB (fedkey-bench load). Under the allocator's mmap threshold, so no mmap per write.
DOWNLOAD_CHUNK = 1 << 16
#: Chunks sent between two yields to the event loop. A fast reader never pauses the transport, so
#: without a yield a whole 4.4 MB download went out in one task step (about 2.5 ms of the loop's
#: CPU); the round's 1,000 downloads, all asked for as it opens, then made event-loop iterations
#: of 0.1-0.3 s in which /healthz waited (fedkey-bench load at 10,000 phones, a trace of the
#: loop's iterations). A yield costs about 11 us: every 8 chunks, 4% more CPU a download.
YIELD_EVERY = 8
#: Seconds a download waits for a slot (settings.max_sending) before it is answered 503 with
#: Retry-After. The wait comes before the answer starts: until then nothing is promised, so the
#: server can still say "busy", and a phone that gave up meanwhile costs only its wait. Waiting
#: after the headers instead would buy nothing: the phones' reply timeout counts the headers and
#: the body alike (60 s, fedkey.device_sim.fleets.async_phone / client; 120 s, fedkey_bench.load_phones), and a phone
#: waiting that long would be timed out mid-answer rather than told to come back. 30 s leaves
#: such a phone half its 60 s for the 4.4 MB; a round's 1,000 downloads at once queue for a few
#: seconds (each is about 3.3 ms of the loop's CPU to a fast reader).
GATE_WAIT = 30.0
#: The Retry-After of that 503: seconds, about the time the loop takes to serve 1,000 downloads.
BUSY_RETRY_AFTER = 5
#: How far the send timeout may run short: a send's deadline is moved only once it is this
#: fraction of send_timeout stale, so a download to a fast reader moves its timer about once,
#: not at every slice (a move is about 3 us, a slice about 46 us). A reader that takes nothing is
#: cut after between 0.9 and 1 times send_timeout.
DEADLINE_SLACK = 0.1
#: The ASGI scope extension through which the server (fedkey.server.main.HeadLimitedHttpTools) shows a
#: response its connection's transport: ``scope["extensions"][TRANSPORT_EXTENSION]``, a dict of
#: ``"abort"`` (abort the connection) and ``"write_paused"`` (whether the reader is behind:
#: uvicorn's flow control holds the next send until the transport's buffer drains). ASGI has
#: neither. An app that returns mid-body only makes uvicorn close the connection (with an error
#: line in its log), and a transport's close waits until its buffer is written, which to a reader
#: that stopped reading is never: the socket would stay open.
TRANSPORT_EXTENSION = "fedkey.transport"


class ChunkedResponse(Response):
    """A bytes body sent in ``DOWNLOAD_CHUNK`` slices (no copies), with its Content-Length,
    yielding to the event loop every ``YIELD_EVERY`` slices.

    With `slots`, the body is sent only while one of them is held (the answer waits up to
    ``GATE_WAIT`` s for it, else 503). A download whose reader is behind gives its slot back
    until the reader has caught up, then waits for one again: the slots bound the downloads that
    are work for the event loop, and a slow reader's is not (32 phones at 1 Mbit/s would
    otherwise hold every slot for 35 s each). With `send_timeout`, a send that waits longer than
    that for the reader cuts the download and aborts the connection. `dropped` counts the 503s
    and the cuts (label why)."""

    def __init__(
        self,
        content: bytes,
        *,
        slots: asyncio.Semaphore | None = None,
        send_timeout: float | None = None,
        dropped: Counter | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self.slots = slots
        self.send_timeout = send_timeout
        self.dropped = dropped

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        slot = None
        if self.slots is not None:
            if not await acquire_within(self.slots, GATE_WAIT):
                self._count("busy")
                await _busy(scope, receive, send)
                return
            paused = scope.get("extensions", {}).get(TRANSPORT_EXTENSION, {}).get("write_paused")
            slot = _Slot(self.slots, paused)
        try:
            if self.send_timeout is None:
                await self._send_all(send, slot)
                return
            idle = asyncio.timeout(None)
            try:
                async with idle:
                    watched = _Watched(send, idle, self.send_timeout)
                    await self._send_all(watched, slot, watched.pause)
            except TimeoutError:
                if not idle.expired():
                    raise
                await self._cut(scope)
        finally:
            if slot is not None:
                slot.give_back()

    async def _send_all(
        self, send: Send, slot: _Slot | None, untimed: Callable[[], None] | None = None
    ) -> None:
        """The answer: its start, the body's slices, the end; before each slice the slot follows
        the reader (_Slot.follow)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        body = memoryview(self.body)
        for i, start in enumerate(range(0, len(body), DOWNLOAD_CHUNK)):
            if slot is not None:
                await slot.follow(untimed)
            chunk = body[start : start + DOWNLOAD_CHUNK]
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # let the loop serve others between two slices
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _cut(self, scope: Scope) -> None:
        """After a send waited send_timeout s: one warning line, and the connection aborted
        (returning mid-body then leaves the server nothing to log or to answer)."""
        self._count("stalled")
        client = scope.get("client")
        log.warning(
            "GET /v1/model to %s: the reader took nothing for %g s; download cut, connection "
            "closed",
            f"{client[0]}:{client[1]}" if client else "a client",
            self.send_timeout,
        )
        abort = scope.get("extensions", {}).get(TRANSPORT_EXTENSION, {}).get("abort")
        if abort is not None:
            abort()
            # The transport's connection_lost is due at once (call_soon): let it run before the
            # app returns, so uvicorn sees a disconnected client, not an answer left unfinished.
            await asyncio.sleep(0)

    def _count(self, why: str) -> None:
        if self.dropped is not None:
            self.dropped.labels(why=why).inc()


class _Slot:
    """One download's slot: held while the download is work for the loop."""

    def __init__(self, slots: asyncio.Semaphore, paused: Callable[[], bool] | None) -> None:
        self.slots = slots
        self.paused = paused  # None (no transport to ask): the slot is held throughout
        self.held = True

    async def follow(self, untimed: Callable[[], None] | None) -> None:
        """Before a slice: give the slot back while the reader is behind (the send waits for it
        and then writes one slice: next to no work), take one again once it has caught up
        (`untimed` first: a wait for a slot is not a reader that stopped)."""
        if self.paused is None:
            return
        if self.paused():
            self.give_back()
        elif not self.held:
            if untimed is not None:
                untimed()
            await self.slots.acquire()
            self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    """503: no slot came free within GATE_WAIT; nothing of the body was promised."""
    busy = JSONResponse(
        {
            "detail": f"no model download slot came free within {GATE_WAIT:g} s: the server is "
            "busy; retry after Retry-After"
        },
        status_code=503,
        headers={"Retry-After": str(BUSY_RETRY_AFTER)},
    )
    await busy(scope, receive, send)


class _Watched:
    """`send`, each call due within `limit` seconds of its start (``DEADLINE_SLACK`` aside) on
    the `idle` timeout, which cancels the sender when it expires."""

    def __init__(self, send: Send, idle: asyncio.Timeout, limit: float) -> None:
        self.send, self.idle, self.limit = send, idle, limit
        self.slack = limit * DEADLINE_SLACK
        self.deadline = -math.inf
        self.loop = asyncio.get_running_loop()

    async def __call__(self, message: Message) -> None:
        now = self.loop.time()
        if now + self.limit - self.deadline > self.slack:
            self.deadline = now + self.limit
            self.idle.reschedule(self.deadline)
        await self.send(message)

    def pause(self) -> None:
        """No deadline until the next send: what comes first is not a wait for the reader."""
        self.deadline = -math.inf
        self.idle.reschedule(None)


MODEL_HEADERS = {
    "ETag": {"description": "the checkpoint's sha256, quoted", "schema": {"type": "string"}},
    "X-Fedkey-Round": {"description": "the round of this model", "schema": {"type": "integer"}},
}


MODEL_ERRORS = errors({401: "with FEDKEY_PRIVATE_MODEL: no device token nor the operator token"})
MODEL_ERRORS[503] = {
    **MODEL_ERRORS[503],
    "description": f"{OVERLOADED}; or no download slot (FEDKEY_MAX_SENDING) came free within "
    f"{GATE_WAIT:g} s",
}


def etag_matches(header: str, sha: str) -> bool:
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') == sha:
            return True
    return False


@router.get(
    "/v1/model",
    response_class=Response,
    responses={
        200: {
            "description": "the global model as a checkpoint file (safetensors; its header "
            "carries the model config and tokenizer)",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "headers": MODEL_HEADERS,
        },
        304: {
            "description": "not modified: If-None-Match holds the ETag",
            "headers": MODEL_HEADERS,
        },
        **MODEL_ERRORS,
    },
    openapi_extra={
        "parameters": [
            {
                "name": "If-None-Match",
                "in": "header",
                "required": False,
                "description": "ETags answered before: 304 when one is the current model's",
                "schema": {"type": "string"},
            }
        ]
    },
)
async def model(request: Request, coordinator: CoordinatorDep, authorization: AuthorizationDep):
    """The global model; ETag = its sha256. With FEDKEY_PRIVATE_MODEL, only for a device's
    token or the operator's."""
    coordinator.check_model_reader(authorization)
    rnd, data, sha = coordinator.model()
    if_none_match = request.headers.get("if-none-match")
    headers = {
        "ETag": f'"{sha}"',
        "X-Fedkey-Round": str(rnd),
        "Cache-Control": "no-cache",
    }
    if if_none_match and etag_matches(if_none_match, sha):
        return Response(status_code=304, headers=headers)
    headers["Content-Disposition"] = f'attachment; filename="round_{rnd:04d}.safetensors"'
    return ChunkedResponse(  # a 304 (above) takes no download slot: it has no body to send
        data,
        slots=coordinator.sending,
        send_timeout=coordinator.settings.send_timeout,
        dropped=coordinator.telemetry.downloads_dropped,
        media_type="application/octet-stream",
        headers=headers,
    )
