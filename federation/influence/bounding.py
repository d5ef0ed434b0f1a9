"""Bounded influence: what the server does to a round's updates before any strategy sees them.

One phone of ten that uploads its delta times 100 took FedAvg's perplexity from 79 to 2e139 and
FedAtt's to 3e223 (its softmax gives the farthest model the largest weight). Here, every update's
delta ``u_k = theta_k - theta`` is clipped to an L2 bound S (the whole model, or each layer to
``S_l`` with ``sum_l S_l^2 = S^2``), as DP-FedAvg does (McMahan et al. 2018) and as norm bounding
against backdoors does (Sun et al. 2019, "Can You Really Backdoor Federated Learning?"):

* adaptive (the default): S is ``multiple`` times the median of the round's norms (per layer
  under the layer scope), 1 by default: the median, as FLAME clips (Nguyen et al. 2022, "FLAME:
  Taming Backdoors in Federated Learning", adaptive clipping) and as Andrew et al. 2021's
  adaptive DP clip targets (quantile 0.5). The median is what honest phones send as long as they
  are the majority, so an attacker's boost is cut back to an honest step whatever its factor.
  Twice the median (the earlier default) never bit on a trimmed backdoor: at an honest extreme on
  every coordinate it pushes, its norm was 1.6x the median (bench attacks, 1 of 10 phones) while
  honest phones were within 1.05x of it; at the median it is cut to an honest phone's norm;
* fixed: a given S (under DP, the DP clip: the analysis needs a bound that does not depend on
  the data);
* off: nothing is bounded, the seed papers' methods as published.

Before the clip, every coordinate is trimmed (``trim`` beta, 0.1 by default without DP): clamped
to the range of the round's values of that coordinate without their k = ceil(beta m) smallest and
largest, winsorizing as Yin et al. 2018's coordinate-wise trimmed mean trims. The clip alone lets
a persistent backdoor through: an attacker selected every round is an honest-sized update once
clipped, but it always pushes the same few coordinates (trigger -> target) and nothing honest
pushes back. Clamped to the range its honest peers span on each coordinate, it pushes no further
than the most extreme honest phone (bench attacks, FedAvg, 1 of 10 phones, 5 rounds: top-1
success 64% with the clip alone, 1% with the trim; it slows the backdoor, it does not stop it).

The bound is handed to the strategy (:class:`fedkey.federation.strategies.Bound`), which caps its attention
weights with it, and a FedAvg weight ``n_k`` (declared by the phone) is capped at ``weight_cap``
times the round's median.

With the trim, the bound also carries each layer's (k+1)-th largest bounded distance
(:func:`distance_caps`): FedAtt's softmax of distances favours the farthest update, and a trimmed
backdoor, at an honest extreme on every coordinate it pushes, is the farthest (bench attacks,
FedAtt, 1 of 10: 0.127 of the embedding's attention against at most 0.098 for an honest phone,
with the clip not biting: its trimmed norm 1.6x the median). FedAtt counts no distance beyond
the cap, so the farthest k phones weigh as the (k+1)-th farthest: the trim's winsorizing, applied
to the attention's input. Not under DP (no trim there): replacing one phone would then move the
others' scores, which the sensitivity analysis does not cover.

Before all of this, the cosine outlier filter (fedkey.federation.strategies.outliers, ``outlier_z``)
rejects the updates whose mean cosine similarity to the round's others is unusually low
(Iglewicz & Hoaglin's modified z-score over 3.5, fewer than half the cohort): the clip and the
trim bound a persistent backdoor's size, not its direction, and FedAtt's server step amplifies
what is left of it (bench attacks, FedAtt, 1 of 10: 9% / 26% top-1 / top-3 after 5 rounds with
both). The scores are those of the raw deltas (the cosine does not see a boost), the rejected
phones are in ``info["outliers"]`` with their z-scores, and the trim, the clip and the caps are
computed over the phones kept. Off under DP, as the trim is.

How the round is read (fedkey.federation.influence.cohort_scan): four passes over the stored uploads, as few as the
order of the computation allows (each needs what the one before it finished): the filter's two
passes a phone at a time, then one slice-stacked pass over the kept phones for the trim's range
and the trimmed norms together, then the strategy's. FedAvg's weights and FedAtt's attention
(its scores are the bounded distances: the trimmed norms times the clip factors) are known once
the bound is, so their step is one weighted sum of the bounded deltas, a few uploads at a time
(:meth:`BoundedRound.weighted_sum`); other strategies, DP's float64 clip and bfloat16 uploads
iterate the round, each upload read once more, trimmed (a clamp) and clipped in place.
``fedkey-bench aggregation`` times a round against reading its uploads once
(experiments/results/aggregation): one thread, on the shared 2-core machine (busy: the read of
1,000 uploads took 1.7 s of CPU), 1,000 uploads of a 1.14M-parameter model take 23 s of CPU, 14
times the read's (44-45 s, 26-27 times, with the trim's sort, its transposes out of the slice and
numpy's gemv on every core, in the same run; at 500 uploads 12 s, 14-15 times, against 18, 22). Per
pass (fedkey.federation.influence.cohort_scan, timed by hand): the filter's two passes 3 reads, the
trim's 8-9 (the selection of its order statistics half of it), the weighted sum 2-2.5. Each pass
costs two reads or more, so three times the read, the target, is out of reach of four passes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from fedkey.federation.config import InfluenceConfig
from fedkey.federation.influence.cohort_scan import (
    Cohort,
    Limits,
    clamp_state,
    cosine_scan,
    floating_keys,
    load_state,
    norm_scan,
    trim_scan,
    weighted_scan,
)
from fedkey.federation.strategies import Bound, ClientUpdate
from fedkey.federation.strategies.outliers import mean_cosines, modified_z, reject_outliers

#: A bound of zero (every update equal to the global model) would divide the attention logits by 0.
MIN_BOUND = 1e-12
#: Elements of one layer's slice stacked across the cohort for the trim's order statistics
#: (float32: 32 MB, and as much for np.sort's copy), so the trim's memory does not grow with the
#: cohort (fedkey.federation.influence.cohort_scan.trim_scan).
TRIM_CHUNK = 1 << 23

#: Per floating layer, the trim's lowest and highest delta for each coordinate.
Ranges = dict[str, tuple[Tensor, Tensor]]


def trim_count(beta: float, m: int) -> int:
    """How many values the trim clamps at each end of a coordinate: ceil(beta m), or 0 when that
    leaves no value between them (m <= 2k: too small a cohort to trim)."""
    k = math.ceil(beta * m - 1e-9) if beta > 0 else 0
    return k if m > 2 * k else 0


def coordinate_range(
    global_state: Mapping[str, Tensor], states: Sequence[Mapping[str, Tensor]], k: int
) -> Ranges:
    """Each coordinate's (k+1)-th smallest and (k+1)-th largest delta over the round's states:
    the values the trim clamps to, in float64. The delta ``theta_k - theta`` is monotone in
    ``theta_k``, so the order statistics are selected among the phones' own values and the global
    subtracted after: the same numbers as selecting among the float64 deltas. Slice by slice
    (``TRIM_CHUNK`` elements across the cohort at a time, fedkey.federation.influence.cohort_scan.trim_scan);
    :func:`bound_round` keeps the values themselves (:func:`fedkey.federation.influence.cohort_scan.clamp_state`)."""
    limits, _ = trim_scan(
        Cohort(global_state, states), floating_keys(global_state), k, TRIM_CHUNK, exact=False
    )
    out: Ranges = {}
    for key, (lo, hi) in limits.items():
        g = global_state[key].detach().to(torch.float64)
        out[key] = (lo.to(torch.float64) - g, hi.to(torch.float64) - g)
    return out


def cosine_scores(
    global_state: Mapping[str, Tensor], states: Sequence[Mapping[str, Tensor]]
) -> np.ndarray:
    """Each state's mean cosine similarity to the others, over the raw deltas
    ``theta_k - theta`` of every floating layer (fedkey.federation.strategies.outliers.mean_cosines): one
    pass for the norms ``||u_i||`` and ``V = sum_j u_j / ||u_j||``, one for ``u_i . V``, a phone
    at a time, in float32 arithmetic for a float32 model (fedkey.federation.influence.cohort_scan.cosine_scan)."""
    sq, dots = cosine_scan(Cohort(global_state, states), floating_keys(global_state))
    return mean_cosines(dots, np.sqrt(sq.sum(axis=1)))


def layer_norms(
    global_state: Mapping[str, Tensor], state: Mapping[str, Tensor]
) -> dict[str, float]:
    """L2 norm of each floating layer's delta ``state - global`` (float64)."""
    out: dict[str, float] = {}
    for k, g in global_state.items():
        if torch.is_floating_point(g):
            d = state[k].detach().to(torch.float64) - g.detach().to(torch.float64)
            out[k] = float(torch.linalg.vector_norm(d))
    return out


