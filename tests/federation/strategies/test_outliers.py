"""The cosine outlier filter's arithmetic (fedkey.federation.strategies.outliers): mean cosines from the
streaming sums, Iglewicz & Hoaglin's modified z-score, and how many phones a round may reject."""

import numpy as np
import pytest

from fedkey.federation.strategies.outliers import (
    MIN_COHORT,
    max_rejected,
    mean_cosines,
    modified_z,
    reject_outliers,
)


def brute_force(u: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(u, axis=1, keepdims=True)
    v = np.divide(u, n, out=np.zeros_like(u), where=n > 0)
    c = v @ v.T
    np.fill_diagonal(c, 0.0)
    return c.sum(axis=1) / (len(u) - 1)


def test_mean_cosines_from_the_sums_match_the_pairwise_matrix():
    u = np.random.default_rng(0).normal(size=(7, 40))
    u[3] *= 1000.0  # a boost does not change a cosine
    u[5] = 0.0  # a zero delta: cosine 0 with everything
    norms = np.linalg.norm(u, axis=1)
    total = sum(u[i] / norms[i] for i in range(len(u)) if norms[i] > 0)
    got = mean_cosines(u @ total, norms)
    assert got == pytest.approx(brute_force(u), abs=1e-12)
    assert got[5] == 0.0


def test_modified_z_is_zero_at_the_median_and_positive_below_it():
    s = [0.80, 0.81, 0.82, 0.83, 0.84, 0.40]
    z = modified_z(s)
    med, mad = np.median(s), np.median(np.abs(np.array(s) - np.median(s)))
    assert z[5] == pytest.approx(0.6745 * (med - 0.40) / mad)
    assert z[5] > 3.5 and all(z[i] < 3.5 for i in range(5))
    assert z[4] < 0  # above the median: never an outlier


def test_modified_z_without_a_mad_falls_back_to_the_mean_deviation_then_to_zero():
    s = [0.5, 0.5, 0.5, 0.5, 0.1]  # MAD 0: four equal scores
    z = modified_z(s)
    assert z[4] == pytest.approx(0.4 / (1.253314 * np.mean([0, 0, 0, 0, 0.4])))
    assert np.all(modified_z([0.3] * 6) == 0.0)


def test_the_low_outlier_is_rejected_and_a_tight_cohort_keeps_everyone():
    honest = [0.52, 0.53, 0.535, 0.54, 0.541, 0.538, 0.536, 0.531, 0.539]
    assert reject_outliers(honest, 3.5) == []
    assert reject_outliers([*honest, 0.47], 3.5) == [9]
    assert reject_outliers([*honest, 0.47], 0.0) == []  # 0: the filter off
    assert reject_outliers([0.9, 0.9, 0.1, 0.9], 3.5) == []  # below MIN_COHORT: not filtered


def test_at_most_a_minority_is_rejected_lowest_first():
    assert [max_rejected(m) for m in (MIN_COHORT - 1, 5, 6, 10, 11)] == [0, 2, 2, 4, 5]
    # Six of twelve point away: at the cut 3.5 the median and the MAD have broken down (the
    # filter sees no outlier) ...
    scores = [0.9] * 6 + [0.1, 0.2, 0.15, 0.3, 0.25, 0.05]
    assert reject_outliers(scores, 3.5) == []
    # ... and at a cut low enough to flag all six, five are rejected (max 5 of 12), lowest first.
    assert sum(modified_z(scores) > 0.5) == 6
    assert reject_outliers(scores, 0.5) == [11, 6, 8, 7, 10]


def test_an_iid_cohort_loses_about_one_phone_in_a_hundred_at_the_cut():
    """Gaussian cohorts (a shared direction plus each phone's noise, of any size): at 3.5 about
    0.1 phones of ten are rejected per round (measured: 0.08-0.12 in 400 rounds at spreads 0.3,
    1 and 3); the two-sided test or a cut of 2 would reject several times as many."""
    rng = np.random.default_rng(0)
    rejected = {3.5: 0, 2.0: 0}
    for _ in range(200):
        u = rng.normal(size=200) + rng.uniform(0.3, 3.0) * rng.normal(size=(10, 200))
        s = brute_force(u)
        for z in rejected:
            rejected[z] += len(reject_outliers(s, z))
    assert rejected[3.5] / (200 * 10) < 0.02
    assert rejected[2.0] > 3 * rejected[3.5]
