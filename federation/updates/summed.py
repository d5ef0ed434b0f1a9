"""A round summed where its phones trained: FedAvg, DP-FedAvg and DP-FedAtt without a per-phone
upload.

FedAvg's next model is ``theta + sum_k w_k u_k / sum_k w_k`` (``u_k = theta_k - theta``, ``w_k =
n_k``, or 1 unweighted). Where nothing needs a phone's update on its own (no trim or outlier
filter; a selector that does not read the updates after the round), a trainer can add each
phone's weighted delta to a running float64 sum as the phone finishes and drop it: a worker then
returns one model-sized :class:`PartialSum` for its share of the cohort instead of a model per
phone, and memory does not grow with the cohort (the way pfl-research's workers and a production
server's secure aggregation combine a cohort).

Without DP that needs ``--bound off``. Under DP (DP-FedAvg, DP-FTRL) the round's clip is known
before it starts (S, or adaptive clipping's C_t): each delta is clipped to it where the phone
trained, ``f_k u_k`` with ``f_k = min(1, C / ||u_k||)`` (fedkey.federation.influence.bounding.
clip_factors), every weight 1 (McMahan et al. 2018's uniform mean), and each phone's norm before
the clip is kept for adaptive clipping's count; the server adds the noise to the mean as it does
to the per-phone path's (fedkey.federation.privacy). The sum over clipped deltas is what the
accountant covers: nothing per phone is published. The bound also makes FedAtt's fixed
normalizer summable (Ji et al. 2019, eq. 4 over the count m: fedkey.federation.strategies.
aggregate.fedatt_fixed): layer l of phone k weighs ``a_k^l = exp(||f_k u_k^l|| / (T S_l) - 1/T)``,
its own delta's alone, and the step is ``epsilon (1/m) sum_k a_k^l f_k u_k^l``.

    partial = PartialSum.empty(global_state, federation.sum_rule())
    for device, result in trained:                 # a worker's phones, in a fixed order
        partial.add(device, result, global_state)  # its delta added, its state dropped
    summed = SummedRound.of([partial, ...])        # the workers' partials, in order
    Federation.complete_summed_round(plan, summed)

:class:`SummedRound` is a :class:`fedkey.federation.strategies.SummableRound`: FedAvg's
``_aggregate_sum`` reads its per-phone distances and asks for the weighted sum with its own
weights, which are checked against the ones summed. Each phone's state is checked as an upload
is (non-finite -> refused, named, left out of the sum).

Precision: each delta is formed, clipped and accumulated in float64 (as the per-phone path's
fused read, fedkey.federation.influence.cohort_scan.weighted_scan) and rounded once to the model's
dtype; the sums run in another order (a worker's phones, then the workers'), and the per-phone
DP path rounds each clipped update to the model's dtype first, so the two paths agree to float32
rounding (tests/federation/updates/test_summed.py), and a run is deterministic for a given
number of workers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedkey.federation.influence.bounding import clip_factors, clip_fields, whole_norm
from fedkey.federation.strategies import Bound, ClientUpdate
from fedkey.federation.strategies.aggregate import (
    capped_logit_scale,
    fixed_weight,
    floating_keys,
)
from fedkey.federation.updates.validation import ValidationError, check_finite

if TYPE_CHECKING:
    from fedkey.federation.config import FederationConfig
    from fedkey.federation.strategies.base import Strategy

#: Relative difference allowed between a strategy's coefficient and the summed weight's share.
COEF_TOLERANCE = 1e-9


@dataclass(frozen=True)
class SumRule:
    """How a round's phones are summed: each delta weighted by its n_k or by 1, and clipped to
    DP's `bound` first (None: not clipped); with `attention`, each layer also weighted by FedAtt's
    fixed-normalizer weight ``exp(||f u^l|| / (T S_l) - 1/T)``
    (fedkey.federation.strategies.aggregate.fedatt_fixed), which the bound makes a function of
    the phone's own delta alone."""

    weighted: bool
    bound: Bound | None = None
    attention: bool = False


@dataclass
class PhoneRecord:
    """What a summed round keeps of one phone: no weights, only what the row and FedAvg read."""

    device_id: str
    num_tokens: int  # n_k, as the phone declares it
    train_loss: float
    weight: float  # w_k summed: n_k, or 1 unweighted
    layer_norms: dict[str, float]  # ||u_k^l||, float64, before any clip
    factors: dict[str, float] = field(default_factory=dict)  # the clip's f_k^l (none: 1)
    layer_weights: dict[str, float] = field(default_factory=dict)  # attention's a_k^l (none: 1)

    @property
    def norm(self) -> float:
        """||u_k||, the whole delta's norm before the clip (as the per-phone path measures it)."""
        return whole_norm(self.layer_norms)


