"""The server process keeps Python's full garbage collections off the event loop (issue 16):
after start-up, and again as each round opens, the objects alive are frozen out of the
collector's scans, and young collections run every GC_THRESHOLD allocations. Checked in fresh
interpreters: freezing is process-wide, and an in-process server leaves its interpreter's
collector alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import gc
from server import quiet_gc

kept = [[i] for i in range(50_000)]  # what start-up leaves alive
quiet_gc.freeze_survivors()
assert gc.get_freeze_count() == 0  # not a quiet server process: nothing frozen
quiet_gc.quiet()
assert gc.get_freeze_count() >= 50_000, gc.get_freeze_count()
assert gc.get_threshold()[0] == quiet_gc.GC_THRESHOLD > 700
assert len(gc.get_objects()) < 50_000  # a full collection no longer scans them
enrolled = [{"device": i} for i in range(30_000)]  # the phones' state, before a round opens
quiet_gc.freeze_survivors()
assert len(gc.get_objects()) < 30_000
print("ok")
"""


def test_the_servers_long_lived_objects_are_frozen_out_of_the_collector():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
