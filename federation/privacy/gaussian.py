"""Privacy: the seed papers' client-side randomization, and differential privacy for every
strategy with dp_accounting's RDP accountant.

1. :func:`randomize` is the seed papers' "differential privacy" (FedAttOpt, Jiang et al. 2020,
   eq. 11; FedAtt, Ji et al. 2019, eq. 6): each client adds ``beta * N(0, sigma^2)`` to its
   parameters before uploading. It carries **no formal privacy guarantee** (nothing bounds a
   client's influence); it reproduces FedAtt's Table III (Ji et al. 2019).
2. Client-level DP (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
   Models", extended to the attentive strategies): the round engine clips every update to L2 norm
   S (fedkey.federation.influence.bounding), aggregates with the strategy under its attention cap, and adds
   ``N(0, (z Delta)^2)`` to the new model, where ``Delta`` is the aggregate's sensitivity
   (fedkey.federation.strategies.sensitivity: replace-one for fixed-size cohorts, add/remove-one for the
   Poisson-sampled uniform mean). :class:`PrivacyAccountant` composes what the server really did
   each round: ``SampledWithoutReplacementDpEvent(N, m, Gaussian(z))`` under replace-one
   adjacency for a fixed-size cohort of m of N phones, or ``PoissonSampledDpEvent(q, Gaussian(z))``
   under add/remove-one for Poisson sampling, and reports epsilon at delta.

The guarantee assumes what the analysis assumes: the noise is drawn on the server from a secret
stream (fedkey.federation.privacy.secret), every data-dependent choice is inside the analysis (fedkey.federation.config.dp_problem refuses the
rest), and phones that drop out of a round do so independently of their data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import dp_accounting
import torch
from dp_accounting.rdp import RdpAccountant
from torch import Tensor

from fedkey.common.noise import randomize
from fedkey.federation.config import DPSampling
from fedkey.federation.privacy.secret import SecretKey

StateDict = dict[str, Tensor]
NeighborRel = dp_accounting.NeighboringRelation

__all__ = [
    "PopulationDelta",
    "PrivacyAccountant",
    "add_gaussian_noise",
    "compute_epsilon",
    "dp_event",
    "known_delta",
    "population_delta",
    "randomize",
]


def add_gaussian_noise(
    state: Mapping[str, Tensor], std: float, unit: Mapping[str, Tensor] | None = None
) -> StateDict:
    """``state + std * unit`` on every floating entry, in float64 (noise on the aggregated model
    equals noise on the aggregated delta). `unit`: N(0, 1) per floating entry, from the server's
    secret (fedkey.federation.privacy.secret.SecretKey.normal_state); None draws a fresh one from a secret of
    this process alone. ``std == 0`` returns a new dict with the same tensors."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    if std == 0:
        return dict(state)
    if unit is None:
        unit = SecretKey.fresh().normal_state(state, "gaussian")
    out: StateDict = {}
    for k, v in state.items():
        if torch.is_floating_point(v):
            noise = unit[k].to(v.device, torch.float64).mul(std)
            out[k] = (v.detach().to(torch.float64) + noise).to(v.dtype)
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------- accounting

#: One kind of round, with how many rounds of it: (population N, cohort size m, rounds) for
#: fixed-size sampling; (sampling rate q, 0, rounds) for Poisson sampling.
Events = tuple[tuple[float, int, int], ...]


def dp_event(
    sampling: DPSampling, noise_multiplier: float, events: Events
) -> dp_accounting.DpEvent:
    """The dp_accounting event of a run: each kind of round composed as often as it happened."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    parts: list[dp_accounting.DpEvent] = []
    for a, m, count in events:
        if sampling == "poisson":
            one: dp_accounting.DpEvent = dp_accounting.PoissonSampledDpEvent(a, gaussian)
        else:
            one = dp_accounting.SampledWithoutReplacementDpEvent(int(a), int(m), gaussian)
        parts.append(dp_accounting.SelfComposedDpEvent(one, int(count)))
    return dp_accounting.ComposedDpEvent(parts)


def relation(sampling: DPSampling) -> dp_accounting.NeighboringRelation:
    """The adjacency each sampling's analysis uses."""
    return NeighborRel.ADD_OR_REMOVE_ONE if sampling == "poisson" else NeighborRel.REPLACE_ONE


