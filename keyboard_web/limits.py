"""What one visitor can cost the keyboard, bounded: the WebSockets open at once (MAX_SOCKETS; past
it the handshake is refused), the messages one /ws/suggest connection sends (a token bucket of
RATE a second, BURST at once; past it an error reply and no inference), and the inference itself,
run in a pool of INFER_THREADS threads (onnxruntime runs outside the GIL), so the event loop keeps
answering everyone while the model works and a flood queues behind the pool, not in the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: WebSockets (/ws/suggest and /ws/events together) open at once.
MAX_SOCKETS = 1024
#: Messages a second one /ws/suggest connection may send, and how many at once: a person types
#: a few characters a second.
RATE = 30.0
BURST = 100
#: Threads that run the model for /ws/suggest.
INFER_THREADS = 2


class SocketGate:
    """Counts the open WebSockets; :meth:`enter` is False once `limit` are open."""

    def __init__(self, limit: int = MAX_SOCKETS) -> None:
        self.limit = limit
        self.open = 0

    def enter(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1


class Bucket:
    """A token bucket: `rate` tokens a second, at most `burst` saved."""

    def __init__(self, rate: float = RATE, burst: int = BURST) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Inference:
    """The pool the model runs in."""

    def __init__(self, threads: int = INFER_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fedkey-suggest")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