def whole_norm(norms: Mapping[str, float]) -> float:
    """The whole-model norm from the layers' norms."""
    return math.sqrt(sum(n * n for n in norms.values()))


def make_bound(
    config: InfluenceConfig,
    global_state: Mapping[str, Tensor],
    norms: Sequence[Mapping[str, float]],
    clip_norm: float | None = None,
) -> Bound | None:
    """The round's bound from the config and the updates' layer norms; ``clip_norm`` (the DP clip)
    overrides the config's mode with a fixed S. None when bounding is off."""
    if clip_norm is None and config.mode == "off":
        return None
    keys = [k for k, v in global_state.items() if torch.is_floating_point(v)]
    fixed = clip_norm if clip_norm is not None else config.norm
    if clip_norm is not None or config.mode == "fixed":
        if fixed is None:
            raise ValueError("a fixed clip needs its norm S")
        total = float(fixed)
        if config.scope == "layer":  # S_l proportional to sqrt(layer size): sum_l S_l^2 = S^2
            sizes = {k: global_state[k].numel() for k in keys}
            n = sum(sizes.values())
            layers = {k: total * math.sqrt(sizes[k] / n) for k in keys}
        else:
            layers = dict.fromkeys(keys, total)
    else:
        if not norms:
            raise ValueError("an adaptive bound needs the round's updates")
        mult = config.multiple
        if config.scope == "layer":
            layers = {
                k: max(mult * statistics.median(n[k] for n in norms), MIN_BOUND) for k in keys
            }
            total = whole_norm(layers)
        else:
            total = max(mult * statistics.median(whole_norm(n) for n in norms), MIN_BOUND)
            layers = dict.fromkeys(keys, total)
    return Bound(
        norm=max(total, MIN_BOUND),
        layers=layers,
        scope=config.scope,
        temperature=config.temperature,
    )


