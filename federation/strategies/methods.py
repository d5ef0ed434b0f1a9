"""The aggregation strategies: FedSGD, FedAvg, AdaFL (FedAvg + AdaFL selection), FedAtt,
FedAttOpt and FedMed. Thin wrappers over :mod:`fedkey.federation.strategies.aggregate`."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

from torch import Tensor

from fedkey.federation.strategies import sensitivity
from fedkey.federation.strategies.aggregate import (
    NORMALIZERS,
    NORMS,
    AttOptGradient,
    LayerwiseAttention,
    StateDict,
    WeightedAverage,
    attopt_step_scale,
    capped_logit_scale,
    floating_keys,
    num_parameters,
    step_by,
)
from fedkey.federation.strategies.base import Bound, ClientUpdate, Info, Strategy, SummableRound
from fedkey.federation.strategies.selection import top_k_lowest


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number, got {value}")
    return value


def _attention_summary(weights: list[tuple[Hashable, dict[str, float]]]) -> Info:
    """Per client: its attention weight averaged over layers, and the largest weight seen."""
    mean = {str(tag): sum(w.values()) / len(w) for tag, w in weights if w}
    top = max((max(w.values()) for _, w in weights if w), default=0.0)
    return {"attention_mean": mean, "attention_max": top}


def _cap(m: int, rho: float) -> float:
    """The largest attention weight the cap allows one of ``m`` phones."""
    return sensitivity.attention_max_weight(m, rho)


class FedAvg(Strategy):
    """FedAvg (McMahan et al.): uniform sampling of a fraction C, ``theta = sum_k n_k/n theta_k``.

    ``weighted=False`` averages uniformly (what DP-FedAvg's noise calibration assumes).
    """

    name = "fedavg"

    def __init__(self, *, weighted: bool = True, **selection: Any) -> None:
        super().__init__(**selection)
        self.weighted = bool(weighted)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "weighted": self.weighted}

    def _aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Iterator[ClientUpdate],
        bound: Bound | None,
    ) -> tuple[StateDict, Info]:
        acc = WeightedAverage(global_state)
        weights: dict[str, float] = {}
        for u in updates:
            w = float(u.num_samples) if self.weighted else 1.0
            acc.add(u.state, w)
            weights[u.device_id] = w
        return acc.result(), self._info(acc.count, acc.total_weight, weights)

    def _aggregate_sum(
        self, global_state: Mapping[str, Tensor], updates: SummableRound, bound: Bound | None
    ) -> tuple[StateDict, Info] | None:
        """``theta + sum_k (w_k / sum_j w_j) u_k`` from one weighted sum of the bounded deltas:
        the same weights as :meth:`_aggregate`, checked the same way."""
        if updates.distances() is None:
            return None
        check = WeightedAverage(global_state)  # its checks of the weights, and their sum
        weights: dict[str, float] = {}
        ws = []
        for u, n in zip(updates.updates, updates.samples, strict=True):
            w = float(n) if self.weighted else 1.0
            check.add_deltas({}, w)
            weights[u.device_id] = w
            ws.append(w)
        total = check.total_weight
        if total <= 0.0:
            raise ValueError("total weight is zero: cannot average")
        keys = floating_keys(global_state)
        sums = updates.weighted_sum([dict.fromkeys(keys, w / total) for w in ws])
        return step_by(global_state, sums), self._info(check.count, total, weights)

    def _info(self, count: int, total: float, weights: dict[str, float]) -> Info:
        """The round's info: the updates' normalized weights."""
        return {
            "strategy": self.name,
            "mode": "fedavg",
            "num_updates": count,
            "total_weight": total,
            "weights": {k: w / total for k, w in weights.items()},
        }

    def sensitivity(self, global_state: Mapping[str, Tensor], bound: Bound, m: int) -> float:
        """The uniform mean's ``2 S / m`` (the engine gives every update weight 1 under DP)."""
        return sensitivity.mean_sensitivity(m, bound.norm)


class FedSGD(FedAvg):
    """FedSGD baseline: every available client, one local epoch, average weighted by n_k.

    Takes no options. ``fraction`` is accepted (engines pass it to every strategy) and ignored:
    FedSGD is defined by C = 1. The engine must read :attr:`local_epochs_override` (= 1) and
    train one epoch.
    """

    name = "fedsgd"
    local_epochs_override = 1

    def __init__(self, *, fraction: float | None = None) -> None:
        super().__init__(weighted=True, fraction=1.0, selector="uniform")
        self.requested_fraction = fraction

    def config(self) -> dict[str, Any]:
        return {"fraction": 1.0, "weighted": True, "local_epochs": 1}


class AdaFL(FedAvg):
    """AdaFL as published (Chen et al.): FedAvg aggregation with the AdaFL selector.

    The same as ``get_strategy("fedavg", selector="adafl")``; any other strategy can use the AdaFL
    selector the same way.
    """

    name = "adafl"

    def __init__(self, *, weighted: bool = True, selector: str = "adafl", **selection: Any) -> None:
        super().__init__(weighted=weighted, selector=selector, **selection)


class FedAtt(Strategy):
    """FedAtt (Ji et al. 2019): layer-wise attention ``softmax_k ||w^l - w_k^l||`` and a server step epsilon.

    epsilon: server step size, default 1.2 (the published code and the Plato framework's FedAtt).
    norm: ``"l2"`` (flattened L2, default, Plato) or ``"spectral"`` (largest singular value for
      matrices, as the original scipy-based code).
    normalizer: ``"softmax"`` (eq. 4 as published: the weights sum to 1 over the cohort) or
      ``"fixed"`` (:func:`fedkey.federation.strategies.aggregate.fedatt_fixed`: the same relative weights,
      each ``exp(logit - 1/T) <= 1``, over the cohort's count m; under DP its sensitivity is
      DP-FedAvg's ``2 S / m`` times epsilon, where the softmax's is 4.6x that at m = 30, T = 1
      under the model scope).
    """

    name = "fedatt"

    def __init__(
        self,
        *,
        epsilon: float = 1.2,
        norm: str = "l2",
        normalizer: str = "softmax",
        **selection: Any,
    ) -> None:
        super().__init__(**selection)
        self.epsilon = _positive("epsilon", epsilon)
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; use one of {NORMS}")
        self.norm = norm
        if normalizer not in NORMALIZERS:
            raise ValueError(f"unknown normalizer {normalizer!r}; use one of {NORMALIZERS}")
        self.normalizer = normalizer

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "epsilon": self.epsilon,
            "norm": self.norm,
            "normalizer": self.normalizer,
        }

    def _aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Iterator[ClientUpdate],
        bound: Bound | None,
    ) -> tuple[StateDict, Info]:
        att = self._attention(global_state, bound)
        for u in updates:
            att.add(u.state, tag=u.device_id)
        if self.normalizer == "fixed":
            new = att.fixed_result(self.epsilon, _ceiling(att, bound))
        else:
            new = att.result(self.epsilon)
        return new, self._info(att, bound)[0]

    def _aggregate_sum(
        self, global_state: Mapping[str, Tensor], updates: SummableRound, bound: Bound | None
    ) -> tuple[StateDict, Info] | None:
        """The same step from one weighted sum of the bounded deltas: the attention's scores
        are the bounded layer distances the bound measured (its L2 norms: not with the spectral
        norm), so its weights are known before the deltas are read."""
        distances = updates.distances() if self.norm == "l2" else None
        if distances is None:
            return None
        att = self._attention(global_state, bound)
        for u, d in zip(updates.updates, distances, strict=True):
            att.add_scores(d, tag=u.device_id)
        info, weights = self._info(att, bound)
        sums = updates.weighted_sum([w for _, w in weights])
        return step_by(global_state, sums, self.epsilon), info

    def _attention(
        self, global_state: Mapping[str, Tensor], bound: Bound | None
    ) -> LayerwiseAttention:
        """The round's attention: its logits scaled by the bound and, under the trim, the
        distances winsorized at the bound's caps."""
        scale = cap = None
        if bound is not None:  # logits ||u^l|| / (T S_l) in [0, 1/T]: weights capped
            scale = capped_logit_scale(bound.layers, bound.temperature)
            if self.norm == "l2":  # the caps are order statistics of the L2 distances
                cap = bound.distance_caps
        scorer = LayerwiseAttention.fedatt_scorer(self.norm)
        return LayerwiseAttention(global_state, scorer, scale, cap)

    def _info(
        self, att: LayerwiseAttention, bound: Bound | None
    ) -> tuple[Info, list[tuple[Hashable, dict[str, float]]]]:
        """The round's info, and each update's layer weights in the step ``theta + epsilon
        sum_k w_k^l u_k^l``: the softmax's, or the fixed normalizer's ``exp(s - c) / m``."""
        info: Info = {
            "strategy": self.name,
            "mode": "fedatt",
            "num_updates": att.count,
            "epsilon": self.epsilon,
        }
        if self.normalizer == "fixed":
            ceiling = _ceiling(att, bound)
            weights = [
                (t, {k: x / att.count for k, x in w.items()}) for t, w in att.fixed_weights(ceiling)
            ]
            info.update(_attention_summary(weights))
            info["attention_cap"] = 1.0 / att.count  # every w <= 1
            info["attention_scale"] = att.fixed_scale(ceiling)
        else:
            weights = att.weights()
            info.update(_attention_summary(weights))
            if bound is not None:
                info["attention_cap"] = _cap(att.count, math.exp(1.0 / bound.temperature))
        if att.score_cap is not None:
            info["winsorized_scores"] = att.capped
        return info, weights

    def sensitivity(self, global_state: Mapping[str, Tensor], bound: Bound, m: int) -> float:
        """``epsilon`` times the attention bound with ``rho = e^(1/T)`` (the spectral norm is at
        most the L2 norm, so the logits stay in [0, 1/T] with either norm); with the fixed
        normalizer ``epsilon`` times DP-FedAvg's ``2 S / m``."""
        if self.normalizer == "fixed":
            return self.epsilon * sensitivity.fixed_attention_sensitivity(m, bound.norm)
        rho = math.exp(1.0 / bound.temperature)
        return self.epsilon * sensitivity.attention_sensitivity(m, bound.norm, rho, bound.scope)


