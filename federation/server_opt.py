"""Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization").

Whatever a strategy aggregates, the server can treat ``Delta_t = aggregate - theta_t`` as a
pseudo-gradient and step with an optimizer of its own instead of jumping straight to the
aggregate: server momentum (FedAvgM, Hsu et al. 2019) remembers past rounds' directions, Adam
(FedAdam) scales each parameter by its history. ``server_lr = 1`` with momentum 0 is the plain
strategy.

The steps are pure functions; :class:`ServerOptimizer` only holds the buffers, which are tensors
and so are saved beside each checkpoint (``checkpoints/server_opt_XXXX.safetensors``) rather than
in its JSON metadata.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from fedkey.federation.config import ServerOptConfig, scheduled_lr


def momentum_step(
    theta: Tensor, delta: Tensor, buf: Tensor | None, lr: float, beta: float
) -> tuple[Tensor, Tensor]:
    """FedAvgM: ``m = beta m + Delta``; ``theta + lr m``. Returns (new theta, new m)."""
    m = delta if buf is None else beta * buf + delta
    return theta + lr * m, m


def adam_step(
    theta: Tensor,
    delta: Tensor,
    m: Tensor | None,
    v: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """FedAdam (Reddi et al., Algorithm 2, no bias correction):
    ``m = b1 m + (1 - b1) Delta``, ``v = b2 v + (1 - b2) Delta^2``, ``theta + lr m / (sqrt v + tau)``.
    The buffers start at 0 (m) and tau^2 (v), as in the paper."""
    m = (1 - beta1) * delta if m is None else beta1 * m + (1 - beta1) * delta
    v0 = torch.full_like(delta, tau * tau) if v is None else v
    v = beta2 * v0 + (1 - beta2) * delta * delta
    return theta + lr * m / (v.sqrt() + tau), m, v


class ServerOptimizer:
    """Applies a server optimizer to a strategy's aggregate, layer by layer (float64 buffers)."""

    def __init__(self, config: ServerOptConfig):
        self.config = config
        self.buffers: dict[str, Tensor] = {}  # "m.<layer>", "v.<layer>"

    @property
    def active(self) -> bool:
        return self.config.name != "none"

    def lr_at(self, round: int) -> float:
        """The step size of round `round` (1-based), on the schedule of config.scheduled_lr."""
        return scheduled_lr(self.config.lr, self.config.lr_decay, round)

    def step(
        self, global_state: Mapping[str, Tensor], aggregate: Mapping[str, Tensor], round: int = 1
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(next global state, next buffers) after round `round`. Pure: nothing is kept until
        :meth:`commit`, so a round that fails after this leaves the optimizer as it was."""
        if not self.active:
            return dict(aggregate), self.buffers
        c, new, bufs, lr = self.config, {}, {}, self.lr_at(round)
        for key, theta_t in global_state.items():
            if not theta_t.is_floating_point():
                new[key] = aggregate[key]
                continue
            theta = theta_t.double()
            delta = aggregate[key].double() - theta
            if c.name == "momentum":
                out, bufs[f"m.{key}"] = momentum_step(
                    theta, delta, self.buffers.get(f"m.{key}"), lr, c.momentum
                )
            else:
                out, bufs[f"m.{key}"], bufs[f"v.{key}"] = adam_step(
                    theta, delta, self.buffers.get(f"m.{key}"), self.buffers.get(f"v.{key}"),
                    lr, c.momentum, c.beta2, c.tau,
                )  # fmt: skip
            new[key] = out.to(theta_t.dtype)
        return new, bufs

    def commit(self, buffers: dict[str, Tensor]) -> None:
        self.buffers = buffers
