"""DP-FTRL's round mechanisms (``--dp-mechanism tree`` or ``blt``): no sampling, the
minimum-separation rule, and noise correlated across rounds on the running sum of the aggregates.

    FTRLMechanism   what the two share: b (the separation), the cohort it allows, the record of
                    the round each phone last trained in, the step ``g_t + (n_t - n_{t-1})``
    TreeMechanism   the tree aggregation's noise and zCDP accountant (fedkey.federation.privacy.tree:
                    Kairouz, McMahan, Song, Thakkar, Thakurta, Xu 2021, "Practical and Private
                    (Deep) Learning without Sampling or Shuffling", Algorithm 1)
    BLTMechanism    the BLT matrix factorization's streaming noise (fedkey.federation.privacy.blt:
                    Dvijotham et al. 2024; McMahan, Xu, Zhang 2024, Algorithm 3)

The derivations (the FTRL model, the accounting under b-separated participation) are in those
modules' docstrings; this one applies them round by round. Under adaptive clipping the noise
and the accountant take z_u and sigma_b (fedkey.federation.privacy.adaptive_clip).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from fedkey.federation.config import FederationConfig
from fedkey.federation.influence.bounding import ClippedRound
from fedkey.federation.privacy import blt as dp_blt
from fedkey.federation.privacy import tree as dp_ftrl
from fedkey.federation.privacy.calibrate import noise_multiplier_of
from fedkey.federation.privacy.clipping import ClipRule
from fedkey.federation.privacy.mechanism import (
    FLOAT32_MARGIN,
    AccountedMechanism,
    StateDict,
    plan_population,
)
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.strategies import ClientUpdate, Strategy
from fedkey.federation.strategies.selection import cohort_size, draw_uniform

if TYPE_CHECKING:
    from fedkey.federation.plan import RoundPlan


def add_residual(state: StateDict, residual: StateDict | None) -> StateDict:
    """``state + residual`` (float64 noise, None: none) on the residual's keys, in each entry's
    own dtype."""
    if residual is None:
        return state
    return {
        k: (v.double() + residual[k].to(v.device)).to(v.dtype) if k in residual else v
        for k, v in state.items()
    }


class FTRLMechanism(AccountedMechanism):
    """DP-FTRL's round: the separation rule and the correlated noise of :attr:`noise` (the
    tree's or the BLT's), accounted in zCDP by :attr:`accountant`."""

    name: ClassVar[str]
    accountant: dp_ftrl.TreeAccountant
    noise: dp_ftrl.TreeNoise | dp_blt.BLTNoise

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret, clip: ClipRule
    ) -> None:
        super().__init__(config, strategy, secret, clip)
        # The round each phone last trained in (the minimum-separation rule): server state.
        self.last_trained: dict[str, int] = {}

    # -- the separation rule -------------------------------------------------------------------

    def observe(self, population: int, check: bool = False) -> None:
        """The accountant sees the population (delta follows the largest); b is fixed by the
        first one (with `check`, a configured b that `population` phones cannot fill a cohort
        under every round is refused)."""
        self.accountant.observe(population)
        self.min_separation(population, check=check)

    def min_separation(self, population: int, check: bool = False) -> int:
        """DP-FTRL's b: the configured one (with `check`, refused when `population` phones
        cannot fill a cohort every round under it), or, left to the default, the largest the
        first population seen allows, fixed for the run (the accountant keeps it)."""
        m = cohort_size(self.strategy.fraction, population)
        b = self.accountant.min_separation
        if b is None:
            b = self.accountant.min_separation = dp_ftrl.default_separation(population, m)
        elif check:
            problem = dp_ftrl.separation_problem(population, m, b)
            if problem is not None:
                raise ValueError(problem)
        self._separation_fixed()
        return b

    def _separation_fixed(self) -> None:
        """What b fixes besides the accounting (nothing here)."""

    def cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str] | None:
        """Round r's cohort: m = the strategy's share of the available phones, drawn uniformly
        (as the uniform selector draws) from those that did not train in the last b - 1 rounds
        (fedkey.federation.privacy.tree.eligible); fewer when fewer are eligible (a server whose
        phones are offline)."""
        b = self.min_separation(len(available))
        ids = dp_ftrl.eligible(available, self.last_trained, r, b)
        return draw_uniform(ids, cohort_size(self.strategy.fraction, len(available)), rng)

    def _record(self, r: int, trained: set[str], b: int) -> None:
        """Round r's phones, for the separation rule; the others' records that b has expired."""
        self.last_trained = {
            d: s for d, s in self.last_trained.items() if d not in trained and r + 1 - s < b
        }
        if b > 1:  # with b = 1 every phone may train every round: nothing to remember
            self.last_trained.update(dict.fromkeys(sorted(trained), r))

    # -- one round -----------------------------------------------------------------------------

    def retune(self) -> None:
        """The noise and the accountant take z_u and sigma_b (adaptive clipping)."""
        z_u = self.clip.noise_multiplier()
        self.noise.noise_multiplier = z_u
        self.accountant.noise_multiplier = z_u
        self.accountant.count_stddev = self.clip.count_stddev

    def add_noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: StateDict,
        bounded: ClippedRound,
        global_state: StateDict,
    ) -> tuple[StateDict, dict | None]:
        """The aggregate's step ``g_t = new_state - theta_{t-1}`` plus ``n_t - n_{t-1}`` (the
        tree's, or the BLT's ``z Delta_t x_t``), so that ``theta_t = theta_0 + (noisy prefix
        sum of the g's)``; the cohort's phones are recorded for the separation rule."""
        bound = bounded.bound
        if bound is None:
            raise RuntimeError("DP needs a bound")
        b = self.min_separation(plan_population(plan, self.strategy))
        sens = self.strategy.sensitivity(global_state, bound, len(bounded))
        # Every node's (every round's) noise is z times at least this.
        new_state = add_residual(new_state, self.noise.release(global_state, sens * FLOAT32_MARGIN))
        self.accountant.step(plan.population)
        r = plan.round
        self._record(r, {*plan.cohort, *(u.device_id for u in updates)}, b)
        return new_state, {
            **self._rule(),
            "sensitivity": sens,
            "noise_std": self.noise.noise_multiplier * sens * FLOAT32_MARGIN,
            "clip": bound.norm,
            "release_noise_std": self.noise.release_std(),
            "max_participations": -(-r // b),
            **self._row_extra(r),
        }

    def _row_extra(self, r: int) -> dict:
        """What round r's row says besides (nothing here)."""
        return {}

    # -- what the rows report ------------------------------------------------------------------

    def start_info(self) -> dict:
        """Round 0's row states the rule too."""
        return self._rule()

    def _rule(self) -> dict:
        """What every DP-FTRL row says of the rule the accounting assumes."""
        return {
            "mechanism": self.config.privacy.mechanism,
            "noise_multiplier": noise_multiplier_of(self.config.privacy),
            "min_separation": self.accountant.min_separation,
        }

    def planned_epsilon(self, rounds: int, population: int) -> float:
        """Epsilon after `rounds` releases, at the delta of `population` phones (b and sigma_b
        fixed by the population seen)."""
        self.min_separation(population)
        return self.accountant.planned_epsilon(rounds, population)

    def would_exceed(self, population: int) -> bool:
        """Whether one more release would pass the budget: b and sigma_b are fixed at the first
        round (a server's phones enroll first); nothing is spent before a population is seen."""
        if self.accountant.delta_for(population) is None:
            return False
        return (
            self.accountant.min_separation is not None
            and self.clip.ready
            and self.accountant.would_exceed(population)
        )

    # -- memory across rounds ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The accountant's and the secret's, and under the mechanism's name its noise's state
        (the rounds' sensitivities) and the separation record."""
        return {
            **super().state_dict(),
            self.name: {**self.noise.state_dict(), "last_trained": dict(self.last_trained)},
        }

    def load_state_dict(self, state: dict) -> None:
        """A run resumes only with the mechanism it was noised with (one line saying so)."""
        super().load_state_dict(state)
        stored = state.get(self.name)
        if stored is None and state.get("accountant"):
            raise ValueError(
                "this run was noised with another mechanism: resume it with the "
                "--dp-mechanism it ran with"
            )
        stored = stored or {}
        self.noise.load_state_dict(stored)
        self.last_trained = {str(d): int(s) for d, s in stored.get("last_trained", {}).items()}


class TreeMechanism(FTRLMechanism):
    """DP-FTRL with the tree aggregation's noise (fedkey.federation.privacy.tree)."""

    name = "tree"
    noise: dp_ftrl.TreeNoise

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret, clip: ClipRule
    ) -> None:
        super().__init__(config, strategy, secret, clip)
        p = config.privacy
        # The nodes' multiplier is z_u under adaptive clipping (retune).
        z = noise_multiplier_of(p)
        self.noise = dp_ftrl.TreeNoise(secret, z)
        self.accountant = dp_ftrl.TreeAccountant(z, p.min_separation, p.delta, p.target_epsilon)

    def _row_extra(self, r: int) -> dict:
        """The tree nodes of round r's release (one per set bit of r)."""
        return {"tree_nodes": len(dp_ftrl.prefix_nodes(r))}


class BLTMechanism(FTRLMechanism):
    """DP-FTRL with the BLT's streaming noise (fedkey.federation.privacy.blt); b and the run's
    length pick its factorization (fedkey.federation.privacy.blt.select_blt)."""

    name = "blt"
    accountant: dp_blt.BLTAccountant
    noise: dp_blt.BLTNoise

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret, clip: ClipRule
    ) -> None:
        super().__init__(config, strategy, secret, clip)
        p = config.privacy
        z = noise_multiplier_of(p)
        self.noise = dp_blt.BLTNoise(secret, z)
        self.accountant = dp_blt.BLTAccountant(
            z, p.min_separation, config.rounds, p.delta, p.target_epsilon
        )

    def _separation_fixed(self) -> None:
        """b fixes the BLT's factorization (the accountant keeps it)."""
        self.noise.blt = self.accountant.blt

    def load_state_dict(self, state: dict) -> None:
        """FTRL's, and the factorization the run was noised with."""
        super().load_state_dict(state)
        if self.accountant.min_separation is not None:
            self._separation_fixed()
