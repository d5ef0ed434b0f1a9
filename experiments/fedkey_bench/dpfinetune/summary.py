"""What results.json keeps of a cell's metrics rows (fedkey.federation.metrics_row names them):
the figures of its best-validation round, alone and mixed with the public 3-gram, and what DP
spent; and the base's, round 0 of any run. Pure functions of the rows."""

from __future__ import annotations

import math
from typing import Any

from fedkey_bench.dpfinetune.cells import Cell

#: The figures of a scored round: perplexity, top-1 over every word and keystroke savings, alone
#: and in the keyboard's mixture with the 3-gram (at its weight, chosen on validation), and on
#: the held-out senders who never trained.
SCORES = (
    "val_ppl", "test_ppl", "all_top1", "ksr", "ngram_weight", "mix_val_ppl", "mix_test_ppl",
    "mix_all_top1", "mix_ksr", "unseen_test_ppl", "unseen_all_top1", "unseen_ksr",
)  # fmt: skip


def scores(row: dict[str, Any]) -> dict[str, Any]:
    """A row's SCORES (None where the row has none)."""
    return {k: row.get(k) for k in SCORES}


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of the round the last row names best on validation (round 0, the base, when no
    later round beat it); None before the first row."""
    if not rows:
        return None
    best = rows[-1].get("best_round")
    by_round = {r.get("round"): r for r in rows}
    if best in by_round:
        return by_round[best]
    finite = [r for r in rows if isinstance(r.get("val_ppl"), int | float)
              and math.isfinite(r["val_ppl"])]  # fmt: skip
    return min(finite, key=lambda r: r["val_ppl"], default=rows[-1])


def base(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The base alone and with its 3-gram: round 0's row (None: no row yet)."""
    first = rows[0] if rows else None
    if first is None or first.get("round") != 0:
        return None
    return scores(first)


def _dp(row: dict[str, Any]) -> dict[str, Any]:
    return (row.get("info") or {}).get("dp") or {}


def _clip(row: dict[str, Any]) -> float | None:
    """The round's clip: the DP clip C_t, else the server's bound (the round's median norm)."""
    clip = _dp(row).get("clip")
    return clip if clip is not None else ((row.get("info") or {}).get("clip") or {}).get("norm")


def summarize(rows: list[dict[str, Any]], cell: Cell, rounds: int) -> dict[str, Any]:
    """One cell's record: its best-validation round's SCORES, epsilon and delta after the last
    round (the guarantee covers every round the run released), z, the cohort, the clip."""
    last, best = rows[-1], best_row(rows)
    trained = [r for r in rows if r.get("round", 0) > 0]
    cohort = (last.get("info") or {}).get("num_updates")
    if cohort is None and last.get("uploaded") is not None:
        cohort = len(last["uploaded"])
    return {
        "id": cell.id,
        "label": cell.label,
        "strategy": cell.strategy,
        "target_epsilon": cell.epsilon,
        "rounds": rounds,
        "rounds_done": int(last.get("round", 0)),
        "best_round": None if best is None else best.get("round"),
        **({} if best is None else scores(best)),
        "last_test_ppl": last.get("test_ppl"),
        "epsilon": _finite(last.get("epsilon")),  # z 0: infinite, kept as None
        "delta": last.get("delta"),
        "noise_multiplier": _dp(rows[0]).get("noise_multiplier"),
        "update_noise_multiplier": _dp(last).get("update_noise_multiplier"),
        "cohort": cohort,
        "first_clip": _clip(trained[0]) if trained else None,
        "last_clip": _clip(trained[-1]) if trained else None,
        "test_ppl_curve": [r.get("test_ppl") for r in rows],
    }


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def first_median_norm(rows: list[dict[str, Any]]) -> float | None:
    """The median update norm of a non-private run's first round (its bound's
    ``info.clip.median_norm``): S0 of the DP cells. None before that round (or under DP, whose
    rows never publish it)."""
    for r in rows:
        if r.get("round") == 1:
            value = ((r.get("info") or {}).get("clip") or {}).get("median_norm")
            return float(value) if isinstance(value, int | float) else None
    return None