@lru_cache(maxsize=4096)
def compute_epsilon(
    sampling: DPSampling, noise_multiplier: float, events: Events, delta: float
) -> float:
    """Epsilon at ``delta`` after ``events`` (RDP accountant)."""
    rounds = sum(count for _, m, count in events if sampling == "poisson" or m > 0)
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = RdpAccountant(neighboring_relation=relation(sampling))
    acc.compose(dp_event(sampling, noise_multiplier, events))
    return float(acc.get_epsilon(delta))


def population_delta(population: int) -> float:
    """Production's delta for a population of N phones: ``1 / N^1.1`` (below 1 / N, so a
    mechanism that published one phone's data outright could not meet it; N = 1 counts as 2)."""
    return float(max(population, 2) ** -1.1)


class PopulationDelta:
    """The delta an accountant reports epsilon at: the configured one, or (None configured)
    :func:`population_delta` of the largest population seen so far (``observe``), so delta only
    shrinks as phones enroll and epsilon only grows. None while no population is known (a
    server before its first round); nothing can have been spent then."""

    def __init__(self, delta: float | None) -> None:
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.delta_setting = None if delta is None else float(delta)
        self.population = 0  # the largest population seen

    def observe(self, population: int) -> None:
        """A population the run drew from (the default delta follows the largest)."""
        self.population = max(self.population, int(population))

    def delta_for(self, population: int = 0) -> float | None:
        """The delta once ``population`` phones are seen too."""
        if self.delta_setting is not None:
            return self.delta_setting
        n = max(self.population, population)
        return population_delta(n) if n > 0 else None

    @property
    def delta(self) -> float | None:
        """The delta epsilon is reported at now."""
        return self.delta_for()

    def _delta_state(self) -> dict[str, Any]:
        return {
            "delta": self.delta,
            "delta_setting": self.delta_setting,
            "population": self.population,
        }

    def _load_delta_state(self, d: Mapping[str, Any]) -> None:
        if "population" in d:
            self.population = int(d["population"])


def known_delta(delta: float | None) -> float:
    """`delta`, which must be known by now (a population was seen)."""
    if delta is None:
        raise RuntimeError("delta is not known before the population is")
    return delta