@dataclass
class PartialSum:
    """``sum_k w_k f_k u_k`` per floating layer (float64) over some phones, and their records.
    `rejected`: phones whose state was refused (device -> the 422 reason), not in the sum."""

    rule: SumRule
    sums: dict[str, Tensor] = field(default_factory=dict)
    phones: list[PhoneRecord] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, global_state: Mapping[str, Tensor], rule: SumRule) -> PartialSum:
        sums = {
            k: torch.zeros(global_state[k].shape, dtype=torch.float64)
            for k in floating_keys(global_state)
        }
        return cls(rule, sums)

    @property
    def weighted(self) -> bool:
        return self.rule.weighted

    def add(
        self,
        device_id: str,
        state: Mapping[str, Tensor],
        num_tokens: int,
        train_loss: float,
        global_state: Mapping[str, Tensor],
    ) -> None:
        """Add one phone's trained `state` (checked as an upload: a refusal is recorded).
        `global_state`: the round's weights, best as :func:`widened` gives them once a round
        (already float64, they are not converted again for every phone)."""
        try:
            check_finite(dict(state))
        except ValidationError as e:
            self.rejected[device_id] = f"{e.status} {e.message}"
            return
        w = float(num_tokens) if self.weighted else 1.0
        bound = self.rule.bound
        norms: dict[str, float] = {}
        deltas: dict[str, Tensor] = {}  # kept only when a clip needs every layer's norm first
        for k, acc in self.sums.items():
            u = state[k].detach().to(torch.float64) - global_state[k].detach().to(torch.float64)
            norms[k] = float(torch.linalg.vector_norm(u))
            if bound is None:
                acc.add_(u, alpha=w)
            else:
                deltas[k] = u
        factors = {} if bound is None else clip_factors(norms, bound)
        layer_weights: dict[str, float] = {}
        if self.rule.attention and bound is not None:
            # FedAtt's own scale and weight (its server-side check computes the same floats)
            scale, ceiling = (
                capped_logit_scale(bound.layers, bound.temperature),
                1.0 / bound.temperature,
            )
            layer_weights = {
                k: fixed_weight(n * factors[k] * scale[k], ceiling) for k, n in norms.items()
            }
        for k, u in deltas.items():
            self.sums[k].add_(u, alpha=w * factors[k] * layer_weights.get(k, 1.0))
        record = PhoneRecord(
            device_id, int(num_tokens), float(train_loss), w, norms, factors, layer_weights
        )
        self.phones.append(record)

    @classmethod
    def combined(cls, parts: Sequence[PartialSum]) -> PartialSum:
        """The parts added in the order given, into the first (at least one part)."""
        first, *rest = parts
        for p in rest:
            first.merge(p)
        return first

    def merge(self, other: PartialSum) -> None:
        """Add `other`'s phones (after this one's: the order the floats are summed in)."""
        if other.rule != self.rule:
            raise ValueError(f"cannot merge sums of two rules ({self.rule} and {other.rule})")
        for k, acc in self.sums.items():
            acc.add_(other.sums[k])
        self.phones.extend(other.phones)
        self.rejected.update(other.rejected)