class FedAttOpt(Strategy):
    """FedAttOpt (Jiang et al. 2020): one exact gradient step on ``L' = sum_k (log a_k + log d_k)``.

    epsilon: server step size. The FedAttOpt paper gives no value; the default 1.2 is the authors'
    published FedAtt default (FedAtt's code and Plato's). Note the step is not scale-free: the distance term moves theta
    towards each theta_k by the fraction ``epsilon / d_k^2`` of the way, so epsilon should be tuned
    to the typical squared update norm of the model at hand (the info's ``"distance"``); the
    info's ``"step_scale"`` says how far a round went against FedAvg's 1
    (aggregate.attopt_step_scale). max_reach: at most that far (None: the paper's step).
    """

    name = "fedattopt"

    def __init__(
        self,
        *,
        epsilon: float = 1.2,
        distance_floor: float = 0.25,
        max_reach: float | None = None,
        **selection: Any,
    ) -> None:
        super().__init__(**selection)
        self.epsilon = _positive("epsilon", epsilon)
        # Under a clip S, distances below distance_floor * S count as that (bounded influence).
        self.distance_floor = _positive("distance_floor", distance_floor)
        # fedkey's guard, not the paper's: a round whose reach (aggregate.attopt_step_scale)
        # would pass max_reach x FedAvg's steps that far instead (epsilon scaled down for it).
        # The reach grows as 1 / d^2 while the phones' updates shrink with training: at a fixed
        # epsilon one round can throw the model to a perplexity of 1e60 (fedkey_bench.attopt_step).
        self.max_reach = None if max_reach is None else _positive("max_reach", max_reach)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "epsilon": self.epsilon, "distance_floor": self.distance_floor,
                "max_reach": self.max_reach}  # fmt: skip

    def _aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Iterator[ClientUpdate],
        bound: Bound | None,
    ) -> tuple[StateDict, Info]:
        floor = self.distance_floor * bound.norm if bound is not None else 0.0
        acc = AttOptGradient(global_state, distance_floor=floor)
        for u in updates:
            acc.add(u.state, tag=u.device_id)
        grad = acc.gradient()
        grad_norm = math.sqrt(sum(float(g.square().sum()) for g in grad.values()))
        reach = attopt_step_scale(self.epsilon, (d for _, _, d in acc.records), floor)
        step = self.epsilon
        if self.max_reach is not None and reach > self.max_reach:
            step = self.epsilon * self.max_reach / reach
        new = acc.result(step, grad)
        loss = acc.loss()
        info: Info = {
            "strategy": self.name,
            "mode": "fedattopt",
            "num_updates": acc.count,
            "epsilon": self.epsilon,
            "attention": {str(t): a for t, a in acc.attention()},
            "distance": {str(t): d for t, _, d in acc.records},
            # against FedAvg's 1: the step's reach this round (moves as 1 / d_k^2), and where
            # max_reach cut it, the paper's step's
            "step_scale": reach * step / self.epsilon,
            **({"capped_from": reach} if step < self.epsilon else {}),
            "loss": loss if math.isfinite(loss) else None,
            "grad_norm": grad_norm,
            "zero_distance": acc.zero_distance,
        }
        return new, info

    def sensitivity(self, global_state: Mapping[str, Tensor], bound: Bound, m: int) -> float:
        n = num_parameters(global_state)
        theta = math.sqrt(
            sum(float(global_state[k].double().square().sum()) for k in floating_keys(global_state))
        )
        return sensitivity.attopt_sensitivity(
            m, bound.norm, n, theta, self.distance_floor, self.epsilon
        )