def clip_factors(norms: Mapping[str, float], bound: Bound) -> dict[str, float]:
    """Per layer, the factor its delta is multiplied by (1 when within the bound)."""
    if bound.scope == "layer":
        return {k: min(1.0, bound.layers[k] / n) if n > 0 else 1.0 for k, n in norms.items()}
    total = whole_norm(norms)
    factor = min(1.0, bound.norm / total) if total > 0 else 1.0
    return dict.fromkeys(norms, factor)


def scale_deltas(
    global_state: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    factors: Mapping[str, float],
    exact: bool = True,
    inplace: bool = False,
) -> dict[str, Tensor]:
    """``theta + f_l (theta_k^l - theta^l)`` per layer, in the client's dtypes: the clip (factors
    <= 1) and DP's Poisson rescaling. ``exact`` (DP, whose sensitivity analysis bounds the clipped
    norm): float64 arithmetic, one rounding; else ``torch.lerp`` in float32 (float64 for a float64
    layer), within two ulps of it at an eighth of the cost (0.4-0.5 ms a phone of 1.17M
    parameters against 3.3-4.3, timed by hand). Layers with factor 1 are the client's own
    tensors (no copy); entries without a factor are passed through. ``inplace``: the state's
    tensors are its own (fedkey.federation.influence.cohort_scan.load_state); a float32 layer of a float32 model is
    scaled where it is (the same numbers)."""
    out = dict(state)
    for k, f in factors.items():
        if f != 1.0:
            c = state[k].detach()
            if exact:
                g = global_state[k].detach().to(torch.float64)
                out[k] = (g + (c.to(torch.float64) - g) * f).to(c.dtype)
            else:
                g = global_state[k].detach()
                wide = torch.promote_types(torch.promote_types(c.dtype, g.dtype), torch.float32)
                if inplace and c.dtype == g.dtype == wide:
                    out[k] = torch.lerp(g, c, f, out=c)
                else:
                    out[k] = torch.lerp(g.to(wide), c.to(wide), f).to(c.dtype)
    return out


def distance_caps(
    norms: Sequence[Mapping[str, float]], factors: Sequence[Mapping[str, float]], k: int
) -> dict[str, float]:
    """Per layer, the (k+1)-th largest bounded distance ``f_i^l ||u_i^l||`` of the round: what
    FedAtt's winsorized attention counts at most (:class:`fedkey.federation.strategies.Bound`)."""
    out: dict[str, float] = {}
    for key in norms[0]:
        bounded = sorted(
            (n[key] * f[key] for n, f in zip(norms, factors, strict=True)), reverse=True
        )
        out[key] = bounded[k]
    return out


