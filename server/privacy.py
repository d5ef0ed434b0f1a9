"""Privacy: the seed papers' client-side randomization and DP-FedAvg with an RDP accountant.

Two different things live here:

1. :func:`randomize` is the seed papers' "differential privacy" (FedAttOpt, Jiang et al. 2020,
   eq. 11; FedAtt, Ji et al. 2019, eq. 6): each client adds ``beta * N(0, sigma^2)`` to its
   parameters before uploading. It carries **no formal privacy guarantee** (nothing bounds a
   client's influence); it reproduces FedAtt's Table III (Ji et al. 2019).
2. DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"),
   which does carry one: each client's whole-model update ``theta_k - theta`` is clipped to L2 norm
   S (:func:`clip_update`), the m clipped updates are averaged *uniformly*, and Gaussian noise
   ``N(0, (z S)^2)`` is added to the *sum* of the deltas, i.e. std ``z S / m`` on the average
   (:func:`noise_std`, :func:`add_gaussian_noise`, :func:`dp_fedavg`). :class:`PrivacyAccountant`
   composes ``PoissonSampled(q, Gaussian(z))`` once per round with dp_accounting's RDP
   accountant and reports epsilon at delta (client-level, add/remove-one adjacency).

The guarantee assumes what the analysis assumes: each client is included independently with
probability q (we sample a fixed-size cohort, the usual approximation), the uniform average of
clipped deltas (``get_strategy("fedavg", weighted=False)`` or :func:`dp_fedavg`; attention weights
depend on the data and are not covered), and noise drawn on the server from a secret generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import dp_accounting
import torch
from dp_accounting.rdp import RdpAccountant
from torch import Tensor

from common.noise import randomize

StateDict = dict[str, Tensor]

__all__ = [
    "DPConfig",
    "PrivacyAccountant",
    "add_gaussian_noise",
    "clip_update",
    "clip_updates",
    "compute_epsilon",
    "dp_fedavg",
    "noise_std",
    "randomize",
    "update_norm",
]


# --------------------------------------------------------------------------- DP-FedAvg


@dataclass(frozen=True)
class DPConfig:
    """DP-FedAvg settings: clip norm S, noise multiplier z, delta, optional epsilon budget."""

    clip_norm: float
    noise_multiplier: float
    delta: float = 1e-5
    target_epsilon: float | None = None

    def __post_init__(self) -> None:
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {self.target_epsilon}")


def update_norm(global_state: Mapping[str, Tensor], client_state: Mapping[str, Tensor]) -> float:
    """L2 norm of the whole-model delta ``client - global`` over the global floating keys."""
    total = 0.0
    for k, g in global_state.items():
        if torch.is_floating_point(g):
            d = client_state[k].detach().to(torch.float64) - g.detach().to(client_state[k].device)
            total += float(d.square().sum())
    return math.sqrt(total)


def clip_update(
    global_state: Mapping[str, Tensor], client_state: Mapping[str, Tensor], clip_norm: float
) -> tuple[StateDict, float]:
    """Clip the client's delta to L2 norm ``clip_norm``: ``theta + u * min(1, S / ||u||)``.

    Returns ``(clipped state, original norm)``. An update already within the norm is returned
    as a new dict holding the same tensors (no copy). Non-floating entries are passed through.
    """
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    norm = update_norm(global_state, client_state)
    if norm <= clip_norm:
        return dict(client_state), norm
    factor = clip_norm / norm
    out: StateDict = dict(client_state)
    for k, g in global_state.items():
        if torch.is_floating_point(g):
            c = client_state[k]
            g64 = g.detach().to(device=c.device, dtype=torch.float64)
            out[k] = (g64 + (c.detach().to(torch.float64) - g64) * factor).to(c.dtype)
    return out, norm


def clip_updates(
    global_state: Mapping[str, Tensor],
    updates: Iterable[Any],
    clip_norm: float,
    norms: list[float] | None = None,
) -> Iterator[Any]:
    """Lazily clip a stream of ``ClientUpdate`` (anything with a ``state`` field and
    ``dataclasses.replace`` support); the original norms are appended to ``norms`` if given."""
    for u in updates:
        state, norm = clip_update(global_state, u.state, clip_norm)
        if norms is not None:
            norms.append(norm)
        yield replace(u, state=state)


def noise_std(clip_norm: float, noise_multiplier: float, num_updates: int) -> float:
    """Std of the Gaussian noise on the uniform average of ``m`` clipped deltas: ``z S / m``."""
    if num_updates <= 0:
        raise ValueError("num_updates must be positive")
    return noise_multiplier * clip_norm / num_updates


def add_gaussian_noise(
    state: Mapping[str, Tensor], std: float, generator: torch.Generator | None = None
) -> StateDict:
    """``state + N(0, std^2)`` on every floating entry (noise on the aggregated model equals
    noise on the aggregated delta). ``std == 0`` returns a new dict with the same tensors."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    if std == 0:
        return dict(state)
    return randomize(state, beta=std, sigma=1.0, generator=generator)


