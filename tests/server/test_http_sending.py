"""Model download bodies are sent at most `settings.max_sending` at a time: each body
being sent is a download step ready in every event-loop iteration, and a round's cohort asking for
the model at once made iterations of 0.1-0.3 s. The others wait for a slot before their answer
starts (503 + Retry-After past routes_model.GATE_WAIT); a 304 takes none; a download whose
reader is behind gives its slot to another until it catches up; a reader that takes nothing for
`settings.send_timeout` seconds is cut off, its connection aborted.

A real uvicorn (uvloop, httptools) on loopback: flow control is the transport's. Its listening
socket has a small send buffer, which the connections it accepts inherit, so a reader that stops
reading stalls the server's sends after a few slices rather than after megabytes of kernel
buffers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from fedkey.server.api import routes_model
from fedkey.server.main import build_server
from fedkey.server.settings import Settings
from fedkey.testing.http import make_settings
from fedkey.testing.wait import wait_for

SEND_BUFFER = 16_384  # the server's sockets (the kernel doubles it)
RECEIVE_BUFFER = 4_096  # the stalled reader's


class Records(logging.Handler):
    """The log records of the loggers it is attached to, kept."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Served:
    base: str
    port: int
    server: uvicorn.Server
    settings: Settings
    log: Records
    model: bytes

    @property
    def coordinator(self):
        return self.server.config.app.state.coordinator

    @property
    def slots(self):
        return self.coordinator.sending

    def dropped(self, why: str) -> float:
        return self.coordinator.telemetry.downloads_dropped.labels(why=why)._value.get()

    def connection(self, sock: socket.socket):
        """The server's protocol of the connection of `sock`, None once its transport is lost."""
        peer = sock.getsockname()
        conns = list(self.server.server_state.connections)
        return next((c for c in conns if getattr(c, "client", None) == peer), None)

    def connected(self, sock: socket.socket) -> bool:
        return self.connection(sock) is not None

    def behind(self, sock: socket.socket) -> bool:
        """Whether the server's sends to `sock` wait for it (uvicorn's flow control)."""
        conn = self.connection(sock)
        return conn is not None and conn.flow.write_paused


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """One download slot; the round never opens (5 devices awaited): the model is round 0's,
    about 1 MB (hidden size 64)."""
    settings = make_settings(
        tmp_path_factory.mktemp("sending"), rounds=1, wait_devices=5, hidden_size=64, max_sending=1
    )
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)  # inherited on accept
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    server = build_server(settings, log_level="warning")
    log = Records()
    for name in ("uvicorn", "fedkey"):
        logging.getLogger(name).addHandler(log)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout=120, every=0.1, what="the server did not start")
        model = httpx.get(f"{base}/v1/model", timeout=30)
        assert model.status_code == 200
        # the body outgrows every buffer on the way (the transport's 64 KB, the two sockets')
        assert len(model.content) > 8 * routes_model.DOWNLOAD_CHUNK
        yield Served(base, port, server, settings, log, model.content)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        for name in ("uvicorn", "fedkey"):
            logging.getLogger(name).removeHandler(log)
        listener.close()
    assert not thread.is_alive()