class PrivacyAccountant(PopulationDelta):
    """Client-level (epsilon, delta) of the run so far, composed round by round.

    ``step(population, cohort)`` once per round in which noise was added: a fixed-size cohort of
    ``cohort`` of ``population`` phones (the population may change as phones enroll), or, under
    Poisson sampling, one round at the rate q given here. ``epsilon`` is the RDP bound at
    ``delta`` (:class:`PopulationDelta`: the given one, or ``1 / N^1.1`` of the largest population
    a round was drawn from); ``would_exceed(population, cohort)`` tells beforehand whether one
    more such round would overshoot ``target_epsilon``, so the server stops before spending it.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling: DPSampling = "fixed",
        sampling_rate: float = 0.0,
        delta: float | None = 1e-5,
        target_epsilon: float | None = None,
    ) -> None:
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if sampling == "poisson" and not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        super().__init__(delta)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling: DPSampling = sampling
        self.sampling_rate = float(sampling_rate)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.counts: dict[tuple[float, int], int] = {}

    def _key(self, population: int, cohort: int) -> tuple[float, int]:
        if self.sampling == "poisson":
            return (self.sampling_rate, 0)
        if not 1 <= cohort <= population:
            raise ValueError(f"a cohort of {cohort} from {population} phones cannot be accounted")
        return (float(population), int(cohort))

    def events(self, extra: tuple[float, int] | None = None) -> Events:
        counts = dict(self.counts)
        if extra is not None:
            counts[extra] = counts.get(extra, 0) + 1
        return tuple(sorted((a, m, c) for (a, m), c in counts.items()))

    @property
    def steps(self) -> int:
        """Rounds accounted so far."""
        return sum(self.counts.values())

    def step(self, population: int, cohort: int) -> float:
        """Account for one round; return the new epsilon."""
        key = self._key(population, cohort)
        self.observe(population)
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.epsilon

    def dp_event(self) -> dp_accounting.DpEvent:
        """What was spent, as a dp_accounting event (to check against the library's answer)."""
        return dp_event(self.sampling, self.noise_multiplier, self.events())

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far, at :attr:`delta`."""
        if self.steps == 0:
            return 0.0
        return compute_epsilon(
            self.sampling, self.noise_multiplier, self.events(), known_delta(self.delta)
        )

    @property
    def rho(self) -> float:
        """rho-zCDP spent so far: each round is a Gaussian mechanism of noise z times the
        aggregate's sensitivity, ``1 / (2 z^2)``-zCDP (Bun and Steinke 2016, Prop. 1.6), and
        rounds compose additively. zCDP cannot express amplification by sampling (a sampled
        Gaussian's RDP over alpha tends to the unsampled 1 / (2 z^2) as alpha grows), so this is
        the unamplified bound: ``epsilon`` (RDP with the sampling) is the tighter figure."""
        if self.steps == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return self.steps / (2 * self.noise_multiplier**2)

    @property
    def exhausted(self) -> bool:
        """Whether the budget ``target_epsilon`` is spent (never, without a target)."""
        return self.target_epsilon is not None and self.epsilon >= self.target_epsilon

    def planned_epsilon(self, rounds: int, population: int, cohort: int) -> float:
        """Epsilon at the delta of ``population`` phones after ``rounds`` rounds of ``cohort`` of
        them (Poisson: at the rate q), from none: what a run plans
        (fedkey.federation.privacy.calibrate)."""
        if rounds == 0:
            return 0.0
        a, m = self._key(population, cohort)
        delta = known_delta(self.delta_for(population))
        return compute_epsilon(self.sampling, self.noise_multiplier, ((a, m, rounds),), delta)

    def would_exceed(self, population: int, cohort: int) -> bool:
        """Whether one more round of ``cohort`` of ``population`` phones would take epsilon past
        ``target_epsilon``."""
        if self.target_epsilon is None:
            return False
        after = self.events(self._key(population, cohort))
        delta = known_delta(self.delta_for(population))
        return compute_epsilon(self.sampling, self.noise_multiplier, after, delta) > (
            self.target_epsilon
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "events": [list(e) for e in self.events()],
            "sampling": self.sampling,
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            **self._delta_state(),
            "target_epsilon": self.target_epsilon,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore the rounds spent (the configuration stays as constructed)."""
        if d.get("mechanism") in ("tree", "blt"):
            raise ValueError(
                f"this run was accounted with the {d['mechanism']} mechanism (DP-FTRL): resume "
                f"it with --dp-mechanism {d['mechanism']}"
            )
        if d.get("sampling", self.sampling) != self.sampling:
            raise ValueError(
                f"the run was accounted with {d['sampling']!r} sampling, not {self.sampling!r}"
            )
        if "events" not in d and int(d.get("steps", 0)) > 0:  # written before fixed-size events
            if self.sampling != "poisson":
                raise ValueError(
                    "this run's privacy spend was recorded as Poisson rounds by an older fedkey: "
                    "resume it with --dp-sampling poisson"
                )
            self.counts = {(self.sampling_rate, 0): int(d["steps"])}
            return
        self._load_delta_state(d)
        self.counts = {(float(a), int(m)): int(c) for a, m, c in d.get("events", [])}
