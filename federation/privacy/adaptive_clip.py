"""Adaptive clipping: the DP clip follows a quantile of the update norms, privately.

Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private Learning with Adaptive
Clipping" (NeurIPS), Algorithm 1. ``--dp-clip-quantile q`` turns it on (``--dp-clip S`` is then
the first round's clip); off, the fixed clip S is used unchanged.

The rule
--------
Round t clips every update to ``C_t``, chosen before the round from earlier releases only (so it
is data-independent within the round; C_1 = S). Besides the noised aggregate, the server releases
how many updates the clip left alone, noised:

    b_i = 1[||u_i|| <= C_t]                                   (the whole model's delta norm)
    ~b  = 1/2 + (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / D
    C_{t+1} = C_t exp(-eta_C (~b - q))                        (geometric update, eta_C = 0.2)

with D the cohort size m (fixed-size cohorts and the tree; then ``~b = (sum b_i + N(0,
sigma_b^2)) / m``) or the expected cohort q N (Poisson sampling's fixed denominator, as the
aggregate's). ``~b`` estimates the fraction of updates within the clip, and the update moves C
towards the q-quantile of the norms: it grows while more than q of the updates are unclipped
and shrinks otherwise. ``sigma_b`` (``--dp-clip-count-stddev``) defaults to the paper's
expected cohort / 20. Under ``--bound-scope layer`` the indicator is still the whole model's
norm against C_t (the layers get ``S_l = C_t sqrt(n_l / n)``).

The privacy (derivation)
------------------------
The count's sensitivity s_b: replacing one phone's data (replace-one: fixed-size cohorts, the
tree) flips its b_i, so ``sum (b_i - 1/2)`` moves by ``s_b = 1``; adding or removing a phone
(add/remove-one: Poisson cohorts) adds or drops one ``+-1/2``: ``s_b = 1/2``. The round's two
releases, each divided by its noise's standard deviation, form one Gaussian mechanism of unit
noise whose L2 sensitivity is ``sqrt(z_u^-2 + (s_b / sigma_b)^2)`` (the aggregate's
sensitivity Delta against its noise ``z_u Delta``, the count's s_b against sigma_b); it equals
the ``1 / z`` of a Gaussian of noise multiplier z when

    z_u = (z^-2 - (sigma_b / s_b)^-2)^(-1/2),

Andrew et al.'s Theorem 1 (``(z^-2 - (2 sigma_b)^-2)^(-1/2)``, their add/remove-one with
centered bits, s_b = 1/2). It needs ``sigma_b > s_b z``; a smaller sigma_b is refused. So:

* gaussian (DP-FedAvg): the model gets ``N(0, (z_u Delta)^2)``, and each round (both releases,
  the same sampled cohort) is exactly the sampled Gaussian of multiplier z the accountant
  composes already: epsilon and rho are those of the fixed clip at the same z.
* tree (DP-FTRL, replace-one, s_b = 1): every tree node carries ``z_u max Delta_t``, so the
  nodes cost ``W_T / (2 z_u^2)`` (fedkey.federation.privacy.tree's bound). The counts are not tree-aggregated:
  each round's is a fresh Gaussian of sensitivity 1 against sigma_b, ``1 / (2 sigma_b^2)``-zCDP
  for each round the phone takes part in, at most ``k = ceil(T / b)``; zCDP composes additively
  (adaptively: C_t depends only on earlier releases), so

      rho_T = W_T / (2 z_u^2) + k / (2 sigma_b^2) = W_T / (2 z^2) - (W_T - k) / (2 sigma_b^2),

  at most the tree's ``W_T / (2 z^2)`` without adaptive clipping (``W_T >= k``: the leaves alone
  count k).

With z = 0 there is no guarantee to keep: z_u = 0 and any sigma_b (0 included) is accepted.
Standard library only: fedkey.federation.config checks the options with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: The paper's clip learning rate eta_C (geometric update).
DEFAULT_CLIP_LR = 0.2
#: The paper's count noise: sigma_b = expected cohort size / 20.
COUNT_STDDEV_DIVISOR = 20

__all__ = [
    "COUNT_STDDEV_DIVISOR",
    "DEFAULT_CLIP_LR",
    "AdaptiveClip",
    "count_sensitivity",
    "count_stddev_problem",
    "default_count_stddev",
    "update_noise_multiplier",
]


def count_sensitivity(sampling: str) -> float:
    """s_b: 1/2 under Poisson sampling's add/remove-one adjacency (a centered bit comes or goes),
    1 under replace-one (fixed-size cohorts, the tree: a phone's bit flips)."""
    return 0.5 if sampling == "poisson" else 1.0


def update_noise_multiplier(z: float, count_stddev: float, sensitivity: float) -> float:
    """z_u = (z^-2 - (sigma_b / s_b)^-2)^(-1/2): the aggregate's noise multiplier that makes the
    aggregate and the noised count together cost a Gaussian of multiplier z (0 when z is 0).
    ValueError when sigma_b <= s_b z (:func:`count_stddev_problem`)."""
    if z == 0:
        return 0.0
    problem = count_stddev_problem(z, count_stddev, sensitivity)
    if problem is not None:
        raise ValueError(problem)
    return (z**-2 - (sensitivity / count_stddev) ** 2) ** -0.5


def count_stddev_problem(
    z: float, count_stddev: float, sensitivity: float, expected: float | None = None
) -> str | None:
    """Why the count noise sigma_b cannot give total noise multiplier z (None: it can);
    ``expected``: the expected cohort sigma_b was defaulted from (None: it was given)."""
    if z == 0 or count_stddev > sensitivity * z:
        return None
    adjacency = "add/remove-one" if sensitivity < 1 else "replace-one"
    if expected is None:
        label = f"--dp-clip-count-stddev {count_stddev:g}"
    else:
        label = (
            f"the default --dp-clip-count-stddev (the expected cohort {expected:g} / "
            f"{COUNT_STDDEV_DIVISOR} = {count_stddev:g})"
        )
    return (
        f"{label} is too small for --dp-noise-multiplier {z:g}: the noised count of unclipped "
        f"updates alone would cost more than z allows (sigma_b must exceed {sensitivity:g} x z "
        f"= {sensitivity * z:g} under {adjacency}); give a larger --dp-clip-count-stddev"
    )


def default_count_stddev(expected_cohort: float) -> float:
    """The paper's sigma_b: the expected cohort size / 20."""
    return expected_cohort / COUNT_STDDEV_DIVISOR


class AdaptiveClip:
    """The clip of the next round and its update (Andrew et al. 2021, Algorithm 1).

    ``norm`` is C_t, what round t clips to; :meth:`step` takes the round's update norms, the
    denominator D and one standard normal draw (the engine's, seeded by the run's secret seed
    and the round, so a resumed run draws the same) and moves ``norm`` to C_{t+1}.
    ``count_stddev`` is sigma_b, None until the engine fixes the default from the population.
    """

    def __init__(
        self,
        initial: float,
        quantile: float,
        lr: float = DEFAULT_CLIP_LR,
        count_stddev: float | None = None,
        sensitivity: float = 1.0,
    ) -> None:
        if not 0 < quantile < 1:
            raise ValueError(f"the clip quantile must be in (0, 1), got {quantile}")
        if not lr > 0:
            raise ValueError(f"the clip learning rate must be > 0, got {lr}")
        if not initial > 0:
            raise ValueError(f"the initial clip must be > 0, got {initial}")
        if count_stddev is not None and not count_stddev >= 0:
            raise ValueError(f"the count noise must be >= 0, got {count_stddev}")
        self.norm = float(initial)
        self.quantile = float(quantile)
        self.lr = float(lr)
        self.count_stddev = None if count_stddev is None else float(count_stddev)
        self.sensitivity = float(sensitivity)

    def step(self, norms: Sequence[float], denominator: float, draw: float) -> dict[str, Any]:
        """Release the round's noised unclipped fraction, update the clip; what the row says."""
        if self.count_stddev is None:
            raise RuntimeError("the count noise is not fixed yet")
        if not denominator > 0:
            raise ValueError(f"the count's denominator must be > 0, got {denominator}")
        clip = self.norm
        below = sum(1 for n in norms if n <= clip)
        centered = below - 0.5 * len(norms) + self.count_stddev * draw
        fraction = 0.5 + centered / denominator
        self.norm = clip * math.exp(-self.lr * (fraction - self.quantile))
        return {
            "clip": clip,
            "unclipped_fraction_noisy": fraction,
            "next_clip": self.norm,
            "clip_quantile": self.quantile,
            "count_stddev": self.count_stddev,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "norm": self.norm,
            "quantile": self.quantile,
            "lr": self.lr,
            "count_stddev": self.count_stddev,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore the next round's clip and the run's sigma_b (the quantile and the learning
        rate stay as configured)."""
        self.norm = float(d["norm"])
        stored = d.get("count_stddev")
        self.count_stddev = None if stored is None else float(stored)
