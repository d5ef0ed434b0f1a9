"""Client selection: uniform sampling, AdaFL's attention-based sampling (Chen et al.) and FedMed's topK.

Selectors are small stateful objects owned by a strategy. They are deterministic under the numpy
``Generator`` the engine passes and always return device ids sorted, so a cohort does not depend on
the order of ``available``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from fedkey.federation.strategies.aggregate import model_distance

if TYPE_CHECKING:  # base imports this module; the record is only needed for the annotations
    from fedkey.federation.strategies.base import ClientUpdate

SELECTORS = ("uniform", "adafl")


def round_half_up(x: float) -> int:
    """``round`` with halves going up (Python's ``round`` rounds 2.5 to 2)."""
    return int(math.floor(x + 0.5))


def cohort_size(fraction: float, num_available: int) -> int:
    """``K = max(1, round(fraction * M))``, capped at M (0 when nothing is available)."""
    if num_available <= 0:
        return 0
    return min(num_available, max(1, round_half_up(fraction * num_available)))


def draw_uniform(ids: list[str], k: int, rng: np.random.Generator) -> list[str]:
    """``k`` of ``ids`` uniformly without replacement, sorted (all of them when k >= len(ids))."""
    if k >= len(ids):
        return ids
    picked = rng.choice(len(ids), size=k, replace=False)
    return sorted(ids[i] for i in picked)


def top_k_lowest(losses: Mapping[str, float], beta: float) -> list[str]:
    """FedMed's topK (Wu et al. 2020, eqs. 8-9): of the M reporters, the ``K = max(1, round(beta * M))`` with
    the lowest loss. Ties are broken by device id; a NaN loss ranks last. Returned sorted by id."""
    if not losses:
        return []
    k = cohort_size(beta, len(losses))

    def key(item: tuple[str, float]) -> tuple[float, str]:
        loss = float(item[1])
        return (math.inf if math.isnan(loss) else loss, item[0])

    ranked = sorted(losses.items(), key=key)
    return sorted(dev for dev, _ in ranked[:k])


class UniformSelector:
    """FedAvg's sampling: K = max(1, round(C * M)) of the M available ids, uniformly, without
    replacement (C = 1 selects everyone)."""

    name = "uniform"

    def __init__(self, fraction: float = 0.1) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)

    def setup(self, client_sizes: Mapping[str, int], total_rounds: int) -> None:
        """Nothing to remember."""

    def select(
        self, round_idx: int, available: Iterable[str], rng: np.random.Generator
    ) -> list[str]:
        """Sample the round's cohort from ``available`` with ``rng``."""
        ids = sorted(set(available))
        return draw_uniform(ids, cohort_size(self.fraction, len(ids)), rng)

    @property
    def needs_after_round(self) -> bool:
        return False

    def after_round(
        self, round_idx: int, new_state: Mapping[str, Tensor], updates: Iterable[ClientUpdate]
    ) -> None:
        """Stateless: does not touch ``updates``."""

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        pass


