"""In-process publish/subscribe for the WS /v1/events stream.

Every subscriber has its own bounded queue; when a slow client lets it fill, the oldest event is
dropped (and counted), so publishing never waits on a client. Events are JSON-ready dicts with a
"type" (round_opened, device_enrolled, update_received, update_rejected, round_aggregated,
round_failed, aggregation_postponed, run_finished, model_exported, export_failed) and a unix
"time". Under DP the bus publishes an allow-list (fedkey.federation.metrics_row.DP_EVENTS): the event types
it names, each with its fields alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any


class Subscription:
    def __init__(self, bus: EventBus, maxsize: int):
        self.bus = bus
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=maxsize)
        self.dropped = 0

    def put(self, event: dict[str, Any] | None) -> None:
        while True:
            try:
                self.queue.put_nowait(event)
                return
            except asyncio.QueueFull:
                try:
                    self.queue.get_nowait()
                    self.dropped += 1
                except asyncio.QueueEmpty:  # pragma: no cover - raced to empty
                    pass

    async def get(self) -> dict[str, Any] | None:
        """The next event; None once the bus is closed."""
        return await self.queue.get()

    def drain(self) -> list[dict[str, Any] | None]:
        """The events already waiting, oldest first (none: an empty list), without waiting."""
        out: list[dict[str, Any] | None] = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out

    def close(self) -> None:
        self.bus.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EventBus:
    """Fan-out of events to subscribers. Publish from the event loop's thread."""

    def __init__(
        self, queue_size: int = 256, allow: Mapping[str, frozenset[str]] | None = None
    ) -> None:
        """`allow`: None publishes every event whole; else only the event types it names, each
        with the fields it lists (under DP fedkey.federation.metrics_row.DP_EVENTS, set by the
        coordinator): an allow-list, so a new event or field is private until declared."""
        self.allow = allow
        self.queue_size = queue_size
        self.subscribers: set[Subscription] = set()
        self.closed = False

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self.queue_size)
        if self.closed:
            sub.put(None)
        else:
            self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscribers.discard(sub)

    def publish(self, type_: str, **fields: Any) -> dict[str, Any] | None:
        """Send the event to every subscriber, as the allow-list lets it: the event sent, or
        None when its type is not published."""
        if self.allow is not None:
            allowed = self.allow.get(type_)
            if allowed is None:
                return None
            fields = {k: v for k, v in fields.items() if k in allowed}
        event = {"type": type_, "time": time.time(), **fields}
        for sub in list(self.subscribers):
            sub.put(event)
        return event

    def close(self) -> None:
        """Tell every subscriber the stream is over (they receive None)."""
        self.closed = True
        for sub in list(self.subscribers):
            sub.put(None)
        self.subscribers.clear()
