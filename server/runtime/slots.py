"""Slots: a semaphore acquired within a time limit (the server's upload and download gates), and
one holder per key at a time (a device's upload)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable, Iterator


async def acquire_within(slots: asyncio.Semaphore, wait: float) -> bool:
    """Acquire one of `slots` within `wait` seconds: True when it is held (release it then)."""
    if not slots.locked():
        return await slots.acquire()  # at once, without a timer
    try:
        async with asyncio.timeout(wait):
            await slots.acquire()
    except TimeoutError:
        return False  # (a slot handed over as the time ran out is passed on to the next waiter)
    return True


class OnePerKey:
    """At most one holder per key at a time: :meth:`hold` raises `refused()` for a second."""

    def __init__(self) -> None:
        self._held: set[Hashable] = set()

    @contextlib.contextmanager
    def hold(self, key: Hashable, refused: Callable[[], Exception]) -> Iterator[None]:
        if key in self._held:
            raise refused()
        self._held.add(key)
        try:
            yield
        finally:
            self._held.discard(key)