class AdaFLSelector:
    """AdaFL (Chen et al.): attention-based sampling with a dynamic fraction.

    Scores start at ``a_k = n_k / n``. Round t samples ``K = max(1, round(gamma_t * M))`` of the M
    available ids without replacement with probabilities proportional to their scores
    (renormalised over the available ones). After aggregation every client i that uploaded gets
    ``a_i <- alpha a_i + (1 - alpha) (d_i / sum_S d_k) sum_S a_k`` with
    ``d_i = ||theta_{t+1} - theta_i||_2`` over the whole model; the others keep theirs, so the sum
    of the scores is preserved. Selected clients that did not upload count as unselected.

    Dynamic fraction ("fixed steps" in AdaFL): the run is cut into ``gamma_steps`` equal blocks of
    rounds and block j uses ``gamma_start + j (gamma_end - gamma_start) / (gamma_steps - 1)``;
    with the defaults (0.1 -> 0.5 in 5 steps) and 50 rounds that is 0.1 for rounds 0-9, 0.2 for
    10-19, ..., 0.5 for 40-49. ``gamma_start == gamma_end`` gives a constant fraction
    ("Attn.-0.1" in AdaFL).

    Devices enrolling later (``setup`` called again) get ``n_k / n_total`` and the existing scores
    are scaled by ``n_old / n_total`` so the scores still sum to 1. An id never passed to ``setup``
    gets the mean score when first seen.
    """

    name = "adafl"

    def __init__(
        self,
        alpha: float = 0.9,
        gamma_start: float = 0.1,
        gamma_end: float = 0.5,
        gamma_steps: int = 5,
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        for nm, g in (("gamma_start", gamma_start), ("gamma_end", gamma_end)):
            if not 0.0 < g <= 1.0:
                raise ValueError(f"{nm} must be in (0, 1], got {g}")
        if int(gamma_steps) < 1:
            raise ValueError(f"gamma_steps must be >= 1, got {gamma_steps}")
        self.alpha = float(alpha)
        self.gamma_start = float(gamma_start)
        self.gamma_end = float(gamma_end)
        self.gamma_steps = int(gamma_steps)
        self.total_rounds = 0
        self.scores: dict[str, float] = {}
        self.sizes: dict[str, int] = {}
        self.last_selected: list[str] = []

    # ------------------------------------------------------------------ schedule and scores

    def gamma(self, round_idx: int) -> float:
        """The fraction gamma_t used at 0-based round ``round_idx``."""
        if self.gamma_steps == 1 or self.total_rounds <= 0:
            return self.gamma_start
        step = min(self.gamma_steps - 1, max(0, round_idx) * self.gamma_steps // self.total_rounds)
        return self.gamma_start + step * (self.gamma_end - self.gamma_start) / (
            self.gamma_steps - 1
        )

    def setup(self, client_sizes: Mapping[str, int], total_rounds: int) -> None:
        """Initialise (or extend) the scores from the clients' sizes n_k."""
        self.total_rounds = int(total_rounds)
        new = {k: int(v) for k, v in client_sizes.items() if k not in self.scores}
        if not new:
            return
        for k, v in new.items():
            if v < 0:
                raise ValueError(f"client {k!r} has a negative size {v}")
        n_old = sum(self.sizes.get(k, 0) for k in self.scores)
        n_total = n_old + sum(new.values())
        if n_total <= 0:  # no sizes known: uniform
            m = len(self.scores) + len(new)
            self.scores = {k: 1.0 / m for k in [*self.scores, *new]}
        else:
            ratio = n_old / n_total
            self.scores = {k: v * ratio for k, v in self.scores.items()}
            self.scores.update({k: v / n_total for k, v in new.items()})
        self.sizes.update(new)

    def _ensure(self, ids: Iterable[str]) -> None:
        missing = [i for i in ids if i not in self.scores]
        if missing:
            mean = sum(self.scores.values()) / len(self.scores) if self.scores else 1.0
            for i in missing:
                self.scores[i] = mean

    # ------------------------------------------------------------------ selector interface

    def select(
        self, round_idx: int, available: Iterable[str], rng: np.random.Generator
    ) -> list[str]:
        """Sample ``round(gamma_t * M)`` ids by score, without replacement."""
        ids = sorted(set(available))
        if not ids:
            self.last_selected = []
            return []
        self._ensure(ids)
        p = np.array([self.scores[i] for i in ids], dtype=np.float64)
        if not np.all(np.isfinite(p)) or p.sum() <= 0:
            p = np.ones(len(ids))
        p = np.clip(p, 0.0, None)
        k = min(cohort_size(self.gamma(round_idx), len(ids)), int(np.count_nonzero(p)))
        picked = rng.choice(len(ids), size=k, replace=False, p=p / p.sum())
        self.last_selected = sorted(ids[i] for i in picked)
        return list(self.last_selected)

    @property
    def needs_after_round(self) -> bool:
        return True

    def after_round(
        self, round_idx: int, new_state: Mapping[str, Tensor], updates: Iterable[ClientUpdate]
    ) -> None:
        """Score update from the new global model; iterates ``updates`` once."""
        dists: dict[str, float] = {}
        for u in updates:
            dists[u.device_id] = model_distance(new_state, u.state)
        if not dists:
            return
        self._ensure(dists)
        total_d = sum(dists.values())
        if total_d <= 0:  # every client equals the new model: nothing to learn from
            return
        total_a = sum(self.scores[i] for i in dists)
        for i, d in dists.items():
            self.scores[i] = self.alpha * self.scores[i] + (1 - self.alpha) * d / total_d * total_a

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scores": dict(self.scores),
            "sizes": dict(self.sizes),
            "total_rounds": self.total_rounds,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.scores = {str(k): float(v) for k, v in d.get("scores", {}).items()}
        self.sizes = {str(k): int(v) for k, v in d.get("sizes", {}).items()}
        self.total_rounds = int(d.get("total_rounds", self.total_rounds))


def make_selector(
    selector: str,
    fraction: float,
    alpha: float,
    gamma_start: float,
    gamma_end: float,
    gamma_steps: int,
) -> UniformSelector | AdaFLSelector:
    """Build a selector by name (``"uniform"`` or ``"adafl"``)."""
    if selector == "uniform":
        return UniformSelector(fraction)
    if selector == "adafl":
        return AdaFLSelector(alpha, gamma_start, gamma_end, gamma_steps)
    raise ValueError(f"unknown selector {selector!r}; use one of {SELECTORS}")
