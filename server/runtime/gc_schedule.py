"""Python's cyclic garbage collector kept off the event loop's back in the server process.

Measured with a gc.callbacks timer in `fedkey-bench load`. At 1,000 phones a full collection of
the server's 350,000-550,000 objects took 0.21-0.36 s every 2-3 s, collected next to nothing, and
ran on whichever thread tripped it, mostly the loop's: /healthz stalled that long. At 10,000
phones the enrolled phones' state took a full collection to 1.5 million objects and 1.0 s, and
the young generations held 0.5-1 million objects (the 10,000 long-polls in flight, each a request
alive for up to a minute): collections of them took 0.4-0.9 s, and every one collected nothing.

* :func:`quiet` (once, after start-up): what start-up left alive (torch, the tokenizer, the
  evaluation text) is frozen out of the collector's scans, and young collections run every
  ``GC_THRESHOLD`` allocations instead of 700.
* :func:`keep_frozen` (a task of the server's loop): every ``FREEZE_EVERY`` seconds what is alive
  is frozen too (``gc.freeze`` merges lists: it costs nothing), so a collection scans at most the
  objects of the last second, whatever the number of phones.

The price: frozen objects are still freed by reference counting when they die, but a reference
cycle that becomes garbage more than ``FREEZE_EVERY`` seconds after its objects were made is
never collected. Every collection measured here, young and full, found 0-117 objects of cyclic
garbage, and the bench's RSS timeline is what would show a leak. Only the server process
(fedkey.server.main) quiets its collector; an in-process server (the tests') leaves it alone.
"""

from __future__ import annotations

import asyncio
import gc

#: The cyclic garbage collector's first threshold in the server process (Python's default 700).
GC_THRESHOLD = 10_000
#: Seconds between two freezes of what is alive.
FREEZE_EVERY = 1.0


def quiet() -> None:
    """Freeze what start-up left alive and raise the young collections' threshold."""
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, second, third)


async def keep_frozen(every: float = FREEZE_EVERY) -> None:
    """Freeze what is alive every `every` seconds, until cancelled."""
    while True:
        await asyncio.sleep(every)
        gc.freeze()
