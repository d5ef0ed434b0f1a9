"""GET /v1/model sends the checkpoint in slices (fedkey.server.api.routes_model.ChunkedResponse), so a
slow reader's transport never holds the whole 4.4 MB body: the bytes and Content-Length are those
of the checkpoint, every write at most DOWNLOAD_CHUNK."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import MutableMapping
from typing import Any

import pytest

from fedkey.server.api.routes_model import (
    DEADLINE_SLACK,
    DOWNLOAD_CHUNK,
    TRANSPORT_EXTENSION,
    YIELD_EVERY,
    ChunkedResponse,
)
from fedkey.testing.http import make_settings, running


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
    scope = {
        "type": "http",
        "extensions": {TRANSPORT_EXTENSION: {"abort": lambda: aborted.append(1)}},
    }

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


def slices_sent(sent: list[dict]) -> bytes:
    return b"".join(bytes(m.get("body", b"")) for m in sent[1:])


def test_a_download_whose_reader_is_behind_gives_its_slot_back_until_it_catches_up():
    """The slots bound the downloads that are work for the loop: while the transport says the
    reader is behind (the next send waits for it), the slot is free for another download; the
    download takes one again before its next slice."""
    body = bytes(range(256)) * (DOWNLOAD_CHUNK // 256) * 6  # 6 slices
    behind = {2, 3}  # the reader is behind before slices 2 and 3

    async def scenario() -> tuple[list[dict], list[int], int]:
        slots = asyncio.Semaphore(1)
        sent: list[dict] = []
        free_at: list[int] = []  # the free slots while each message was sent

        def write_paused() -> bool:
            return len(sent) - 1 in behind  # slice i is message i + 1

        async def send(message: MutableMapping[str, Any]) -> None:
            free_at.append(slots._value)
            sent.append(dict(message))

        scope = {
            "type": "http",
            "extensions": {TRANSPORT_EXTENSION: {"write_paused": write_paused}},
        }
        response = ChunkedResponse(body, slots=slots, send_timeout=5.0)
        await asyncio.wait_for(response(scope, receive_nothing, send), 30)
        return sent, free_at, slots._value

    sent, free_at, free = asyncio.run(scenario())
    assert slices_sent(sent) == body
    # the start, slices 0-5, the end: free only while sending the slices the reader was behind
    assert free_at == [0, 0, 0, 1, 1, 0, 0, 0]
    assert free == 1


@pytest.mark.parametrize("held_for", [0.6, 0.0])
def test_a_wait_for_a_slot_is_not_a_stalled_reader_and_the_timeout_still_cuts_one_after_it(
    held_for,
):
    """A download that gave its slot back waits for one, here 3x send_timeout, without being
    cut; once it holds one again (after that wait, or at once), a reader that takes nothing more
    is cut after send_timeout."""
    body = bytes(DOWNLOAD_CHUNK * 8)
    aborted: list[int] = []

    async def scenario() -> tuple[list[dict], float, int]:
        slots = asyncio.Semaphore(1)
        sent: list[dict] = []
        other = asyncio.Event()

        def write_paused() -> bool:
            return len(sent) == 3  # behind before slice 2: its slot goes to `other` meanwhile

        async def hold_the_slot() -> None:
            await other.wait()
            async with slots:
                await asyncio.sleep(held_for)

        async def send(message: MutableMapping[str, Any]) -> None:
            if len(sent) == 3:
                other.set()
                await asyncio.sleep(0)  # the other download takes the slot given back
            if len(sent) == 5:
                await asyncio.sleep(60)  # then the reader takes nothing more
            sent.append(dict(message))

        scope = {
            "type": "http",
            "extensions": {
                TRANSPORT_EXTENSION: {
                    "write_paused": write_paused,
                    "abort": lambda: aborted.append(1),
                }
            },
        }
        holder = asyncio.create_task(hold_the_slot())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        response = ChunkedResponse(body, slots=slots, send_timeout=0.2)
        await asyncio.wait_for(response(scope, receive_nothing, send), 5)
        await holder
        return sent, loop.time() - t0, slots._value

    sent, took, free = asyncio.run(scenario())
    assert len(sent) == 5  # the start and slices 0-3: the wait for the slot was not cut
    assert held_for + 0.2 * (1 - DEADLINE_SLACK) <= took < 4  # the stop after it was, in time
    assert aborted == [1] and free == 1


async def receive_nothing() -> dict:
    return {"type": "http.disconnect"}
