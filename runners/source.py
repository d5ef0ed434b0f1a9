"""Which code a run ran: git, asked from where this code lives (a run's provenance)."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The checkout this code lives in (git answers nothing outside one).
SOURCE = Path(__file__).resolve().parents[1]


def git(*args: str, tree: Path = SOURCE) -> str | None:
    """`git ARGS` run in `tree` (this code's checkout by default): its output, stripped; None
    outside a checkout or without git."""
    try:
        done = subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()
