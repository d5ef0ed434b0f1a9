"""Gaussian noise on a model's weights, seeded so that every transport draws the same noise.

The phone's randomization before upload (the seed papers' "differential privacy": FedAtt,
Ji et al. 2019, eq. 6; FedAttOpt, Jiang et al. 2020, eq. 11) and the server's DP noise both use it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

StateDict = dict[str, Tensor]


def _gaussian_like(t: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
    """``N(0, std^2)`` shaped like ``t``; drawn in float32 (float64 for float64 tensors) on CPU,
    so a seeded CPU generator gives the same noise whatever device ``t`` is on."""
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    noise = torch.randn(t.shape, generator=generator, dtype=dtype)
    return noise.mul_(std).to(t.device)


def randomize(
    state: Mapping[str, Tensor],
    beta: float,
    sigma: float = 1.0,
    generator: torch.Generator | None = None,
) -> StateDict:
    """The seed papers' randomization: ``theta + beta * N(0, sigma^2)`` on every floating parameter.

    Applied by the device before it uploads (FedAtt, Ji et al. 2019, Table III sweeps beta in {0,
    0.001, 0.005, 0.01, 0.05}). NO formal differential-privacy guarantee: the noise is not calibrated to any
    sensitivity. With ``beta == 0`` it returns a new dict holding the same tensor objects.
    """
    if beta < 0 or sigma < 0:
        raise ValueError(f"beta and sigma must be >= 0, got beta={beta}, sigma={sigma}")
    if beta == 0 or sigma == 0:
        return dict(state)
    std = float(beta) * float(sigma)
    out: StateDict = {}
    for k, v in state.items():
        if torch.is_floating_point(v):
            out[k] = (v.detach().to(torch.float64) + _gaussian_like(v, std, generator)).to(v.dtype)
        else:
            out[k] = v
    return out
