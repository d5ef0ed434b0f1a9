"""`fedkey server`: the federation server under uvicorn (one worker: the round state is in-process).

    from fedkey.server.main import serve
    from fedkey.server.settings import Settings
    serve(Settings(storage="runs/server", enrollment_secret="s3cret", rounds=20))

Ctrl-C (SIGINT/SIGTERM) stops gracefully: long-polls are answered at once, an aggregation in
progress is finished and recorded, then the process exits. With `exit_when_done` the server
also exits by itself once the run is finished.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fedkey.server.api.routes_model import TRANSPORT_EXTENSION
from fedkey.server.app import MAX_JSON_BODY, create_app
from fedkey.server.runtime import gc_schedule as quiet_gc
from fedkey.server.settings import Settings


class HeadLimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on a request's head: a request line and headers
    still unfinished past `max_head` bytes get a 400 and the connection is closed (httptools
    itself would keep buffering a header that never ends). The head is counted per data chunk
    once the request has begun, so a chunk that also carries the end of the previous request
    counts whole: an overcount of one chunk at most, never an undercount.

    And a limit on its time: a connection whose first request's head has not ended
    `head_timeout` seconds after it opened, or a kept-alive one whose next request's head has not
    ended that long after its first byte, is closed (uvicorn times neither: a client that opens
    connections and sends nothing, or types its headers a byte at a time, would hold them until
    limit_concurrency turns everyone away).

    Each request's scope also carries ``scope["extensions"][TRANSPORT_EXTENSION]``: the
    transport's ``abort`` (a model download cut for a reader that stopped reading closes its
    socket at once, where a close would wait for ever for the buffer to be read) and
    ``write_paused`` (a download whose reader is behind gives its slot to another meanwhile;
    fedkey.server.api.routes_model.ChunkedResponse)."""

    max_head = 16_384
    head_timeout = 15.0
    _in_head = False
    _head = 0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._time_head()
        flow = self.flow  # the connection's: one extensions dict serves each of its requests
        self._extensions: dict[str, dict[object, object]] = {
            TRANSPORT_EXTENSION: {
                "abort": transport.abort,
                "write_paused": lambda: flow.write_paused,
            }
        }

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head = True, 0
        self.scope["extensions"] = self._extensions
        if self._head_timer is None:  # a kept-alive connection's next request
            self._time_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _time_head(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head += len(data)
            if self._head > self.max_head:
                self.send_400_response(
                    f"the request line and headers are larger than {self.max_head} bytes"
                )


def head_limited(max_head: int, head_timeout: float) -> type[HeadLimitedHttpTools]:
    """The protocol class of one server, with its own limits."""
    limits = {"max_head": max_head, "head_timeout": head_timeout}
    return type("HeadLimitedHttpTools", (HeadLimitedHttpTools,), limits)


class _Server(uvicorn.Server):
    """uvicorn.Server that wakes the coordinator's long-polls when a shutdown begins."""

    coordinator = None
    _freezer: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        quiet_gc.quiet()  # after the app's start-up: its objects are the ones frozen
        self._freezer = asyncio.create_task(quiet_gc.keep_frozen(), name="fedkey-gc-freeze")

    async def shutdown(self, sockets=None) -> None:
        if self._freezer is not None:
            self._freezer.cancel()
        if self.coordinator is not None:
            self.coordinator.begin_shutdown()
        await super().shutdown(sockets=sockets)


def build_server(settings: Settings, log_level: str = "info") -> uvicorn.Server:
    """A configured uvicorn server for `settings` (call `.run()` or `await .serve()`)."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,
        # httptools and uvloop: 26-32% less of the event loop's CPU per request than h11 and
        # asyncio's loop (measured at 10,000 phones); the head limit is ours (above).
        http=head_limited(settings.max_header_bytes, settings.head_timeout),
        loop="uvloop",
        ws="websockets-sansio",
        log_level=log_level,
        timeout_graceful_shutdown=30,
        # Limits (Settings, "limits"): an idle keep-alive connection is closed after keep_alive
        # seconds (uvicorn times nothing else: a request in flight or a long-poll is never cut;
        # a model download is, by the app, once its reader has taken nothing for send_timeout
        # seconds, and a request body once it stalls, fedkey.federation.updates.validation); past limit_concurrency
        # connections or requests in flight uvicorn answers 503; a request line + headers still
        # unfinished past max_header_bytes get a 400 and the connection closed, and a head not
        # done head_timeout seconds after the connection or the request began closes it
        # (HeadLimitedHttpTools); nothing the server takes over WebSocket is larger than a JSON
        # control body.
        timeout_keep_alive=settings.keep_alive,
        limit_concurrency=settings.limit_concurrency,
        ws_max_size=MAX_JSON_BODY,
        # HTTPS with --tls-cert and --tls-key (uvicorn's ssl options); else plain HTTP
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
    )
    server = _Server(config)
    coordinator = app.state.coordinator
    server.coordinator = coordinator

    def finished() -> None:
        # Exit once every device has heard "finished" (or after finish_linger): a phone that
        # finds the server gone instead retries it for minutes. The short first delay lets
        # long-polls and the event stream deliver the news before closing.
        loop = asyncio.get_running_loop()
        end = loop.time() + settings.finish_linger

        def check() -> None:
            if coordinator.everyone_told_finished() or loop.time() >= end:
                server.should_exit = True
            else:
                loop.call_later(0.1, check)

        loop.call_later(0.5, check)

    coordinator.on_finished = finished
    return server


def serve(settings: Settings | None = None, log_level: str = "info") -> None:
    """Run the server until interrupted (or until the run is done with exit_when_done)."""
    settings = settings or Settings()
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO))
    build_server(settings, log_level).run()


if __name__ == "__main__":  # python -m fedkey.server.main, configured by FEDKEY_* variables
    serve()
