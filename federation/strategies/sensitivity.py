r"""Replace-one L2 sensitivity of each aggregate, under the server's clip and attention cap.

The DP guarantee of a round (Gaussian mechanism, then sampling amplification in
:mod:`fedkey.federation.privacy.gaussian`) needs ``Delta``: the largest change of the aggregate's output when one phone
of a cohort of ``m`` is replaced by any other phone (the cohort size is public). The noise added is
``N(0, (z Delta)^2)`` per coordinate. Assumptions, all enforced by the round engine:

* every update's delta ``u_k = theta_k - theta`` is clipped to ``||u_k|| <= S`` (scope
  ``"model"``), or each layer to ``||u_k^l|| <= S_l`` with ``sum_l S_l^2 = S^2`` (scope ``"layer"``);
* an attention logit lies in an interval of width ``r``, so two phones' unnormalized weights
  ``w = exp(logit)`` differ by at most the factor ``rho = e^r``; FedAtt's logit is
  ``||u_k^l|| / (T S_l)`` (in ``[0, 1/T]``, ``rho = e^(1/T)``), FedMed's is ``JS / T`` (the
  Jensen-Shannon divergence lies in ``[0, ln 2]``, ``rho = 2^(1/T)``).
* a phone's logit depends on its own update only: FedAtt's winsorized distances
  (``Bound.distance_caps``, the round's (k+1)-th largest) come with the coordinate trim, which
  DP refuses (fedkey.federation.config.dp_problem), so under DP the caps are None and the derivation below
  ("the others' relative weights do not change") holds.

**Attention step** (FedAtt, Ji et al. 2019, eq. 4; FedMed's adaptive step, Wu et al. 2020, eq. 5):
``Delta_out = step * A`` with, per layer, ``A^l = sum_k alpha_k^l u_k^l`` and
``alpha^l = softmax(logits^l)``. No weight exceeds ``a = rho / (rho + m - 1)`` (its own weight at
most ``rho``, each of the ``m - 1`` others at least 1). Replace phone 1 by 1'. The others' relative
weights do not change, so with ``R^l`` their weighted mean (the same in both cohorts)::

    A^l - A'^l = alpha_1 u_1^l - alpha_1' u_1'^l + (alpha_1' - alpha_1) R^l

* layer scope: ``||u^l|| <= S_l`` and ``||R^l|| <= S_l`` give
  ``||A^l - A'^l|| <= (alpha_1 + alpha_1' + |alpha_1 - alpha_1'|) S_l = 2 max(alpha_1, alpha_1') S_l
  <= 2 a S_l``; over all layers ``||A - A'|| <= 2 a S``. Tight: the others at ``u = 0`` (weight 1),
  ``u_1 = S e``, ``u_1' = -S e`` (weight ``rho`` each) reach it.
* model scope: a layer's bound is only the whole ``S``. By Minkowski over layers,
  ``||A - A'|| <= a ||u_1|| + a ||u_1'|| + a sqrt(sum_l ||R^l||^2)``, and by Jensen
  ``||R^l||^2 <= sum_{k>1} beta_k^l ||u_k^l||^2`` with the others' normalized weights
  ``beta <= rho / (rho + m - 2)``, so ``sum_l ||R^l||^2 <= rho (m - 1) S^2 / (rho + m - 2)``:
  ``||A - A'|| <= a S (2 + sqrt(rho (m - 1) / (rho + m - 2)))``.

**Uniform mean** (DP-FedAvg with fixed-size cohorts, McMahan et al. 2018): the attention bound
with ``rho = 1``: ``2 S / m``. With Poisson cohorts the engine uses McMahan et al.'s fixed
denominator ``sum_k u_k / (q N)``, whose add/remove-one sensitivity is ``S / (q N)``.

**Fixed-denominator attention** (FedAtt with ``normalizer="fixed"``, fedkey's DP variant of
Ji et al. 2019, eq. 4; :func:`fedkey.federation.strategies.aggregate.fedatt_fixed`): ``Delta_out = step * A``
with ``A^l = (1/m) sum_k w_k^l u_k^l`` and ``w_k^l = exp(logit_k^l - 1/T)``, FedAtt's capped logit
less its public ceiling ``1/T``, so ``w`` lies in ``[e^(-1/T), 1]`` and ``w_j / w_k`` is FedAtt's
softmax ratio. Phone k's term ``t_k = (w_k^l u_k^l)_l`` is a function of its own update alone (its
logit is its own distance over the public ``T S_l``; the count ``m`` is public), and
``||t_k^l|| <= ||u_k^l||`` layer by layer, so ``||t_k|| <= ||u_k|| <= S`` under either scope.
Replacing phone 1 by 1' leaves the other terms as they were::

    A - A' = (t_1 - t_1') / m,   ||A - A'|| <= (||u_1|| + ||u_1'||) / m <= 2 S / m

for every ``T``: DP-FedAvg's uniform-mean bound, whatever the scope. Tight: ``u_1 = S e``,
``u_1' = -S e`` with every layer on its bound (layer scope), or ``e`` inside one layer (model
scope), give ``w = 1`` on the layers that move. Against FedAtt, ``A^l`` is FedAtt's layer step
times the mean weight ``(1/m) sum_k w_k^l`` in ``[e^(-1/T), 1]``; that scale is left to the server
step. Restoring it would divide by the cohort's sum of weights, a private quantity: released with
its own noise (replace-one sensitivity ``sqrt(L) (1 - e^(-1/T))`` over L layers) it would spend
budget, that is add noise to the model at the same epsilon, against the point of the variant.
Attention computed from the released (noised) aggregates and the public model alone would be
free (post-processing) but sees no phone, so it cannot weigh phones at all: a server optimizer,
not FedAtt. Poisson cohorts could take the fixed denominator ``q N`` instead of ``m``
(add/remove-one ``step * S / (q N)``, the mean's times the step); fedkey.federation.config.dp_problem still
refuses attention there, and fedkey.federation.privacy.dp_fedavg's Poisson path declares the mean's.

**FedAttOpt's step** (Jiang et al. 2020, eq. 7; gradient in
:class:`fedkey.federation.strategies.aggregate.AttOptGradient`): ``Delta_out = -eps * grad`` with
``grad = B - (m / sqrt(n)) A``, ``B = sum_k u_k (1/sqrt(n) - 1/d_k^2)``, ``A = sum_k a_k u_k`` and
``a = softmax_k(theta . u_k / sqrt(n))`` over the whole model (the common ``theta . theta`` term
cancels). Bounded, the distance is floored, ``d_k = max(||u_k||, f S)``, so one term of ``B`` has
norm at most ``S / sqrt(n) + ||u|| / max(||u||, f S)^2 <= S / sqrt(n) + 1 / (f S)``; replacing one
phone changes ``B`` by at most twice that. The logits lie in ``[-|theta| S, |theta| S] / sqrt(n)``:
``rho = exp(2 |theta| S / sqrt(n))`` (public: theta is the broadcast model), and ``A`` is one
softmax over a single "layer", so it moves by at most ``2 a S``. In all,
``eps (2 (S / sqrt(n) + 1 / (f S)) + (m / sqrt(n)) 2 a S)``.

tests/federation/strategies/test_sensitivity.py searches neighbouring cohorts, at random and by
ascent on the replaced phone's delta, and checks that no change exceeds these bounds. It finds
the layer-scope, uniform-mean and fixed-denominator bounds tight, and at most ``2 a S`` under the model scope: the
``2 + sqrt(...)`` factor there may be loose, unproven either way.
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = [
    "attention_max_weight",
    "attention_sensitivity",
    "attopt_sensitivity",
    "fixed_attention_sensitivity",
    "mean_sensitivity",
    "poisson_mean_sensitivity",
]

Scope = Literal["model", "layer"]


def _check(m: int, clip: float) -> None:
    if m < 1:
        raise ValueError(f"the cohort must hold at least one update, got m={m}")
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"the clip bound must be a positive number, got {clip}")


def attention_max_weight(m: int, rho: float) -> float:
    """The largest softmax weight one of ``m`` phones can get when weights differ by at most the
    factor ``rho``: ``rho / (rho + m - 1)``."""
    if m < 1 or not rho >= 1:
        raise ValueError(f"need m >= 1 and rho >= 1, got m={m}, rho={rho}")
    return rho / (rho + m - 1)


def attention_sensitivity(m: int, clip: float, rho: float, scope: Scope) -> float:
    """Replace-one L2 sensitivity of the layer-wise attention average ``sum_k alpha_k u_k`` (not yet
    times the server step): ``2 a S`` (layer scope), ``a S (2 + sqrt(rho (m-1) / (rho+m-2)))``
    (model scope), with ``a`` = :func:`attention_max_weight`."""
    _check(m, clip)
    a = attention_max_weight(m, rho)
    if scope == "layer" or m == 1:
        return 2.0 * a * clip
    return a * clip * (2.0 + math.sqrt(rho * (m - 1) / (rho + m - 2)))


def mean_sensitivity(m: int, clip: float) -> float:
    """Replace-one L2 sensitivity of the uniform mean of ``m`` clipped deltas: ``2 S / m``."""
    _check(m, clip)
    return 2.0 * clip / m


def fixed_attention_sensitivity(m: int, clip: float) -> float:
    """Replace-one L2 sensitivity of the fixed-denominator attention ``(1/m) sum_k w_k u_k`` with
    ``w <= 1`` a function of phone k's own update (not yet times the server step): ``2 S / m``
    under either scope, :func:`mean_sensitivity`'s (see the module docstring)."""
    return mean_sensitivity(m, clip)


def poisson_mean_sensitivity(expected: float, clip: float) -> float:
    """Add/remove-one sensitivity of McMahan et al.'s fixed-denominator mean
    ``sum_k u_k / (q N)``: ``S / (q N)``."""
    _check(1, clip)
    if not expected > 0:
        raise ValueError(f"the expected cohort size q N must be > 0, got {expected}")
    return clip / expected


def attopt_sensitivity(
    m: int, clip: float, num_params: int, theta_norm: float, floor: float, step: float
) -> float:
    """Replace-one L2 sensitivity of FedAttOpt's step ``-step * grad`` with distances floored at
    ``floor * S`` (see the module docstring)."""
    _check(m, clip)
    if not floor > 0:
        raise ValueError(f"FedAttOpt's distance floor must be > 0 under DP, got {floor}")
    sqrt_n = math.sqrt(num_params)
    rho = math.exp(2.0 * theta_norm * clip / sqrt_n)
    a = attention_max_weight(m, rho)
    distance_part = 2.0 * (clip / sqrt_n + 1.0 / (floor * clip))
    attention_part = (m / sqrt_n) * 2.0 * a * clip
    return step * (distance_part + attention_part)
