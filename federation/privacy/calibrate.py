"""A privacy budget, not only a stop: the noise multiplier that makes the planned run end at
``--dp-target-epsilon``.

With ``--dp-target-epsilon E`` and no ``--dp-noise-multiplier``, the run's z is calibrated
before round 1, as pfl-research's privacy accountants do (given epsilon, delta, the planned
compositions and the sampling rate, their noise parameter is found by binary search over the
accountant); TensorFlow Federated's ``tff.learning.dp_aggregator`` takes z and leaves epsilon to
the RDP accountant, which is inverted here. The stop at E
(fedkey.federation.privacy.round.RoundPrivacy.would_exceed) stays as the guard. With a z
given nothing here runs; without a target either, z is :data:`DEFAULT_NOISE_MULTIPLIER`.

The rule
--------
z is the smallest number of three significant digits in [0.001, 1000] (:func:`grid_value`)
whose epsilon after the planned ``--rounds`` is at most E, where epsilon is the run's own
accountant's (:class:`Trial`: fedkey.federation.privacy.round.RoundPrivacy.planned_epsilon) on
a trial of the run at that z that has seen the run's first population N: the same mechanism;
fixed-size cohorts of m = the fraction of N (the RDP accountant's sampled-without-replacement
Gaussian), Poisson sampling at q, or DP-FTRL's tree or BLT under its separation b (given, or
floor(N / m)) with the BLT's factorization for the planned rounds; delta (given, or 1 / N^1.1);
under adaptive clipping the count's noise sigma_b, which also bounds z from above (z < sigma_b /
s_b, fedkey.federation.privacy.adaptive_clip). Epsilon falls as z grows, so the grid is searched
by bisection of its indices (:func:`smallest_noise_multiplier`), each step guessed by
interpolating log epsilon in log z (nearly linear; regula falsi with the Illinois rule), halving
the bracket after three guesses that did not: 4 to 8 accountant calls where plain halving takes
13 (about 0.5 s each for fixed-size cohorts, 0.2 s under Poisson sampling). The grid
z below passes E and is at most 1% smaller, so epsilon ends within about 1% under E (up to the
elasticity of epsilon in z times that step: 1.3% at worst in a sweep of the tree and BLT, where
z is just above 1).

What it assumes: every round draws its cohort at the configured fraction of the population it
starts with (simulate: all its phones; a server: those available for round 1). A server whose
phones keep enrolling accounts each round at its own N, whose default delta shrinks, so epsilon
may reach E before the last round: the stop then ends the run there. A resumed run keeps the z
it calibrated (the server state's "calibration").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from fedkey.federation.config import DEFAULT_NOISE_MULTIPLIER, FederationConfig, PrivacyConfig

__all__ = [
    "MAX_NOISE_MULTIPLIER",
    "MIN_NOISE_MULTIPLIER",
    "Calibration",
    "Trial",
    "calibrate",
    "grid_index",
    "grid_value",
    "needs_calibration",
    "noise_multiplier_of",
    "resolved",
    "smallest_noise_multiplier",
    "with_noise_multiplier",
]

#: The grid's three significant digits: mantissas 100 .. 999 in each decade.
_MANTISSAS = 900
#: The grid's first decade, 10^-3: z = 0.001 .. 0.00999 (index 0 .. 899).
_FIRST_EXPONENT = -5
MIN_NOISE_MULTIPLIER = 1e-3
#: The largest z calibration considers (a sane bound: at 1000 the noise drowns any model).
MAX_NOISE_MULTIPLIER = 1e3


def needs_calibration(privacy: PrivacyConfig) -> bool:
    """Whether z is calibrated: DP with a target epsilon and no noise multiplier given."""
    return privacy.dp and privacy.noise_multiplier is None and privacy.target_epsilon is not None


def with_noise_multiplier(config: FederationConfig, z: float) -> FederationConfig:
    """`config` with the noise multiplier z."""
    return replace(config, privacy=replace(config.privacy, noise_multiplier=float(z)))


def noise_multiplier_of(privacy: PrivacyConfig) -> float:
    """z: the given one, else :data:`DEFAULT_NOISE_MULTIPLIER` (a run to calibrate holds it
    until it is calibrated: fedkey.federation.privacy.round.RoundPrivacy)."""
    z = privacy.noise_multiplier
    return DEFAULT_NOISE_MULTIPLIER if z is None else z


def resolved(config: FederationConfig) -> FederationConfig:
    """`config` with a noise multiplier: the given one, else :data:`DEFAULT_NOISE_MULTIPLIER` (a
    run to calibrate holds it only until it is calibrated)."""
    if config.privacy.noise_multiplier is not None:
        return config
    return with_noise_multiplier(config, noise_multiplier_of(config.privacy))


# --------------------------------------------------------------------------- the grid


def grid_value(index: int) -> float:
    """The index-th number of three significant digits from 0.001 (0: 0.001, 1: 0.00101, ...,
    899: 0.00999, 900: 0.01, ..., 5400: 1000), as the float of its decimal."""
    decade, k = divmod(index, _MANTISSAS)
    return float(f"{100 + k}e{decade + _FIRST_EXPONENT}")


def grid_index(z: float) -> int:
    """The index of the largest grid number <= z (z >= 0.001)."""
    if not z >= MIN_NOISE_MULTIPLIER:
        raise ValueError(f"{z} is below the grid's {MIN_NOISE_MULTIPLIER}")
    exponent = math.floor(math.log10(z)) - 2  # z = mantissa x 10^exponent, 100 <= mantissa
    index = (exponent - _FIRST_EXPONENT) * _MANTISSAS + int(z / 10.0**exponent) - 100
    while grid_value(index) > z:  # the float arithmetic's last ulp, either way
        index -= 1
    while grid_value(index + 1) <= z:
        index += 1
    return index


def smallest_noise_multiplier(
    epsilon: Callable[[float], float], target: float, limit: float = MAX_NOISE_MULTIPLIER
) -> float | None:
    """The smallest grid z <= `limit` with ``epsilon(z) <= target``, or None when none is
    (not even the largest). `epsilon` must not increase with z; the search keeps a bracket of
    grid indices, ``epsilon(lo) > target >= epsilon(hi)``, and shrinks it to adjacent indices:
    each step probes where log epsilon, interpolated linearly in log z, crosses the target
    (regula falsi, Illinois), and bisects instead where three steps did not halve the
    bracket."""
    if not target > 0:
        raise ValueError(f"the target epsilon must be > 0, got {target}")
    top = grid_index(limit)
    seen: dict[int, float] = {}

    def f(i: int) -> float:  # > 0: too little noise; <= 0: within the target
        if i not in seen:
            eps = epsilon(grid_value(i))
            seen[i] = math.inf if eps == math.inf else math.log(max(eps, 1e-300) / target)
        return seen[i]

    def toward(i: int, low: int, high: int, factor: float) -> int:
        """The next index of the bracket's search from i, within [low, high]: where f would
        cross 0 if epsilon fell as 1 / z, past it by 10%, and at least `factor` away in z."""
        step = math.exp(abs(f(i))) * 1.1 if math.isfinite(f(i)) else 10.0
        guess = grid_value(i) * max(step, factor) ** (1 if f(i) > 0 else -1)
        guess = min(max(guess, MIN_NOISE_MULTIPLIER), grid_value(top))
        return min(high, max(low, grid_index(guess)))

    # The bracket: from z = 1 (or the limit), stepping as epsilon ~ 1 / z would need, each step
    # at least the square of the one before in the same direction.
    i, factor = min(grid_index(1.0), top), 1.1
    lo, hi = -1, top + 1  # unknown: f(-1) = +inf and f(top + 1) = -inf, never evaluated
    while True:
        if f(i) > 0:
            lo = i
        else:
            hi = i
        if lo == top or hi == 0 or (lo >= 0 and hi <= top):
            break
        i = toward(i, i + 1, top, factor) if lo == i else toward(i, 0, i - 1, factor)
        factor *= factor
    if hi > top:
        return None
    if lo < 0:
        return grid_value(hi)
    # The bracket shrunk to adjacent indices: regula falsi in (log z, log epsilon) with the
    # Illinois rule (the end kept twice running counts half), probing the grid z next to the
    # interpolated crossing on the side of the end kept last (so that the next probe is likely
    # to close the bracket), and bisecting after three steps that did not halve it.
    f_lo, f_hi, kept, slow = f(lo), f(hi), 0, 0
    while hi - lo > 1:
        width = hi - lo
        if slow >= 3 or not math.isfinite(f_lo):
            i = (lo + hi) // 2
        else:
            a, b = math.log(grid_value(lo)), math.log(grid_value(hi))
            x = math.exp(a + (b - a) * f_lo / (f_lo - f_hi))
            i = grid_index(min(max(x, grid_value(lo)), grid_value(hi)))  # the z at or below x
            if kept != -1 and grid_value(i) < x:  # at or above x, unless lo was kept last
                i += 1
            i = min(hi - 1, max(lo + 1, i))
        if f(i) > 0:
            lo, f_lo = i, f(i)
            f_hi, kept = (f_hi / 2 if kept == +1 else f_hi), +1  # hi kept
        else:
            hi, f_hi = i, f(i)
            f_lo, kept = (f_lo / 2 if kept == -1 else f_lo), -1  # lo kept
        slow = slow + 1 if hi - lo > width // 2 else 0
    return grid_value(hi)


# --------------------------------------------------------------------------- the run's calibration


class Trial(Protocol):
    """A trial of the run at one z that has seen its first population: what calibration reads
    of it (fedkey.federation.privacy.round.RoundPrivacy)."""

    def planned_epsilon(self, rounds: int, population: int) -> float: ...
    def max_noise_multiplier(self) -> float: ...


@dataclass(frozen=True)
class Calibration:
    """The calibrated z of a run, and what it was calibrated for: epsilon ``epsilon`` (<=
    ``target_epsilon``) after ``rounds`` rounds of a population of ``population`` phones at
    ``delta``; ``evaluations`` accountant calls in ``seconds``."""

    noise_multiplier: float
    target_epsilon: float
    epsilon: float
    rounds: int
    population: int
    delta: float | None
    evaluations: int = 0
    seconds: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        """The server state's "calibration" (JSON)."""
        return asdict(self)

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> Calibration:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def calibrate(
    config: FederationConfig,
    population: int,
    trial: Callable[[FederationConfig], Trial],
    delta: float | None = None,
) -> Calibration:
    """The run's z for its target (see the module's docstring): `trial(config at z)` is the run
    at z having seen `population` phones; `delta` is the delta they account at (recorded). One
    line (ValueError) when no --rounds bounds the run or no z up to the sane bound (or adaptive
    clipping's sigma_b) reaches the target."""
    target, rounds = config.privacy.target_epsilon, config.rounds
    if target is None:
        raise ValueError("calibrating the noise multiplier needs --dp-target-epsilon")
    if rounds < 1:
        raise ValueError(
            f"--dp-target-epsilon {target:g} without --dp-noise-multiplier calibrates z for the "
            f"planned --rounds: give --rounds (>= 1), or a --dp-noise-multiplier"
        )
    start, calls = time.perf_counter(), 0

    def epsilon(z: float) -> float:
        nonlocal calls
        calls += 1
        return trial(with_noise_multiplier(config, z)).planned_epsilon(rounds, population)

    # Adaptive clipping's count noise bounds z: z < sigma_b / s_b (the zero-noise trial tells).
    bound = trial(with_noise_multiplier(config, 0.0)).max_noise_multiplier()
    limit = MAX_NOISE_MULTIPLIER if bound > MAX_NOISE_MULTIPLIER else _below(bound)
    z = smallest_noise_multiplier(epsilon, target, limit) if limit is not None else None
    if z is None:
        raise ValueError(_unreachable(target, rounds, population, limit, bound, epsilon))
    evaluations = calls
    return Calibration(
        noise_multiplier=z,
        target_epsilon=target,
        epsilon=epsilon(z),  # evaluated by the search: the RDP accountant's cache has it
        rounds=rounds,
        population=population,
        delta=delta,
        evaluations=evaluations,
        seconds=round(time.perf_counter() - start, 3),
    )


