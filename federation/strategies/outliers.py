"""The cosine outlier filter: which of a round's updates point away from the cohort.

Why. The clip and the coordinate trim (fedkey.federation.influence.bounding) bound how far one update moves the
model, but a persistent backdoor is selected every round and pushes the same few coordinates
(trigger -> target) every round, and FedAtt's server step (epsilon 1.2) amplifies what survives:
bench attacks, FedAtt, 1 of 10 phones, the defaults without this filter: top-1 / top-3 success
0% for four rounds, then 9% / 26% after the fifth. Its direction gives it away. FLAME (Nguyen et
al. 2022, "FLAME: Taming Backdoors in Federated Learning", its model filtering) clusters the
updates by their pairwise cosine distance ``1 - cos(u_i, u_j)`` (HDBSCAN, min cluster size
m/2 + 1) and keeps the majority cluster, because the cosine does not see the attacker's boost
(scale-invariant) and a poisoned task turns the update away from the benign ones. Measured on
the same cell with this filter (the raw deltas, before the trim and the clip), each phone's mean
cosine to the nine others, rounds 1-5:

    honest phones   0.63, 0.73-0.77   0.65-0.66   0.52-0.54   0.44-0.46   0.38-0.40
    the attacker    0.46              0.56        0.46        0.40        0.35
    its z-score     31                13          13          7.2         12

The attacker is the lowest every round, 7 to 31 modified z-scores below the median (one honest
phone, 0.63, was rejected in round 1 too, at 13); the honest phones agree less and less as the
model learns, so the test is relative to the round's own spread, not a fixed cosine. (The
median cosine to the others, measured first without the filter, separated the same way.)

What. The score of phone i is its mean cosine similarity to the others,

    s_i = 1/(m-1) sum_{j != i} cos(u_i, u_j) = (v_i . V - |v_i|^2) / (m - 1),
    v_i = u_i / ||u_i||,  V = sum_j v_j,

which is O(m n) from two streaming passes (the norms, then ``v_i . V``) where FLAME's pairwise
matrix is O(m^2 n) (a 1,000-phone round of a 1.17M-parameter model: 2.3e12 flops against
3.5e9), and no clustering library is needed: the majority FLAME keeps is here the phones
within the cut of the median score.

A phone is rejected when its score is unusually LOW by Iglewicz & Hoaglin's modified z-score
(1993, "How to Detect and Handle Outliers"):

    M_i = 0.6745 (median(s) - s_i) / MAD(s),  MAD(s) = median_i |s_i - median(s)|,

with their outlier cut M_i > 3.5 (fedkey.federation.config.DEFAULT_OUTLIER_Z; one-sided: a phone closer to
the cohort than the median is never rejected). The median and the MAD break down only when half
the scores are hostile, so at most ``ceil(m/2) - 1`` phones are rejected (the lowest first: the
majority stays, FLAME's min-cluster-size m/2 + 1) and cohorts below ``MIN_COHORT`` are not
filtered (too few scores to have a spread). When the MAD is 0 (more than half the scores equal),
1.253314 times the mean absolute deviation takes its place (the normal-consistent scale of the
mean deviation); when that is 0 too, every score is the same and nobody is rejected.

Cost. An honest phone can be rejected in a round where it happens to disagree with the rest:
in simulated Gaussian cohorts of ten or thirty, 0.08-0.12 phones per round (about 1 in 100;
tests/federation/strategies/test_outliers.py), and real rounds have heavier tails (the round-1 phone above).
Every rejection is reported (the round's ``info.clip.outliers``), and the clean runs of bench
attacks measure what it costs.

Not under DP: the rejection depends on every other phone's update, so replacing one phone can
change which others are aggregated, which the replace-one sensitivity
(fedkey.federation.strategies.sensitivity) does not cover; like the trim, it is off under DP by default
and refused when asked for (fedkey.federation.config.dp_problem).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

#: 0.6745 = the standard normal's 0.75 quantile: MAD / 0.6745 estimates sigma for normal data.
MAD_CONSISTENCY = 0.6745
#: sqrt(pi / 2): the mean absolute deviation times this estimates sigma for normal data.
MEANAD_CONSISTENCY = 1.253314
#: Smaller cohorts are not filtered: with 4 scores the median and the MAD are two values each.
MIN_COHORT = 5


def mean_cosines(dots: ArrayLike, norms: ArrayLike) -> np.ndarray:
    """Each phone's mean cosine similarity to the others, ``(v_i . V - |v_i|^2) / (m - 1)``,
    from ``dots[i] = u_i . V`` (V the sum of the unit deltas) and ``norms[i] = ||u_i||``. A zero
    delta has cosine 0 with everything."""
    d = np.asarray(dots, dtype=np.float64)
    n = np.asarray(norms, dtype=np.float64)
    m = len(d)
    if m < 2:
        return np.zeros(m)
    safe = np.where(n > 0, n, 1.0)
    self_sq = np.where(n > 0, 1.0, 0.0)
    return np.where(n > 0, d / safe - self_sq, 0.0) / (m - 1)


def modified_z(scores: ArrayLike) -> np.ndarray:
    """Iglewicz & Hoaglin's modified z-score of how far below the median each score lies
    (negative above it); zeros when the scores have no spread."""
    s = np.asarray(scores, dtype=np.float64)
    if s.size == 0:
        return s
    med = float(np.median(s))
    dev = np.abs(s - med)
    mad = float(np.median(dev))
    if mad > 0:
        return MAD_CONSISTENCY * (med - s) / mad
    mean_ad = float(np.mean(dev))
    if mean_ad > 0:
        return (med - s) / (MEANAD_CONSISTENCY * mean_ad)
    return np.zeros_like(s)


def max_rejected(m: int) -> int:
    """The most phones one round may reject: fewer than half (``ceil(m/2) - 1``), none below
    ``MIN_COHORT``."""
    return math.ceil(m / 2) - 1 if m >= MIN_COHORT else 0


def reject_outliers(scores: ArrayLike, z: float) -> list[int]:
    """Indices of the phones whose score's modified z-score exceeds ``z`` (lowest score first),
    at most :func:`max_rejected` of them; none when ``z`` is 0 (the filter off)."""
    if z <= 0:
        return []
    s = np.asarray(scores, dtype=np.float64)
    limit = max_rejected(len(s))
    if limit == 0:
        return []
    mz = modified_z(s)
    flagged = [int(i) for i in np.argsort(s, kind="stable") if mz[i] > z]
    return flagged[:limit]