@contextlib.contextmanager
def slot_taken(served: Served) -> Iterator[None]:
    """The one download slot held (as by a download to a fast reader), then given back."""
    loop = served.server.servers[0].get_loop()
    asyncio.run_coroutine_threadsafe(served.slots.acquire(), loop).result(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(served.slots.release)


@pytest.fixture
def free_slot(served: Served) -> Iterator[None]:
    """Each test starts and ends with the slot free and no new error in the server's log."""
    wait_for(lambda: served.slots._value == 1, what="the download slot is still taken")
    before = len(served.log.records)
    yield
    wait_for(lambda: served.slots._value == 1, what="the download slot was never given back")
    errors = [r for r in served.log.records[before:] if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def etag_of(body: bytes) -> str:
    return f'"{hashlib.sha256(body).hexdigest()}"'


@contextlib.contextmanager
def stalled_reader(served: Served) -> Iterator[socket.socket]:
    """A connection that asks for the model and reads nothing (until the test reads it);
    closed on the way out."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)  # before connect
    sock.settimeout(10)
    try:
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(b"GET /v1/model HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: served.behind(sock), what="the server's sends never waited for the reader")
        yield sock
    finally:
        sock.close()


def read_answer(sock: socket.socket) -> tuple[bytes, bytes, bool]:
    """(head, body, ended): the answer read until its Content-Length is complete (ended False) or
    the connection ends (ended True: closed or reset). Bounded: recv blocks at most the socket's
    timeout, and every pass reads at least a byte or ends."""
    data = b""
    for _ in range(100_000):
        try:
            part = sock.recv(1 << 16)
        except ConnectionResetError:
            part = b""
        if not part:
            break
        data += part
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep and len(body) >= content_length(head):
            return head, body, False
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body, True


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise AssertionError(f"no Content-Length in {head!r}")


def download(served: Served, out: dict, **headers: str) -> threading.Thread:
    """GET /v1/model in a thread of its own; its response (or error) lands in out["response"]."""

    def get() -> None:
        try:
            out["response"] = httpx.get(f"{served.base}/v1/model", headers=headers, timeout=60)
        except httpx.HTTPError as e:  # the test's assertion shows it
            out["response"] = e

    thread = threading.Thread(target=get, daemon=True)
    thread.start()
    return thread


def test_a_reader_that_is_behind_gives_its_slot_to_the_next_download(served, free_slot):
    """max_sending=1: while the first reader reads nothing, a second download gets the slot and
    its whole body; the first then reads on and gets its own whole body too."""
    with stalled_reader(served) as first:
        out: dict = {}
        second = download(served, out)
        second.join(60)
        r = out["response"]
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert r.content == served.model and r.headers["etag"] == etag_of(r.content)
        assert int(r.headers["content-length"]) == len(r.content)
        assert served.behind(first)  # answered while the first still read nothing
        head, body, ended = read_answer(first)  # the first reader reads again, to the end
        assert head.startswith(b"HTTP/1.1 200") and not ended
        assert body == served.model and etag_of(body).encode() in head


def test_a_download_waits_for_the_slot_while_another_holds_it(served, free_slot):
    """The slot taken (a download to a fast reader): a download waits, its answer not begun,
    and gets the whole model once the slot is free."""
    out: dict = {}
    with slot_taken(served):
        second = download(served, out)
        wait_for(
            lambda: "response" in out or len(served.slots._waiters or ()) == 1,
            what="the download neither queued nor was answered",
        )
        assert "response" not in out, "answered while the only slot was held"
    second.join(60)
    r = out["response"]
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    assert r.content == served.model


def test_a_reader_that_stops_reading_is_cut_off(served, free_slot, monkeypatch):
    """Past send_timeout without the reader taking anything: the connection is aborted while
    the reader still reads nothing (a close would wait for it), a download meanwhile gets the
    whole model, and the server is as before: /healthz 200, the same model, one warning line and
    no error in its log. (1 s, not less: the other download has it too, and its reader, a thread
    of this process, must not look stalled on a busy machine.)"""
    monkeypatch.setattr(served.settings, "send_timeout", 1.0)
    stalled = served.dropped("stalled")
    before = len(served.log.records)
    with stalled_reader(served) as first:
        out: dict = {}
        second = download(served, out)
        wait_for(lambda: served.dropped("stalled") == stalled + 1, what="the reader was not cut")
        wait_for(lambda: not served.connected(first), what="its connection was not closed")
        second.join(60)
        r = out["response"]
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert r.content == served.model and r.headers["etag"] == etag_of(r.content)
        head, body, ended = read_answer(first)
        assert ended and len(body) < len(served.model)  # what the buffers held, then the end
    health = httpx.get(f"{served.base}/healthz", timeout=10)
    assert health.status_code == 200
    after = httpx.get(f"{served.base}/v1/model", timeout=30)
    assert after.status_code == 200 and after.content == served.model
    lines = [r for r in served.log.records[before:] if r.levelno >= logging.WARNING]
    assert [r.name for r in lines] == ["fedkey.server"], [r.getMessage() for r in lines]
    assert "took nothing for 1 s" in lines[0].getMessage() and lines[0].exc_info is None


def test_a_304_is_answered_while_every_slot_is_taken(served, free_slot):
    with slot_taken(served):
        r = httpx.get(
            f"{served.base}/v1/model", headers={"If-None-Match": etag_of(served.model)}, timeout=10
        )
        assert r.status_code == 304 and r.content == b""
        assert r.headers["etag"] == etag_of(served.model)
        assert served.slots._value == 0  # the slot was still taken meanwhile


def test_a_download_that_finds_no_slot_in_time_is_told_to_come_back(served, free_slot, monkeypatch):
    """Past GATE_WAIT without a slot: 503 + Retry-After (a phone retries it), before any of the
    body; once the slot is free again the download is served."""
    monkeypatch.setattr(routes_model, "GATE_WAIT", 0.5)
    busy = served.dropped("busy")
    with slot_taken(served):
        r = httpx.get(f"{served.base}/v1/model", timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "no model download slot" in r.json()["detail"]  # every error is {"detail": ...}
        assert served.dropped("busy") == busy + 1
    wait_for(lambda: served.slots._value == 1, what="the slot was never given back")
    r = httpx.get(f"{served.base}/v1/model", timeout=30)
    assert r.status_code == 200 and r.content == served.model
