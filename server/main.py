"""`fedkey server`: the federation server under uvicorn (one worker: the round state is in-process).

    from server.main import serve
    from server.settings import Settings
    serve(Settings(storage="runs/server", enrollment_secret="s3cret", rounds=20))

Ctrl-C (SIGINT/SIGTERM) stops gracefully: long-polls are answered at once, an aggregation in
progress is finished and recorded, then the process exits. With `exit_when_done` the server
also exits by itself once the run is finished.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from server import quiet_gc
from server.app import MAX_JSON_BODY, create_app
from server.settings import Settings


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
        http="h11",  # the limits below are h11's (no httptools in the image)
        ws="websockets-sansio",
        log_level=log_level,
        timeout_graceful_shutdown=30,
        # Limits (Settings, "limits"): an idle keep-alive connection is closed after keep_alive
        # seconds (uvicorn times nothing else: a request in flight, a long-poll or a slow model
        # download, is never cut); past limit_concurrency connections or requests in flight
        # uvicorn answers 503; a request line + headers still unfinished past max_header_bytes
        # (h11's buffer) get a 400 and the connection closed; nothing the server takes over
        # WebSocket is larger than a JSON control body.
        timeout_keep_alive=settings.keep_alive,
        limit_concurrency=settings.limit_concurrency,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        ws_max_size=MAX_JSON_BODY,
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


if __name__ == "__main__":  # python -m server.main, configured by FEDKEY_* variables
    serve()