def weight_cap(samples: Sequence[int], multiple: float) -> int:
    """The largest n_k counted: ``multiple`` times the median declared n_k (at least 1)."""
    return max(1, int(multiple * statistics.median(samples)))


def clip_fields(
    bound: Bound, factors: Sequence[Mapping[str, float]], samples: Sequence[int], multiple: float
) -> dict:
    """What a row's ``info.clip`` says of a round's bound: its scope and norm, how many updates
    it clipped (``factors``: each update's clip factors), and the weight cap of the declared
    n_k ``samples`` (``multiple`` times their median) with how many it capped."""
    cap = weight_cap(samples, multiple) if samples else 1
    return {
        "scope": bound.scope,
        "norm": bound.norm,
        "clipped": sum(any(f < 1.0 for f in fs.values()) for fs in factors),
        "weight_cap": cap,
        "capped_weights": sum(n > cap for n in samples),
    }


class ClippedRound(Protocol):
    """What DP's noise and clip rule read of a round's clipped updates
    (fedkey.federation.privacy): its bound, each update's whole-model norm before the clip, and
    how many there are. A :class:`BoundedRound`, or a round summed where its phones trained
    (fedkey.federation.updates.summed.SummedRound)."""

    @property
    def bound(self) -> Bound | None: ...

    @property
    def norms(self) -> list[float]: ...

    def __len__(self) -> int: ...


@dataclass
class BoundedRound:
    """A round's updates as the strategy sees them: trimmed and clipped (lazily, one at a time)
    and weighted."""

    global_state: Mapping[str, Tensor]
    updates: Sequence[ClientUpdate]
    bound: Bound | None
    factors: list[dict[str, float]]
    samples: list[int]
    info: dict
    limits: Limits | None = None  # the coordinate trim's range of values, when it applies
    exact: bool = True  # the clip in float64 (DP); else in float32 (scale_deltas)
    norms: list[float] = field(default_factory=list)  # each update's whole-model norm (trimmed)
    layer_norms: list[dict[str, float]] = field(default_factory=list)  # the same, per layer
    cohort: Cohort | None = field(default=None, repr=False)  # the updates' readers, for sums

    def distances(self) -> list[dict[str, float]] | None:
        """Each update's bounded layer distances ``f_k^l ||u_k^l||`` (its trimmed layer norm
        times its clip factor: what FedAtt scores), where :meth:`weighted_sum` applies. None
        where it does not: under DP (its clip in float64, an update at a time), with no
        updates, or where some update's layer is not in the model's dtype (bfloat16: the
        iterated clip rounds to it) or shape; the strategy then iterates the round."""
        cohort = self.cohort
        if self.exact or cohort is None or not self.updates:
            return None
        if not all(cohort.native(k) for k in floating_keys(self.global_state)):
            return None
        return [
            {k: n * f[k] for k, n in norms.items()}
            for norms, f in zip(self.layer_norms, self.factors, strict=True)
        ]

    def weighted_sum(self, coefs: Sequence[Mapping[str, float]]) -> dict[str, Tensor]:
        """Per floating layer, ``sum_k c_k^l u_k^l`` over the bounded deltas (trimmed, then
        clipped) with ``coefs[k][l]`` = ``c_k^l``, in float64, from one read of the updates
        (fedkey.federation.influence.cohort_scan.weighted_scan) instead of :meth:`__iter__`'s update at a time: the
        clip's factor goes into the coefficient, ``f (t - theta)`` summed as ``sum_k c_k f_k
        t_k - (sum_k c_k f_k) theta``. The iterated clip rounds each clipped update to float32
        (one ulp of the weights, :func:`scale_deltas`) and sums the deltas; this sum rounds
        once, in float64: the two agree to float32 rounding (tests/federation/influence/test_cohort_scan.py).
        Only where :meth:`distances` is not None."""
        if self.cohort is None:
            raise ValueError("no fused read for this round: iterate it")
        keys = floating_keys(self.global_state)
        scaled = np.array(
            [[c[k] * f[k] for k in keys] for c, f in zip(coefs, self.factors, strict=True)],
            dtype=np.float64,
        ).reshape(len(self.factors), len(keys))
        sums = weighted_scan(self.cohort, keys, self.limits, scaled)
        out: dict[str, Tensor] = {}
        for j, key in enumerate(keys):
            g = self.global_state[key].detach().to(torch.float64)
            total = math.fsum(scaled[:, j].tolist())
            out[key] = torch.from_numpy(sums[key]).reshape(g.shape) - total * g
        return out

    def __iter__(self) -> Iterator[ClientUpdate]:
        """The bounded updates; iterable more than once (each pass trims and clips again)."""
        for u, f, n in zip(self.updates, self.factors, self.samples, strict=True):
            own = load_state(u.state, self.global_state)  # a stored upload: read once, whole
            state = clamp_state(u.state if own is None else own, self.limits, own is not None)
            state = scale_deltas(self.global_state, state, f, self.exact, own is not None)
            yield replace(u, state=state, num_samples=n)

    def __len__(self) -> int:
        return len(self.updates)


