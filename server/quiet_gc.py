"""Python's cyclic garbage collector kept off the event loop's back in the server process.

Measured with a gc.callbacks timer in `fedkey bench load`: at 1,000 phones a full collection of
the server's 350,000-550,000 objects took 0.21-0.36 s every 2-3 s, collected next to nothing, and
ran on whichever thread tripped it, mostly the loop's: /healthz stalled that long. At 10,000
phones the enrolled phones' state (their views, tokens, connections) took it to 1.5 million
objects and 1.0 s a collection.

* :func:`quiet` (once, after start-up): what start-up left alive (torch, the tokenizer, the
  evaluation text) is frozen out of the collector's scans, and young collections run every
  ``GC_THRESHOLD`` allocations instead of 700, so far fewer short-lived request objects are
  caught alive and promoted towards the full collections.
* :func:`freeze_survivors` (as each round opens, the phones enrolled): what is alive then is
  frozen too, so a full collection scans only what came after.

Frozen objects are still freed by reference counting when they die; only a reference cycle that
is already garbage when frozen is never collected (the full collections here found 0-117 such
objects at a time). In-process servers (the tests') leave their interpreter's collector alone:
only :func:`quiet` turns the freezing on.
"""

from __future__ import annotations

import gc

#: The cyclic garbage collector's first threshold in the server process (Python's default 700).
GC_THRESHOLD = 10_000

_quiet = False


def quiet() -> None:
    """Freeze what start-up left alive and raise the young collections' threshold (the server
    process, once the app has started)."""
    global _quiet
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, second, third)
    _quiet = True


def freeze_survivors() -> None:
    """Freeze what is alive now, once :func:`quiet` has run in this process (else nothing)."""
    if _quiet:
        gc.freeze()
