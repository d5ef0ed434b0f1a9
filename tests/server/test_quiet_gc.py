"""The server process keeps Python's full garbage collections off the event loop (issue 16):
after start-up its objects are frozen out of the collector's scans and young collections run
every GC_THRESHOLD allocations. Checked in a fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import gc
from server.main import GC_THRESHOLD, quiet_gc

kept = [[i] for i in range(50_000)]  # what start-up leaves alive
assert gc.get_freeze_count() == 0
quiet_gc()
assert gc.get_freeze_count() >= 50_000, gc.get_freeze_count()
assert gc.get_threshold()[0] == GC_THRESHOLD > 700
assert len(gc.get_objects()) < 50_000  # a full collection no longer scans them
print("ok")
"""


def test_after_start_up_the_servers_objects_are_frozen_out_of_the_collector():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