class FedMed(Strategy):
    """FedMed (Wu et al. 2020): adaptive JS-attention aggregation, the mediation incentive scheme, topK.

    eta: server step of the adaptive aggregation (1.0: a gamma-weighted average).
    epsilon_med: the mediator's threshold. With ``L_t`` the mean reported train loss of the
      round's updates and ``Delta = |L_t - L_{t-1}|``, the round is adaptive if
      ``Delta >= epsilon_med`` and FedAvg (weighted by n_k, Algorithm 1) otherwise. The first
      round (no previous loss) is adaptive. Both results are accumulated in the single pass over
      the updates; the choice is made at the end.
    beta: topK fraction; of the M devices that report a loss, the ``max(1, round(beta M))`` with
      the lowest loss upload. 1.0 (default) turns topK off; 0.8 was best in the FedMed paper.
    """

    name = "fedmed"

    def __init__(
        self,
        *,
        eta: float = 1.0,
        epsilon_med: float = 0.1,
        beta: float = 1.0,
        **selection: Any,
    ) -> None:
        super().__init__(**selection)
        self.eta = _positive("eta", eta)
        self.epsilon_med = float(epsilon_med)
        if not self.epsilon_med >= 0:
            raise ValueError(f"epsilon_med must be >= 0, got {epsilon_med}")
        if not 0.0 < float(beta) <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.beta = float(beta)
        self.prev_loss: float | None = None

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "eta": self.eta,
            "epsilon_med": self.epsilon_med,
            "beta": self.beta,
        }

    def select_uploaders(self, round_idx: int, losses: Mapping[str, float]) -> list[str]:
        """topK: the devices with the lowest reported losses (ties by device id)."""
        if self.beta >= 1.0:
            return sorted(losses)
        return top_k_lowest(losses, self.beta)

    def _aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Iterator[ClientUpdate],
        bound: Bound | None,
    ) -> tuple[StateDict, Info]:
        scale = None
        if bound is not None:  # JS in [0, ln 2]: logits JS / T, weights differ by <= 2^(1/T)
            scale = dict.fromkeys(bound.layers, 1.0 / bound.temperature)
        att = LayerwiseAttention(global_state, LayerwiseAttention.fedmed_scorer(), scale)
        avg = WeightedAverage(global_state)
        loss_sum = 0.0
        for u in updates:
            att.add(u.state, tag=u.device_id, also=avg, weight=float(u.num_samples))
            loss_sum += float(u.train_loss)
        loss = loss_sum / att.count
        delta = None if self.prev_loss is None else abs(loss - self.prev_loss)
        adaptive = delta is None or not math.isfinite(delta) or delta >= self.epsilon_med
        info: Info = {
            "strategy": self.name,
            "mode": "adaptive" if adaptive else "fedavg",
            "num_updates": att.count,
            "train_loss": loss if math.isfinite(loss) else None,
            "prev_train_loss": self.prev_loss,
            "delta": delta if delta is None or math.isfinite(delta) else None,
            "epsilon_med": self.epsilon_med,
        }
        if adaptive:
            new = att.result(self.eta)
            info.update(_attention_summary(att.weights()))
        else:
            new = avg.result()
        if math.isfinite(loss):
            self.prev_loss = loss
        return new, info

    def sensitivity(self, global_state: Mapping[str, Tensor], bound: Bound, m: int) -> float:
        """``eta`` times the attention bound with ``rho = 2^(1/T)``, for the adaptive step only
        (config.dp_problem refuses topK and mediation under DP)."""
        if self.beta < 1.0 or self.epsilon_med > 0.0:
            raise ValueError("FedMed under DP needs beta = 1 (no topK) and epsilon_med = 0")
        rho = 2.0 ** (1.0 / bound.temperature)
        return self.eta * sensitivity.attention_sensitivity(m, bound.norm, rho, bound.scope)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "prev_loss": self.prev_loss}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        super().load_state_dict(d)
        prev = d.get("prev_loss")
        self.prev_loss = None if prev is None else float(prev)


def _ceiling(att: LayerwiseAttention, bound: Bound | None) -> dict[str, float] | None:
    """The fixed normalizer's logit ceiling: the public 1/T under a bound; None without one (the
    cohort's largest)."""
    return None if bound is None else dict.fromkeys(att.keys, 1.0 / bound.temperature)
