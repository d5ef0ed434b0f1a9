"""A per-client token bucket: how often one address may try to enroll (docs/how-to/http-federation.md; the generated HTTP API reference).

    limiter = RateLimiter(rate=200.0, burst=10_000)
    wait = limiter.take("203.0.113.7")  # 0.0: go ahead; else the seconds until a token is back

Each key (a client IP) has a bucket of `burst` tokens that refills at `rate` tokens a second; a
request takes one token or, with none left, is refused with the time until the next. In-process
and single-threaded (the server is one asyncio worker). A full bucket is the same as no bucket,
so the table forgets those first; it never holds more than `max_keys` addresses: when it would,
the full buckets go, then the least recently seen until a tenth of the room is free (so the sweep
is paid once per max_keys/10 new addresses; a forgotten address gets a full bucket again).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RateLimiter"]


class RateLimiter:
    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("a rate limiter needs rate > 0, burst >= 1 and max_keys >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        # key -> (tokens left, when they were counted); least recently seen first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> float:
        """Take a token for `key`: 0.0 when there was one, else the seconds until there is."""
        now = self.clock()
        tokens, then = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - then) * self.rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_keys:
            self._forget(now)
        return wait

    def __len__(self) -> int:
        return len(self._buckets)

    def _forget(self, now: float) -> None:
        full = [
            k
            for k, (t, then) in self._buckets.items()
            if t + (now - then) * self.rate >= self.burst
        ]
        for k in full:
            del self._buckets[k]
        keep = self.max_keys - max(1, self.max_keys // 10)
        while len(self._buckets) > keep:
            self._buckets.popitem(last=False)
