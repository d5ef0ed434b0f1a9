"""A round's differential privacy: the one object the round engine (fedkey.federation.engine) composes for it.

    RoundPrivacy(config, strategy)  the run's noise mechanism and clip rule, from its config
    observe(population)             what the population fixes: delta, DP-FTRL's b, sigma_b; a
                                    target epsilon without z: z (calibration)
    selection_rng(round, attempt)   under DP the secret's generator for the round's cohort
    cohort(round, available, rng)   the cohort the analysis assumes (tree, Poisson), or None
    clip_norm()                     the round's clip: C_t (adaptive) or S
    noise(plan, ...)                noise the aggregate, account for it, step the adaptive clip
    start_info(), row_fields()      what round 0's row and every row report of it
    would_exceed(population)        the budget stop
    planned_epsilon(rounds, N)      epsilon after the planned rounds (the budget's calibration)
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

With ``--dp-target-epsilon`` and no ``--dp-noise-multiplier`` the first population seen also
fixes z, the smallest that ends the planned rounds within the target
(fedkey.federation.privacy.calibrate), before any round: the clip rule and the mechanism are
then made again at that z, and :attr:`calibration` records it (the server state's
"calibration", so that a resumed run keeps it).

The noise and, where the analysis samples, the cohorts are drawn from the server's secret
(fedkey.federation.privacy.secret: 256 bits from the operating system, kept in
RUN_DIR/secret.key), never from the run's seed, which phones are told; keyed by round, so a
resumed run draws the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedkey.federation.config import DPMechanism, FederationConfig, dp_problem
from fedkey.federation.influence.bounding import ClippedRound
from fedkey.federation.privacy import calibrate as calibration
from fedkey.federation.privacy.calibrate import Calibration
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
        self.strategy = strategy
        self.secret = secret or RunSecret(passphrase=config.privacy.secret)
        problem = dp_problem(
            config.strategy,
            config.privacy,
            config.influence,
            config.strategy_params,
            config.checkpoint_every,
        )
        if problem is not None:
            raise ValueError(problem)
        #: Whether z is calibrated (a target epsilon under DP, no z given), at the first population
        self.calibrates = calibration.needs_calibration(config.privacy)
        self.calibration: Calibration | None = None
        self._pending = self.calibrates
        self._build(calibration.resolved(config))  # a pending z holds the default until then

    def _build(self, config: FederationConfig) -> None:
        """The clip rule and the mechanism of `config` (its z given)."""
        self.config = config
        self.clip = make_clip(config, self.secret)
        self.mechanism = make_mechanism(config, self.strategy, self.secret, self.clip)
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
        if self._pending:
            self._calibrate(population)
        self.mechanism.observe(population, check=check)
        if self.clip.observe(population):
            self._retune()

    # -- the budget's calibration ----------------------------------------------------------------

    def _calibrate(self, population: int) -> None:
        """z for the target over the planned rounds, from trials of this run that have seen
        `population` phones (fedkey.federation.privacy.calibrate); the run is made again at it."""

        def trial(config: FederationConfig) -> RoundPrivacy:
            run = RoundPrivacy(config, self.strategy, self.secret)
            run.observe(population)
            return run

        accountant = self.mechanism.accountant
        delta = None if accountant is None else accountant.delta_for(population)
        self._adopt(calibration.calibrate(self.config, population, trial, delta))

    def _adopt(self, calibrated: Calibration) -> None:
        """Run at the calibrated z from now on."""
        z = calibrated.noise_multiplier
        if self.config.privacy.noise_multiplier != z:
            self._build(calibration.with_noise_multiplier(self.config, z))
        self.calibration, self._pending = calibrated, False

    def planned_epsilon(self, rounds: int, population: int) -> float:
        """Epsilon after `rounds` rounds of the usual cohort of `population` phones, from none,
        at their delta (b and sigma_b as this run has fixed them)."""
        return self.mechanism.planned_epsilon(rounds, population)

    def max_noise_multiplier(self) -> float:
        """The z the clip rule allows below: adaptive clipping's sigma_b / s_b, else any."""
        return self.clip.max_noise_multiplier()

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
        bounded: ClippedRound,
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
        if self._pending:  # a server before its first phones: z is not calibrated yet
            dp["noise_multiplier"] = None
        elif self.calibration is not None:
            dp["noise_multiplier"] = self.calibration.noise_multiplier
        return {"dp": dp} if dp else {}

    def row_fields(self) -> dict:
        """Every metrics row's epsilon, rho, delta and noise_reproducible (fedkey.federation.metrics_row):
        None without DP."""
        return self.mechanism.row_fields()

    def would_exceed(self, population: int) -> bool:
        """True when one more DP round (of the usual cohort of `population` phones) would take
        epsilon past the budget; False without DP or a budget (or before z is calibrated:
        nothing is spent before the first population)."""
        return not self._pending and self.mechanism.would_exceed(population)

    # -- memory across rounds, for a restarted server ------------------------------------------

    def state_dict(self) -> dict:
        """The server state's DP part (JSON-serializable): "accountant" (None without DP), and
        "tree" or "blt" (DP-FTRL: the rounds' sensitivities, the separation rule) and "clip"
        (adaptive clipping: the next round's clip, sigma_b) where they apply; under DP "secret",
        the secret's fingerprint (fedkey.federation.privacy.secret), so that a resume with another is refused;
        "calibration" where z was calibrated (fedkey.federation.privacy.calibrate.Calibration)."""
        state = {**self.mechanism.state_dict(), **self.clip.state_dict()}
        if self.calibration is not None:
            state["calibration"] = self.calibration.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Adopt the DP part of a server state (the whole of it may be passed); a run resumes
        only with the mechanism, the clip and the secret it was noised with (one line saying
        which), and at the z it was noised with: a calibrated run keeps its calibrated z, and
        one noised at a z given (or the default) resumes only with that z."""
        self._load_calibration(state)
        self.mechanism.load_state_dict(state)
        self.clip.load_state_dict(state)
        self._retune()

    def _load_calibration(self, state: dict) -> None:
        stored = state.get("calibration")
        if stored is None:
            if self.calibrates and _spent(state):
                z = (state.get("accountant") or {}).get("noise_multiplier")
                given = f" {z:g}" if z is not None and state.get("clip") is None else ""
                raise ValueError(
                    "this run was noised at a noise multiplier it was given, not calibrated: "
                    f"resume it with --dp-noise-multiplier{given or ' (the one it ran with)'}"
                )
            return
        calibrated = Calibration.from_state(stored)
        z = calibrated.noise_multiplier
        if self.calibrates:
            self._adopt(calibrated)
        elif self.config.privacy.noise_multiplier == z:
            self.calibration = calibrated
        else:
            raise ValueError(
                f"this run's noise multiplier was calibrated to {z:g} for --dp-target-epsilon "
                f"{calibrated.target_epsilon:g}: resume it with that target and no "
                f"--dp-noise-multiplier (or with --dp-noise-multiplier {z:g})"
            )


def _spent(state: dict) -> bool:
    """Whether a server state's accountant has spent any round."""
    accountant = state.get("accountant") or {}
    return bool(accountant.get("events")) or int(accountant.get("steps", 0)) > 0
