"""The server's worker threads, each below the event loop's CPU priority.

On two cores shared with the phones' traffic, /healthz stalled for up to a second while the loop
thread was runnable but waiting for a CPU 37-43% of the time, and barely waited for the GIL
(fedkey-bench load at 1,000 phones, /proc schedstat and wchan: experiments/results/load/
profile-1000-phones.md). Work that can wait a little therefore runs in threads with a higher
Linux nice value than the loop's, so the loop thread wins the CPU when both are runnable:

* the one aggregation thread (``aggregation_executor``), ``AGGREGATION_NICE`` lower, which
  completes rounds itself (settings.aggregate_in "thread") or waits for the aggregation process
  (fedkey.server.aggregator, the default), that process as far below the loop;
* the loop's default executor (``asyncio.to_thread``: upload bodies written and hashed, updates
  validated, receipts and `last_seen` committed), ``IO_NICE`` lower (``io_executor``), less than
  the aggregation's because a request waits on each of these.

A thread's nice value is its own on Linux (setpriority on its thread id) and the threads it
starts (torch's OpenMP team) inherit it. Elsewhere, or when refused, the priority stays as is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

#: How much lower the aggregation thread's CPU priority is than the event loop's (Linux nice).
AGGREGATION_NICE = 10
#: How much lower the default executor's threads run (uploads, validation, database commits).
IO_NICE = 5


def lower_priority(by: int) -> None:
    """Raise the calling thread's nice value by `by` (Linux; a no-op elsewhere or when refused)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)


@functools.cache
def aggregation_executor() -> ThreadPoolExecutor:
    """The one thread that completes rounds (one aggregation at a time per server process)."""
    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="fedkey-aggregate",
        initializer=functools.partial(lower_priority, AGGREGATION_NICE),
    )


def io_executor() -> ThreadPoolExecutor:
    """A new default executor for the server's event loop (ThreadPoolExecutor's default number of
    threads, as asyncio's own), its threads ``IO_NICE`` below the loop. One per loop: a loop
    shuts its default executor down when it closes."""
    return ThreadPoolExecutor(
        thread_name_prefix="fedkey-io",
        initializer=functools.partial(lower_priority, IO_NICE),
    )
