"""How the privacy pages write their figures."""

from __future__ import annotations

import math


def fixed(x, digits: int = 2) -> str:
    """A figure to `digits` decimals; '-' for none, 'inf' for an unbounded epsilon."""
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def ppl(x) -> str:
    """A perplexity: one decimal, or 3 significant digits past a million (a diverged model)."""
    if x is None:
        return "-"
    return f"{x:.3g}" if x >= 1e6 else f"{x:.1f}"


def general(x, digits: int = 3) -> str:
    """A figure to `digits` significant digits; '-' for none."""
    return "-" if x is None else f"{x:.{digits}g}"
