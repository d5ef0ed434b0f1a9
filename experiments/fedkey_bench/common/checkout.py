"""The fedkey checkout the harness runs from, and how its pages show a machine's paths.

The harness starts `python -m fedkey ...` in the checkout and reads ../shared/data beside it, so it
runs from a checkout, never from an installed wheel. The throwaway PostgreSQL cluster and the
headless Chromium that fedkey's tests use serve the benchmarks too: fedkey.testing (tests/support
in the checkout).
"""

from __future__ import annotations

import re
from pathlib import Path

#: The fedkey checkout (this file is experiments/fedkey_bench/common/checkout.py).
ROOT = Path(__file__).resolve().parents[3]
#: The committed results, one folder per benchmark: the default --out wherever the bench runs from.
RESULTS = ROOT / "experiments" / "results"
#: The datasets' folder beside the checkout, as a command from the checkout names it.
DATA = "../shared/data"

#: An absolute path in a command line: a "/" that starts a word, then the path's characters.
_ABSOLUTE = re.compile(r"(?<![\w.:/~-])/[\w.+@-]+(?:/[\w.+@-]+)*/?")
_DATA = re.compile(r"^.*?/shared/data/?")

__all__ = ["DATA", "RESULTS", "ROOT", "shown", "shown_path"]


def shown_path(path: str) -> str:
    """A recorded path as a page shows it, without the machine it ran on: a dataset by its name
    in the data folder (`ptb`), the data folder as `../shared/data`, a path in a checkout relative
    to it, any other absolute path by its last part (a work folder, a baseline worktree)."""
    if not path.startswith("/"):
        return path
    data = _DATA.match(path)
    if data:
        return path[data.end() :].rstrip("/") or DATA
    if path.startswith(f"{ROOT}/"):
        return path[len(f"{ROOT}/") :]
    for marker in ("/experiments/", "/runs/"):  # another machine's checkout
        if marker in path:
            return path[path.index(marker) + 1 :]
    return Path(path).name or path


def shown(command: str) -> str:
    """A recorded command line with every absolute path in it shown as :func:`shown_path` does."""
    return _ABSOLUTE.sub(lambda m: shown_path(m.group(0)), command)
