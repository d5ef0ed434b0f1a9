"""The gaussian mechanism of DP-FedAvg (``--dp-mechanism gaussian``, the default): each round's
aggregate gets ``N(0, (z Delta)^2)`` and the RDP accountant composes the sampled Gaussian.

McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private Recurrent Language
Models" (ICLR), extended to every strategy: the aggregate's replace-one sensitivity Delta is the
strategy's (fedkey.federation.strategies.sensitivity) for fixed-size cohorts of m of N phones;
under Poisson sampling (``--dp-sampling poisson``) each phone is drawn with probability q and
the aggregate divides by the fixed denominator q N (McMahan et al. 2018's estimator), whose
add/remove-one sensitivity is ``S / (q N)``. The accountant (fedkey.federation.privacy.gaussian
.PrivacyAccountant) composes what the server did each round. Under adaptive clipping the noise
multiplier is z_u and the pair (aggregate, count) costs exactly the accountant's Gaussian of
multiplier z (fedkey.federation.privacy.adaptive_clip, Andrew et al. 2021, Theorem 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedkey.federation.config import FederationConfig
from fedkey.federation.influence.bounding import ClippedRound, scale_deltas
from fedkey.federation.privacy.calibrate import noise_multiplier_of
from fedkey.federation.privacy.clipping import ClipRule
from fedkey.federation.privacy.gaussian import PrivacyAccountant, add_gaussian_noise
from fedkey.federation.privacy.mechanism import (
    FLOAT32_MARGIN,
    AccountedMechanism,
    StateDict,
    plan_population,
)
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.strategies import ClientUpdate, Strategy, sensitivity
from fedkey.federation.strategies.selection import cohort_size

if TYPE_CHECKING:
    from fedkey.federation.plan import RoundPlan


class GaussianMechanism(AccountedMechanism):
    """DP-FedAvg's gaussian mechanism and its RDP accountant (see the module's docstring)."""

    name = "gaussian"
    accountant: PrivacyAccountant

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret, clip: ClipRule
    ) -> None:
        super().__init__(config, strategy, secret, clip)
        p = config.privacy
        self.accountant = PrivacyAccountant(
            noise_multiplier=noise_multiplier_of(p),
            sampling=p.sampling,
            sampling_rate=config.fraction,
            delta=p.delta,
            target_epsilon=p.target_epsilon,
        )

    def observe(self, population: int, check: bool = False) -> None:
        """The accountant sees the population (the default delta, 1 / N^1.1, follows the
        largest)."""
        self.accountant.observe(population)

    def cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str] | None:
        """Under Poisson sampling each phone independently with probability q (= the fraction),
        as the analysis assumes; a fixed-size cohort is the strategy's (None)."""
        if self.config.privacy.sampling != "poisson":
            return None
        q = self.config.fraction
        for _ in range(1000):  # an empty draw, probability (1 - q)^N, is drawn again
            cohort = [
                d for d, x in zip(available, rng.random(len(available)), strict=True) if x < q
            ]
            if cohort:
                return cohort
        raise ValueError(f"Poisson sampling at q={q} of {len(available)} phones drew no one")

    def retune(self) -> None:
        """Nothing to keep: the noise reads z_u from the clip each round, and the accountant
        composes z, what the aggregate and the count cost together (Andrew et al. 2021,
        Theorem 1)."""

    def add_noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: StateDict,
        bounded: ClippedRound,
        global_state: StateDict,
    ) -> tuple[StateDict, dict | None]:
        """``N(0, (z Delta)^2)`` on the aggregate, drawn from the secret's stream for the round
        (fedkey.federation.privacy.secret); the accountant steps."""
        p, m, bound = self.config.privacy, len(bounded), bounded.bound
        if bound is None:  # DP bounds every update (fedkey.federation.influence.bounding)
            raise RuntimeError("DP needs a bound")
        population = plan_population(plan, self.strategy)
        if p.sampling == "poisson":
            # McMahan et al. 2018's fixed denominator: sum_k u_k / (q N), not the mean.
            expected = self.config.fraction * population
            factors = dict.fromkeys(bound.layers, m / expected)  # bound.layers: the floating keys
            new_state = scale_deltas(global_state, new_state, factors)
            sens = sensitivity.poisson_mean_sensitivity(expected, bound.norm)
        else:
            sens = self.strategy.sensitivity(global_state, bound, m)
        std = self.clip.noise_multiplier() * sens * FLOAT32_MARGIN
        unit = self.secret.key().normal_state(new_state, "gaussian", plan.round)
        new_state = add_gaussian_noise(new_state, std, unit)
        self.accountant.step(population, len(plan.cohort))
        return new_state, {
            "mechanism": "gaussian",
            "noise_multiplier": self.accountant.noise_multiplier,
            "sensitivity": sens,
            "noise_std": std,
            "sampling": p.sampling,
            "clip": bound.norm,
        }

    def start_info(self) -> dict:
        return {}

    def planned_epsilon(self, rounds: int, population: int) -> float:
        """Epsilon after `rounds` rounds of the usual cohort of `population` phones (fixed-size:
        the fraction of them; Poisson: at q), at their delta."""
        cohort = cohort_size(self.config.fraction, population)
        return self.accountant.planned_epsilon(rounds, population, cohort)

    def would_exceed(self, population: int) -> bool:
        """Whether one more round of the usual cohort of `population` phones would take epsilon
        past the budget (nothing is spent before a population is seen)."""
        if self.accountant.delta_for(population) is None:
            return False
        cohort = cohort_size(self.config.fraction, population)
        return self.accountant.would_exceed(population, cohort)