def bound_round(
    config: InfluenceConfig,
    global_state: Mapping[str, Tensor],
    updates: Sequence[ClientUpdate],
    clip_norm: float | None = None,
    uniform: bool = False,
) -> BoundedRound:
    """Measure the updates, fix the round's bound, and return them ready to aggregate.

    ``clip_norm``: the DP clip (a fixed S whatever the mode). ``uniform``: every weight n_k = 1
    (DP: the declared counts are private data and the mean's analysis assumes equal weights).
    The cosine outlier filter comes first (the rejected updates are not aggregated), then the
    coordinate trim, and the clip bounds the trimmed deltas. ``info`` reports the rejected
    phones (device id -> modified z-score), the kept phones' cosine scores, the trim, the
    bound, how many updates it clipped and the (trimmed) norms' median and maximum.
    """
    dp = clip_norm is not None
    cut = config.outlier_z_for(dp=dp)
    keys = floating_keys(global_state)
    cohort = Cohort(global_state, [u.state for u in updates])
    filtered: dict = {}
    raw: np.ndarray | None = None  # the kept phones' squared layer norms before any trim
    if cut > 0 and len(updates) > 1:
        raw, dots = cosine_scan(cohort, keys)
        scores = mean_cosines(dots, np.sqrt(raw.sum(axis=1)))
        z = modified_z(scores)
        out = set(reject_outliers(scores, cut))
        kept = [i for i in range(len(updates)) if i not in out]
        filtered = {
            "outlier_z": cut,
            "outliers": {updates[i].device_id: round(float(z[i]), 2) for i in sorted(out)},
            "cosine_median": float(np.median(scores)),
            "cosine_kept": [float(scores[kept].min()), float(scores[kept].max())],
            "cosine_outliers": {updates[i].device_id: float(scores[i]) for i in sorted(out)},
        }
        if out:
            updates, raw = [updates[i] for i in kept], raw[kept]
            cohort = Cohort(global_state, [u.state for u in updates])
    k = trim_count(config.trim_for(dp=dp), len(updates))
    limits: Limits | None = None
    if k:  # the trim's range and the trimmed norms, from one read of the kept phones
        threads = torch.get_num_threads()  # the aggregation's compute threads
        limits, sq = trim_scan(cohort, keys, k, TRIM_CHUNK, exact=dp, threads=threads)
    elif raw is not None and not dp:  # the filter's pass measured the norms already
        sq = raw
    else:
        sq = norm_scan(cohort, keys, exact=dp)
    norms = [dict(zip(keys, np.sqrt(row).tolist(), strict=True)) for row in sq]
    bound = make_bound(config, global_state, norms, clip_norm)
    samples = [int(u.num_samples) for u in updates]
    if uniform:
        samples = [1] * len(samples)
    whole = [whole_norm(n) for n in norms]
    info: dict = {
        "mode": "dp" if clip_norm is not None else config.mode,
        "median_norm": statistics.median(whole) if whole else None,
        "max_norm": max(whole, default=None),
        "trimmed": k,  # values clamped at each end of every coordinate
        "outliers": {},  # the cosine filter's rejections: device id -> modified z-score
        **filtered,
    }
    if bound is None:
        factors = [dict.fromkeys(n, 1.0) for n in norms]
    else:
        factors = [clip_factors(n, bound) for n in norms]
        info.update(clip_fields(bound, factors, samples, config.weight_cap))
        samples = [min(n, info["weight_cap"]) for n in samples]
        if k:
            bound = replace(bound, distance_caps=distance_caps(norms, factors, k))
    return BoundedRound(
        global_state,
        updates,
        bound,
        factors,
        samples,
        info,
        limits,
        exact=dp,
        norms=whole,
        layer_norms=norms,
        cohort=cohort,
    )