def widened(global_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The floating layers of a round's weights in float64: what :meth:`PartialSum.add`
    subtracts from every phone's, converted once."""
    return {k: global_state[k].detach().to(torch.float64) for k in floating_keys(global_state)}


def can_sum(config: FederationConfig, strategy: Strategy) -> bool:
    """Whether this federation's rounds can be summed where the phones train: the strategy's
    next model is one weighted sum whose weights each phone can compute alone (FedAvg's mean,
    FedSGD; under DP also FedAtt with the fixed normalizer and L2 distances, its weights a
    function of the phone's own clipped delta), nothing needs each update (no trim or outlier
    filter: bounding off, or DP's clip alone; a selector that does not read the updates after
    the round), every trained phone uploading."""
    from fedkey.federation.strategies.base import Strategy

    influence, dp = config.influence, config.privacy.dp
    per_phone = influence.trim_for(dp) > 0 or influence.outlier_z_for(dp) > 0
    return (
        _summable_strategy(strategy, dp)
        and not strategy.needs_second_pass
        and type(strategy).select_uploaders is Strategy.select_uploaders
        and (not per_phone if dp else influence.mode == "off")
    )


def _summable_strategy(strategy: Strategy, dp: bool) -> bool:
    from fedkey.federation.strategies.methods import FedAtt, FedAvg

    if isinstance(strategy, FedAvg):
        return True
    fixed_l2 = (
        isinstance(strategy, FedAtt) and strategy.normalizer == "fixed" and strategy.norm == "l2"
    )
    return dp and fixed_l2  # the weights need the public bound that DP's clip gives


def sum_rule(strategy: Strategy, bound: Bound | None) -> SumRule:
    """How a summable strategy's (:func:`can_sum`) rounds are summed: by n_k where it weights
    (else by 1), and under DP (a `bound`: the round's clip) clipped, every weight 1, FedAtt's
    layers weighted by its fixed-normalizer weights."""
    from fedkey.federation.strategies.methods import FedAtt, FedAvg

    if isinstance(strategy, FedAvg):
        return SumRule(weighted=strategy.weighted and bound is None, bound=bound)
    if isinstance(strategy, FedAtt) and _summable_strategy(strategy, bound is not None):
        return SumRule(weighted=False, bound=bound, attention=True)
    raise ValueError(f"strategy {strategy.name!r} cannot be summed where the phones train")


class SummedRound:
    """A round's phones as one sum: a :class:`fedkey.federation.strategies.SummableRound` whose
    weighted sum exists only for the weights it was summed with (FedAvg's)."""

    def __init__(self, partial: PartialSum) -> None:
        if not partial.phones:
            raise ValueError("no phone's update was summed")
        partial.phones.sort(key=lambda p: p.device_id)  # the rows' order (not the sum's)
        self.partial = partial
        self.updates: Sequence[ClientUpdate] = [
            ClientUpdate({}, p.num_tokens, p.train_loss, p.device_id) for p in partial.phones
        ]
        # The n_k the strategy weights by: 1 each where the sum is unweighted (DP's uniform mean)
        self.samples = [p.num_tokens if partial.weighted else 1 for p in partial.phones]
        self.total = math.fsum(p.weight for p in partial.phones)

    @classmethod
    def of(cls, partials: Sequence[PartialSum]) -> SummedRound:
        """The workers' partial sums, merged in the order given."""
        return cls(PartialSum.combined(partials))

    @property
    def device_ids(self) -> list[str]:
        return [p.device_id for p in self.partial.phones]

    @property
    def rejected(self) -> dict[str, str]:
        return dict(self.partial.rejected)

    @property
    def bound(self) -> Bound | None:
        """The clip every summed delta satisfies (DP's), or None."""
        return self.partial.rule.bound

    @property
    def norms(self) -> list[float]:
        """Each phone's whole-model update norm before the clip (adaptive clipping counts them)."""
        return [p.norm for p in self.partial.phones]

    def distances(self) -> list[dict[str, float]]:
        """Each phone's layer distances as summed: ``f_k^l ||u_k^l||``."""
        return [
            {k: n * p.factors.get(k, 1.0) for k, n in p.layer_norms.items()}
            for p in self.partial.phones
        ]

    def weighted_sum(self, coefs: Sequence[Mapping[str, float]]) -> dict[str, Tensor]:
        """``sum_k c_k u_k``, where every ``c_k^l`` is ``w_k a_k^l / sum_j w_j`` (the weights
        summed, ``a_k^l`` attention's or 1); a ValueError for any other coefficients: the
        phones' updates are gone."""
        if len(coefs) != len(self.partial.phones):
            raise ValueError(f"{len(coefs)} coefficients for {len(self.partial.phones)} phones")
        for p, c in zip(self.partial.phones, coefs, strict=True):
            for k, v in c.items():
                share = p.weight * p.layer_weights.get(k, 1.0) / self.total
                if abs(v - share) > COEF_TOLERANCE * max(share, 1e-300):
                    raise ValueError(
                        f"phone {p.device_id!r}: coefficient {v} of layer {k!r} is not the "
                        f"summed weight's share {share}: a summed round has no per-phone updates"
                    )
        return {k: s / self.total for k, s in self.partial.sums.items()}

    def info(self, weight_cap: float) -> dict[str, Any]:
        """The row's ``info.clip``, as fedkey.federation.influence.bounding.bound_round reports
        bounding off, or DP's clip (`weight_cap`: the influence config's multiple)."""
        whole = self.norms
        info: dict[str, Any] = {
            "mode": "off" if self.bound is None else "dp",
            "median_norm": statistics.median(whole),
            "max_norm": max(whole),
            "trimmed": 0,
            "outliers": {},
        }
        if self.bound is not None:
            factors = [p.factors for p in self.partial.phones]
            info.update(clip_fields(self.bound, factors, self.samples, weight_cap))
        return info

    def __iter__(self):  # a SummableRound is also iterable; this one cannot give the updates
        raise ValueError("a summed round has no per-phone updates to iterate")

    def __len__(self) -> int:
        return len(self.partial.phones)
