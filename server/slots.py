"""Slots: a semaphore acquired within a time limit (the server's upload and download gates)."""

from __future__ import annotations

import asyncio


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
