"""The fedkey checkout the harness runs from, and the test helpers it shares with fedkey's tests.

The harness starts `python -m cli ...` in the checkout and reads ../shared/data beside it, so it
runs from a checkout, never from an installed wheel. The throwaway PostgreSQL cluster and the
headless Chromium that fedkey's tests use (tests/support/) serve the benchmarks too; they are
loaded by their path, since the checkout's tests are no installed package and, under pytest, the
name `tests` is experiments/tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the fedkey checkout (this is experiments/bench/)
#: The committed results, one folder per benchmark: the default --out wherever the bench runs from.
RESULTS = ROOT / "experiments" / "results"

__all__ = ["RESULTS", "ROOT", "test_support"]


def test_support(name: str) -> ModuleType:
    """tests/support/NAME.py of the checkout, loaded once by its path (FileNotFoundError, in one
    line, outside a checkout)."""
    path = ROOT / "tests" / "support" / f"{name}.py"
    key = f"fedkey_tests_support_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"{path} not found: the benchmarks run from a fedkey checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
