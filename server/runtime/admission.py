"""Admission: at most a budget of new HTTP requests begin their work in one event-loop iteration.

The event loop runs, in one iteration, every callback that became ready while it polled the
sockets. Phones do not arrive evenly: at 10,000 phones the requests of a round's opening (and of
a fake-phone driver's processes each getting the CPU back) came in bursts of 600-960 in one
iteration, each about 0.4 ms of FastAPI's routing, dependencies and handler before its first
await, so one iteration ran 0.1-0.3 s while a /healthz that came with them waited for its end
(a trace of the loop's iterations). The long-poll wake-ups (fedkey.server.devices.WAKE_BATCH)
and the model downloads (settings.max_sending) were already spread; this spreads the rest.

:class:`Admission` is a pure ASGI middleware: a request past the iteration's budget waits, in
arrival order, for a later iteration (a few ms each), which costs it the wait and nothing else.
The ops routes skip the queue (``EXEMPT``): a health probe says whether the loop is free, and a
probe queued behind the burst would measure the queue. WebSocket messages are not requests and
pass as they are.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

#: Paths that never wait for admission: each is one cheap step, and a probe must see the loop.
EXEMPT = frozenset({"/healthz", "/metrics"})


class Admission:
    """At most `per_tick` HTTP requests (``EXEMPT`` aside) enter `app` in one loop iteration; the
    others wait in arrival order and enter `per_tick` an iteration after."""

    def __init__(self, app: ASGIApp, per_tick: int) -> None:
        if per_tick < 1:
            raise ValueError(
                f"admission needs a budget of 1 or more a loop iteration, got {per_tick}"
            )
        self.app = app
        self.per_tick = per_tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._begun = 0  # requests that entered in this iteration
        self._queue: deque[asyncio.Future[None]] = deque()
        self._tick_due = False  # a _tick is scheduled for the next iteration

    @property
    def waiting(self) -> int:
        """Requests waiting for admission now."""
        return sum(not f.done() for f in self._queue)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in EXEMPT:
            await self._admit()
        await self.app(scope, receive, send)

    async def _admit(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests build several): nothing carries over
            self._loop, self._begun, self._queue, self._tick_due = loop, 0, deque(), False
        if self._begun < self.per_tick and not self._queue:
            self._begun += 1
            self._schedule(loop)
            return
        entry: asyncio.Future[None] = loop.create_future()
        self._queue.append(entry)
        self._schedule(loop)
        await entry  # cancelled (the server stopping): _tick skips it

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._tick_due:
            self._tick_due = True
            # call_soon from inside an iteration runs in the next one, after the sockets' poll
            loop.call_soon(self._tick)

    def _tick(self) -> None:
        """A new iteration: a fresh budget, spent first on the oldest waiting requests (they run
        in the iteration after this one, when their tasks wake; new arrivals meanwhile queue)."""
        self._tick_due = False
        self._begun = 0
        queue = self._queue
        while queue and self._begun < self.per_tick:
            entry = queue.popleft()
            if not entry.done():
                entry.set_result(None)
                self._begun += 1
        if queue or self._begun:
            self._schedule(self._loop or asyncio.get_running_loop())
