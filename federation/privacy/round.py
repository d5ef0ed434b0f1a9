"""A round's differential privacy: the one object the round engine (fedkey.federation.engine) composes for it.

    RoundPrivacy(config, strategy)  the run's noise mechanism and clip rule, from its config
    observe(population)             what the population fixes: delta, DP-FTRL's b, sigma_b
    selection_rng(round, attempt)   under DP the secret's generator for the round's cohort
    cohort(round, available, rng)   the cohort the analysis assumes (tree, Poisson), or None
    clip_norm()                     the round's clip: C_t (adaptive) or S
    noise(plan, ...)                noise the aggregate, account for it, step the adaptive clip
    start_info(), row_fields()      what round 0's row and every row report of it
    would_exceed(population)        the budget stop
    state_dict(), load_state_dict() the server state's "accountant", "tree" or "blt", and "clip"

It composes two objects chosen once, at construction:

* the noise mechanism (fedkey.federation.privacy.mechanism.NoiseMechanism), :data:`MECHANISMS`'
  class for ``--dp-mechanism``: fedkey.federation.privacy.dp_fedavg.GaussianMechanism (the
  gaussian mechanism and its RDP accountant, fedkey.federation.privacy.gaussian),
  fedkey.federation.privacy.ftrl.TreeMechanism (DP-FTRL's tree aggregation, Kairouz et al. 2021)
  or fedkey.federation.privacy.ftrl.BLTMechanism (DP-FTRL's BLT matrix factorization, Dvijotham
  et al. 2024); without DP (no --dp-clip) fedkey.federation.privacy.mechanism.NoPrivacy, whose
  every call is a no-op: the engine calls this object the same way either way;
* the clip rule (fedkey.federation.privacy.clipping): the fixed clip, or adaptive clipping
  (Andrew et al. 2021, Algorithm 1; fedkey.federation.privacy.adaptive_clip), which steps after
  each round's noise and, once its count noise sigma_b is fixed, gives the mechanism z_u.

The noise and, where the analysis samples, the cohorts are drawn from the server's secret
(fedkey.federation.privacy.secret: 256 bits from the operating system, kept in
RUN_DIR/secret.key), never from the run's seed, which phones are told; keyed by round, so a
resumed run draws the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedkey.federation.config import DPMechanism, FederationConfig, dp_problem
from fedkey.federation.influence.bounding import BoundedRound
from fedkey.federation.privacy.clipping import AdaptiveClipping, ClipRule, FixedClip
from fedkey.federation.privacy.dp_fedavg import GaussianMechanism
from fedkey.federation.privacy.ftrl import BLTMechanism, TreeMechanism
from fedkey.federation.privacy.mechanism import (
    Accountant,
    AccountedMechanism,
    NoiseMechanism,
    NoPrivacy,
    StateDict,
    plan_population,
)
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.strategies import ClientUpdate, Strategy

if TYPE_CHECKING:
    from fedkey.federation.plan import RoundPlan

#: --dp-mechanism's choices (fedkey.federation.config.DPMechanism) and the class of each.
MECHANISMS: dict[DPMechanism, type[AccountedMechanism]] = {
    "gaussian": GaussianMechanism,
    "tree": TreeMechanism,
    "blt": BLTMechanism,
}


def make_clip(config: FederationConfig, secret: RunSecret) -> ClipRule:
    """Adaptive clipping under DP with --dp-clip-quantile, else the fixed clip."""
    p = config.privacy
    if p.dp and p.clip_quantile is not None:
        return AdaptiveClipping(config, secret)
    return FixedClip(config)


def make_mechanism(
    config: FederationConfig, strategy: Strategy, secret: RunSecret, clip: ClipRule
) -> NoiseMechanism:
    """The run's noise mechanism: --dp-mechanism's class under DP, else :class:`NoPrivacy`."""
    if not config.privacy.dp:
        return NoPrivacy()
    return MECHANISMS[config.privacy.mechanism](config, strategy, secret, clip)


class RoundPrivacy:
    """The DP state of a run and what each round does with it (see the module's docstring)."""

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret | None = None
    ) -> None:
        """Refuses, in one line, a federation that cannot run with a DP guarantee
        (fedkey.federation.config.dp_problem). `strategy` is the run's, set up: its fraction, population
        and sensitivity are DP's too. `secret`: where the noise comes from (the run directory's;
        None: one of this process alone, or the configured --dp-secret)."""
        self.config = config
        self.strategy = strategy
        self.secret = secret or RunSecret(passphrase=config.privacy.secret)
        problem = dp_problem(
            config.strategy, config.privacy, config.influence, config.strategy_params
        )
        if problem is not None:
            raise ValueError(problem)
        self.clip = make_clip(config, self.secret)
        self.mechanism = make_mechanism(config, strategy, self.secret, self.clip)
        self._retune()

    @property
    def accountant(self) -> Accountant | None:
        """The mechanism's accountant (None without DP)."""
        return self.mechanism.accountant

    def _retune(self) -> None:
        """Once adaptive clipping's sigma_b is fixed the mechanism's noise is z_u (a fixed clip:
        z stands)."""
        if self.clip.count_stddev is not None:
            self.mechanism.retune()

    # -- what a DP run fixes once it knows its population ------------------------------------

    def observe(self, population: int, check: bool = False) -> None:
        """The accountant sees the population (the default delta, 1 / N^1.1, follows the
        largest); DP-FTRL's b and adaptive clipping's default sigma_b (the expected cohort /
        20, refused in one line when too small for z) are fixed by the first one seen. With
        `check` (a population known from the start), a configured b that `population` phones
        cannot fill a cohort under every round is refused."""
        if self.mechanism.accountant is None or population <= 0:
            return
        self.mechanism.observe(population, check=check)
        if self.clip.observe(population):
            self._retune()

    # -- the cohort the analysis assumes -------------------------------------------------------

    def selection_rng(self, r: int, attempt: int = 0) -> np.random.Generator | None:
        """Under DP, the generator of round r's cohort (its `attempt`-th draw), keyed by the
        secret: the accountant's amplification by sampling assumes nobody can predict who is
        drawn. None without DP (the run's seed then draws it, reproducibly)."""
        return self.mechanism.selection_rng(r, attempt)

    def cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str] | None:
        """Round r's cohort from the sorted `available` phones where DP's analysis decides how it
        is drawn: the tree's separation rule, or Poisson sampling; None where the strategy
        selects it (no DP, or fixed-size sampling)."""
        return self.mechanism.cohort(r, available, rng)

    # -- one round -----------------------------------------------------------------------------

    def clip_norm(self) -> float | None:
        """The round's clip: adaptive clipping's C_t, else the configured S (None without DP)."""
        return self.clip.norm

    def noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: StateDict,
        bounded: BoundedRound,
        global_state: StateDict,
    ) -> tuple[StateDict, dict | None]:
        """The aggregate `new_state` of the round's `bounded` updates with DP's noise added and
        accounted for (from `global_state`, the model before the round), and the row's
        ``info.dp``; under adaptive clipping the clip steps to C_{t+1}. Without DP: `new_state`
        as it is, and None."""
        new_state, dp = self.mechanism.add_noise(plan, updates, new_state, bounded, global_state)
        if dp is not None:
            dp.update(self.clip.step(plan.round, bounded, plan_population(plan, self.strategy)))
        return new_state, dp

    # -- what the rows report ------------------------------------------------------------------

    def start_info(self) -> dict:
        """Round 0's ``info``: under DP-FTRL its rule, under adaptive clipping the first
        round's clip; {} otherwise."""
        dp = {**self.mechanism.start_info(), **self.clip.start_info()}
        return {"dp": dp} if dp else {}

    def row_fields(self) -> dict:
        """Every metrics row's epsilon, rho, delta and noise_reproducible (fedkey.federation.metrics_row):
        None without DP."""
        return self.mechanism.row_fields()

    def would_exceed(self, population: int) -> bool:
        """True when one more DP round (of the usual cohort of `population` phones) would take
        epsilon past the budget; False without DP or a budget."""
        return self.mechanism.would_exceed(population)

    # -- memory across rounds, for a restarted server ------------------------------------------

    def state_dict(self) -> dict:
        """The server state's DP part (JSON-serializable): "accountant" (None without DP), and
        "tree" or "blt" (DP-FTRL: the rounds' sensitivities, the separation rule) and "clip"
        (adaptive clipping: the next round's clip, sigma_b) where they apply; under DP "secret",
        the secret's fingerprint (fedkey.federation.privacy.secret), so that a resume with another is refused."""
        return {**self.mechanism.state_dict(), **self.clip.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Adopt the DP part of a server state (the whole of it may be passed); a run resumes
        only with the mechanism, the clip and the secret it was noised with (one line saying
        which)."""
        self.mechanism.load_state_dict(state)
        self.clip.load_state_dict(state)
        self._retune()
