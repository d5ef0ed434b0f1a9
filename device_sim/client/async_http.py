"""A lean asyncio HTTP/1.1 connection (h11 over asyncio streams) for thousands of phones in one
event loop: the Ray fleet's phones (fedkey.device_sim.fleets.async_phone) and `fedkey-bench load`'s fake phones
(fedkey_bench.load_phones) both use it.

Why not httpx's AsyncClient: one client shared by thousands of phones is itself the bottleneck (its
pool and its per-request machinery cost more CPU than the server's answer; bench load measured it),
while a phone needs exactly one keep-alive connection of its own. A `Connection` is a socket, an
h11 state machine and a reader: a few KB, so an idle phone costs little (fedkey_bench.fleet_memory).

Nothing here imports torch: the bench's driver processes stay small.
"""

from __future__ import annotations

import asyncio
import errno
import json
import ssl as ssl_lib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11

READ_SIZE = 1 << 18

__all__ = [
    "READ_SIZE",
    "Connection",
    "HttpError",
    "Reply",
    "os_kind",
    "raise_nofile",
    "split_url",
]


class HttpError(Exception):
    """A request that got no HTTP answer: `kind` names how it failed (connection_dropped,
    connect_refused, read_timeout, ...)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(f"{kind}: {detail}" if detail else kind)


def os_kind(e: OSError, when: str) -> str:
    """An OSError as an error kind: connect_refused, connection_reset, too_many_open_files, ..."""
    names = {
        errno.ECONNREFUSED: "refused",
        errno.ECONNRESET: "reset",
        errno.EPIPE: "broken_pipe",
        errno.EMFILE: "too_many_open_files",
        errno.ENFILE: "too_many_open_files",
        errno.EADDRNOTAVAIL: "no_local_port",
        errno.ETIMEDOUT: "timeout",
    }
    name = names.get(e.errno or 0) or errno.errorcode.get(e.errno or 0, type(e).__name__).lower()
    if name in ("too_many_open_files", "no_local_port"):
        return name
    return f"{when}_{name}"


def split_url(url: str) -> tuple[str, int, str, bool]:
    """A server URL -> (host, port, path prefix, TLS); ValueError saying what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r} (e.g. http://127.0.0.1:8000)")
    tls = parts.scheme == "https"
    return parts.hostname, parts.port or (443 if tls else 80), parts.path.rstrip("/"), tls


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes  # empty when the caller did not keep it
    size: int  # body bytes received

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def detail(self) -> str:
        try:
            data = self.json()
        except ValueError:
            return self.body[:200].decode("utf-8", "replace")
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])[:200]
        return str(data)[:200]


class Connection:
    """One keep-alive HTTP/1.1 connection (h11 over asyncio streams), opened on first use and
    again after the server closes it. `opened` counts the connections it made; `tls`: https."""

    def __init__(
        self, host: str, port: int, connect_timeout: float = 30.0, tls: bool = False
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.conn: h11.Connection | None = None
        self.opened = 0

    async def _open(self) -> None:
        context = ssl_lib.create_default_context() if self.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                self.reader, self.writer = await asyncio.open_connection(
                    self.host, self.port, ssl=context
                )
        except TimeoutError:
            raise HttpError("connect_timeout") from None
        except OSError as e:  # ssl.SSLError is one too
            raise HttpError(os_kind(e, "connect"), str(e)) from None
        self.conn = h11.Connection(h11.CLIENT)
        self.opened += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = self.conn = None

    async def request(
        self,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        timeout: float = 120.0,
        keep: Callable[[dict[str, str]], bool] | None = None,
    ) -> Reply:
        """Send one request and read its reply within `timeout` seconds; `keep(headers)` decides
        whether the body is kept (else only its size is). HttpError when no reply came."""
        c = self.conn
        if c is not None:
            if c.our_state is h11.DONE and c.their_state is h11.DONE:
                c.start_next_cycle()
            elif not (c.our_state is h11.IDLE and c.their_state is h11.IDLE):
                self.close()
        if self.conn is None:
            await self._open()
        try:
            async with asyncio.timeout(timeout):
                return await self._exchange(method, target, list(headers), body, keep)
        except TimeoutError:
            self.close()
            raise HttpError("read_timeout") from None
        except h11.ProtocolError as e:
            self.close()
            raise HttpError("protocol_error", str(e)) from None
        except OSError as e:
            self.close()
            raise HttpError(os_kind(e, "connection"), str(e)) from None
        except BaseException:  # HttpError, a cancelled phone: the connection is in no known state
            self.close()
            raise

    async def _exchange(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        keep: Callable[[dict[str, str]], bool] | None,
    ) -> Reply:
        c, reader, writer = self.conn, self.reader, self.writer
        assert c is not None and reader is not None and writer is not None
        hs = [("Host", f"{self.host}:{self.port}"), *headers]
        if body or method in ("POST", "PUT"):
            hs.append(("Content-Length", str(len(body))))
        writer.write(c.send(h11.Request(method=method, target=target, headers=hs)))
        if body:
            writer.writelines(c.send_with_data_passthrough(h11.Data(data=body)) or [])
        writer.write(c.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        status, reply_headers, chunks, size, keeping = 0, {}, [], 0, True
        while True:
            event = c.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_SIZE)
                if not data and not status:
                    raise HttpError("connection_dropped", "closed before a reply")
                c.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                reply_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                keeping = keep is None or keep(reply_headers)
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if keeping:
                    chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpError("connection_dropped", "closed during the reply")
        if c.our_state is h11.MUST_CLOSE or c.their_state is h11.MUST_CLOSE:
            self.close()
        return Reply(status, reply_headers, b"".join(chunks), size)


def raise_nofile() -> None:
    """The soft limit on open files up to the hard one: a process holds a socket per phone."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
