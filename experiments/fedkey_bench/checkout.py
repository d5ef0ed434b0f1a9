"""The fedkey checkout the harness runs from.

The harness starts `python -m fedkey ...` in the checkout and reads ../shared/data beside it, so it
runs from a checkout, never from an installed wheel. The throwaway PostgreSQL cluster and the
headless Chromium that fedkey's tests use serve the benchmarks too: fedkey.testing (tests/support
in the checkout).
"""

from __future__ import annotations

from pathlib import Path

ROOT = (
    Path(__file__).resolve().parents[2]
)  # the fedkey checkout (this is experiments/fedkey_bench/)
#: The committed results, one folder per benchmark: the default --out wherever the bench runs from.
RESULTS = ROOT / "experiments" / "results"

__all__ = ["RESULTS", "ROOT"]
