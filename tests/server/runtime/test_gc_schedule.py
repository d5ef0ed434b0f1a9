"""The server process keeps Python's garbage collections off the event loop: after
start-up, and then every FREEZE_EVERY seconds, the objects alive are frozen out of the
collector's scans, and young collections run every GC_THRESHOLD allocations. Checked in a fresh
interpreter: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROGRAM = """
import asyncio
import gc
from fedkey.server.runtime import gc_schedule as quiet_gc

kept = [[i] for i in range(50_000)]  # what start-up leaves alive
quiet_gc.quiet()
assert gc.get_freeze_count() >= 50_000, gc.get_freeze_count()
assert gc.get_threshold()[0] == quiet_gc.GC_THRESHOLD > 700
assert len(gc.get_objects()) < 50_000  # a collection no longer scans them


async def serving():
    freezer = asyncio.create_task(quiet_gc.keep_frozen(every=0.01))
    polls = [{"long-poll": i} for i in range(30_000)]  # requests in flight meanwhile
    for _ in range(500):  # bounded: until the next freeze took them
        await asyncio.sleep(0.01)
        if len(gc.get_objects()) < 30_000:
            break
    freezer.cancel()
    return polls


polls = asyncio.run(serving())
assert len(gc.get_objects()) < 30_000, len(gc.get_objects())
del kept, polls  # frozen objects are still freed when they die
print("ok")
"""


def test_the_servers_live_objects_are_frozen_out_of_the_collector():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
