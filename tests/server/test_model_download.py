"""GET /v1/model sends the checkpoint in slices (server.api.routes_model.ChunkedResponse), so a
slow reader's transport never holds the whole 4.4 MB body: the bytes and Content-Length are those
of the checkpoint, every write at most DOWNLOAD_CHUNK."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import MutableMapping
from typing import Any

from server.api.routes_model import (
    ABORT_EXTENSION,
    DEADLINE_SLACK,
    DOWNLOAD_CHUNK,
    YIELD_EVERY,
    ChunkedResponse,
)
from tests.support.http import make_settings, running


def test_a_body_goes_out_in_slices_with_its_content_length():
    body = bytes(range(256)) * (DOWNLOAD_CHUNK // 64 + 3)  # 4 full slices and a partial one
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    response = ChunkedResponse(body, media_type="application/octet-stream")
    asyncio.run(response({"type": "http"}, receive, send))
    start, *parts = sent
    assert dict(start["headers"])[b"content-length"] == str(len(body)).encode()
    chunks = [bytes(m["body"]) for m in parts]
    assert b"".join(chunks) == body
    assert [len(c) for c in chunks] == [DOWNLOAD_CHUNK] * 4 + [len(body) - 4 * DOWNLOAD_CHUNK, 0]
    assert [m["more_body"] for m in parts] == [True] * 5 + [False]


def test_a_download_to_a_fast_reader_lets_the_loop_serve_others_between_slices():
    """A reader that never pauses the transport (send never suspends): the other tasks of the
    loop still run every YIELD_EVERY slices, not only after the whole body."""
    body = bytes(DOWNLOAD_CHUNK * YIELD_EVERY * 4)
    ticks = 0
    seen: list[int] = []  # the other task's ticks at each slice sent

    async def send(message: MutableMapping[str, Any]) -> None:
        seen.append(ticks)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def other() -> None:
        nonlocal ticks
        for _ in range(1000):  # bounded: one tick per loop iteration
            ticks += 1
            await asyncio.sleep(0)

    async def scenario() -> None:
        task = asyncio.create_task(other())
        await ChunkedResponse(body)({"type": "http"}, receive, send)
        task.cancel()

    asyncio.run(scenario())
    slices = seen[1:-1]  # between the start and the end of the body
    assert len(slices) == 4 * YIELD_EVERY
    assert slices[-1] - slices[0] >= 3  # the other task ran while the body went out
    assert all(b - a <= 1 for a, b in zip(slices, slices[1:], strict=False))


def test_the_download_is_the_checkpoint_its_etag_names(tmp_path):
    with running(make_settings(tmp_path, rounds=1)) as client:
        r = client.get("/v1/model")
        assert r.status_code == 200
        assert int(r.headers["content-length"]) == len(r.content) > DOWNLOAD_CHUNK
        assert r.headers["etag"] == f'"{hashlib.sha256(r.content).hexdigest()}"'
        again = client.get("/v1/model", headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and again.content == b""


def test_the_send_timeout_is_for_each_send_not_the_whole_body():
    """A reader slower than send_timeout over the whole body but quick at each slice gets it all;
    one that stops taking slices is cut: the send is cancelled after about send_timeout, the
    server's abort hook is called, and the download slot is given back."""
    body = bytes(DOWNLOAD_CHUNK * 12)
    aborted: list[bool] = []
    scope = {"type": "http", "extensions": {ABORT_EXTENSION: {"abort": lambda: aborted.append(1)}}}

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def scenario(stall_at: int | None) -> tuple[list[dict], float, int]:
        slots = asyncio.Semaphore(1)
        sent: list[dict] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            if len(sent) == stall_at:
                await asyncio.sleep(60)  # a reader that takes nothing more
            await asyncio.sleep(0.03)  # a slow reader: 12 slices take 0.36 s
            sent.append(dict(message))

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        response = ChunkedResponse(body, slots=slots, send_timeout=0.2)
        await asyncio.wait_for(response(scope, receive, send), 30)
        return sent, loop.time() - t0, slots._value

    sent, took, free = asyncio.run(scenario(None))
    assert (
        b"".join(bytes(m.get("body", b"")) for m in sent[1:]) == body
        and sent[-1]["more_body"] is False
    )
    assert took > 0.2 and free == 1 and not aborted
    sent, took, free = asyncio.run(scenario(5))  # the start and 4 slices, then nothing
    assert len(sent) == 5 and 0.2 * (1 - DEADLINE_SLACK) <= took - 5 * 0.03 < 5
    assert free == 1 and aborted == [1]