def _below(bound: float) -> float | None:
    """The largest grid z strictly below `bound` (None: none is)."""
    if not bound > MIN_NOISE_MULTIPLIER:
        return None
    i = grid_index(bound)
    return grid_value(i if grid_value(i) < bound else i - 1)


def _unreachable(
    target: float,
    rounds: int,
    population: int,
    limit: float | None,
    bound: float,
    epsilon: Callable[[float], float],
) -> str:
    """Why no z reaches the target, in one line."""
    plan = f"{rounds} rounds of {population} phones"
    if limit is None or limit < MAX_NOISE_MULTIPLIER:
        at = "" if limit is None else f" (at z {limit:g}: epsilon {epsilon(limit):.4g})"
        return (
            f"--dp-target-epsilon {target:g} is out of reach of adaptive clipping's count noise: "
            f"sigma_b allows z below {bound:.4g}, too little noise for {plan}{at}; give a "
            f"larger --dp-clip-count-stddev, a larger target or fewer --rounds"
        )
    return (
        f"--dp-target-epsilon {target:g} is out of reach: even --dp-noise-multiplier "
        f"{MAX_NOISE_MULTIPLIER:g} ends {plan} at epsilon {epsilon(MAX_NOISE_MULTIPLIER):.4g}; "
        f"give a larger target, fewer --rounds or a larger population"
    )
