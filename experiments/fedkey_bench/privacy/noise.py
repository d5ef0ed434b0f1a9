"""The noise calibration of `fedkey-bench privacy` (fedkey_bench.privacy.runner): the noise multiplier z that
spends a target epsilon under each DP mechanism, on the accounting the server itself uses."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import get_args

from fedkey.federation.config import DPMechanism
from fedkey.federation.privacy.gaussian import compute_epsilon

MECHANISMS: tuple[str, ...] = get_args(DPMechanism)


def epsilon_after(z: float, rounds: int, population: int, cohort: int, delta: float) -> float:
    """The accountant's epsilon after `rounds` fixed-size rounds of `cohort` of `population`."""
    return compute_epsilon(
        "fixed", float(z), ((float(population), int(cohort), int(rounds)),), delta
    )


def epsilon_of(
    mechanism: str, rounds: int, population: int, cohort: int, delta: float
) -> Callable[[float], float]:
    """Epsilon at `delta` after `rounds` rounds as a function of z, as the server accounts it:
    gaussian, fixed-size sampling of `cohort` of `population` (fedkey.federation.privacy.gaussian); tree and blt,
    zCDP at the default separation b = floor(N / m) (fedkey.federation.privacy.tree.tree_rho, fedkey.federation.privacy.blt.
    blt_rho of the factorization the server would pick), converted by dp_ftrl.zcdp_epsilon."""
    from fedkey.federation.privacy import blt as dp_blt
    from fedkey.federation.privacy import tree as dp_ftrl

    if mechanism == "gaussian":
        return lambda z: epsilon_after(z, rounds, population, cohort, delta)
    b = dp_ftrl.default_separation(population, cohort)
    if mechanism == "tree":
        return lambda z: dp_ftrl.zcdp_epsilon(dp_ftrl.tree_rho(rounds, z, b), delta)
    if mechanism == "blt":
        entry = dp_blt.select_blt(rounds, b)  # ValueError: no factorization for these rounds
        return lambda z: dp_ftrl.zcdp_epsilon(dp_blt.blt_rho(rounds, z, b, entry), delta)
    raise ValueError(f"unknown DP mechanism {mechanism!r}; choose one of {', '.join(MECHANISMS)}")


def calibrate_noise(
    target: float, epsilon: Callable[[float], float], rel_tol: float = 2e-3
) -> float:
    """The noise multiplier z with ``epsilon(z) == target`` (within `rel_tol`); `epsilon` is a
    mechanism's epsilon after the run's rounds (:func:`epsilon_of`).

    Epsilon falls monotonically in z; the root is bracketed by doubling / halving z, then found by
    regula falsi with the Illinois modification on (log z, log epsilon), which is nearly linear:
    a handful of accountant calls (each ~0.5 s) instead of bisection's dozens.
    """
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"the target epsilon must be a positive number, got {target}")

    def f(log_z: float) -> float:
        return math.log(epsilon(math.exp(log_z))) - math.log(target)

    lo, hi = math.log(0.5), math.log(2.0)
    f_lo, f_hi = f(lo), f(hi)
    for _ in range(40):  # f_lo > 0 (too little noise) and f_hi < 0 (too much)
        if f_lo > 0:
            break
        hi, f_hi, lo = lo, f_lo, lo - math.log(2.0)
        f_lo = f(lo)
    for _ in range(40):
        if f_hi < 0:
            break
        lo, f_lo, hi = hi, f_hi, hi + math.log(2.0)
        f_hi = f(hi)
    if not (f_lo > 0 > f_hi):
        raise ValueError(f"no noise multiplier reaches epsilon {target}")
    side = 0
    for _ in range(60):
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f_mid = f(mid)
        if abs(f_mid) <= math.log1p(rel_tol):
            return math.exp(mid)
        if f_mid > 0:
            lo, f_lo = mid, f_mid
            if side == 1:
                f_hi /= 2
            side = 1
        else:
            hi, f_hi = mid, f_mid
            if side == -1:
                f_lo /= 2
            side = -1
    raise RuntimeError(f"the noise calibration for epsilon {target} did not converge")


@lru_cache(maxsize=256)
def z_for(target: float, mechanism: str, rounds: int, population: int, cohort: int, delta: float):
    """calibrate_noise for one mechanism and population (the strategies share it)."""
    return calibrate_noise(target, epsilon_of(mechanism, rounds, population, cohort, delta))


def deployment_population(population: int, cohort: int, noise_cohort: int) -> int:
    """N' = N M / m: the population whose cohorts of M keep our sampling rate m / N."""
    return round(population * noise_cohort / cohort)