def dp_fedavg(
    global_state: Mapping[str, Tensor],
    client_states: Iterable[Mapping[str, Tensor]],
    config: DPConfig,
    generator: torch.Generator | None = None,
) -> tuple[StateDict, dict[str, Any]]:
    """One DP-FedAvg aggregation, streaming: clip each delta to S, average uniformly, add
    ``N(0, (z S / m)^2)``. Returns ``(new state, info)`` with info holding m, the noise std and
    the clipping statistics. With no clients the global state is returned (no noise, no step
    should be counted by the accountant)."""
    # Local import: privacy does not depend on the strategies package at import time.
    from server.strategies.aggregate import WeightedAverage

    acc = WeightedAverage(global_state)
    norms: list[float] = []
    for state in client_states:
        clipped, norm = clip_update(global_state, state, config.clip_norm)
        norms.append(norm)
        acc.add(clipped, 1.0)
    if not norms:
        return {k: v.detach().clone() for k, v in global_state.items()}, {"num_updates": 0}
    std = noise_std(config.clip_norm, config.noise_multiplier, len(norms))
    new = add_gaussian_noise(acc.result(), std, generator)
    info = {
        "num_updates": len(norms),
        "noise_std": std,
        "clip_norm": config.clip_norm,
        "clipped_fraction": sum(n > config.clip_norm for n in norms) / len(norms),
        "median_update_norm": sorted(norms)[len(norms) // 2],
    }
    return new, info


# --------------------------------------------------------------------------- accounting


@lru_cache(maxsize=4096)
def compute_epsilon(
    noise_multiplier: float, sampling_rate: float, steps: int, delta: float
) -> float:
    """Epsilon at ``delta`` after ``steps`` rounds of ``PoissonSampled(q, Gaussian(z))`` (RDP)."""
    if steps <= 0 or sampling_rate == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )
    acc.compose(event, int(steps))
    return float(acc.get_epsilon(delta))


class PrivacyAccountant:
    """Client-level (epsilon, delta) of DP-FedAvg, composed round by round.

    ``step()`` once per round in which noise was added; ``epsilon`` is the RDP bound at
    ``delta`` after the steps so far; ``exhausted`` is True once it reaches ``target_epsilon``;
    ``would_exceed()`` tells beforehand whether one more round would overshoot the budget, so the
    server can stop before spending it. Only the step count is state.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling_rate: float,
        delta: float = 1e-5,
        target_epsilon: float | None = None,
    ) -> None:
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if not 0 <= sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in [0, 1], got {sampling_rate}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_rate = float(sampling_rate)
        self.delta = float(delta)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.steps = 0

    @classmethod
    def from_config(cls, config: DPConfig, sampling_rate: float) -> PrivacyAccountant:
        """Build from a :class:`DPConfig` and the per-round client sampling rate q (= C)."""
        return cls(config.noise_multiplier, sampling_rate, config.delta, config.target_epsilon)

    def step(self, rounds: int = 1) -> float:
        """Account for ``rounds`` more rounds; return the new epsilon."""
        if rounds < 0:
            raise ValueError("rounds must be >= 0")
        self.steps += int(rounds)
        return self.epsilon

    def epsilon_after(self, steps: int) -> float:
        """Epsilon after ``steps`` rounds in total."""
        return compute_epsilon(self.noise_multiplier, self.sampling_rate, int(steps), self.delta)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far, at :attr:`delta`."""
        return self.epsilon_after(self.steps)

    @property
    def exhausted(self) -> bool:
        """Whether the budget ``target_epsilon`` is spent (never, without a target)."""
        return self.target_epsilon is not None and self.epsilon >= self.target_epsilon

    def would_exceed(self, rounds: int = 1) -> bool:
        """Whether ``rounds`` more rounds would take epsilon past ``target_epsilon``."""
        return (
            self.target_epsilon is not None
            and self.epsilon_after(self.steps + rounds) > self.target_epsilon
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore the step count (the configuration stays as constructed)."""
        self.steps = int(d["steps"])
