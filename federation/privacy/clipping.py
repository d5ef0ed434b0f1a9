"""The round's clip rule: the fixed clip S, or adaptive clipping's C_t, composed into a round's DP
(fedkey.federation.privacy.round) as one object either way.

    ClipRule             what a round's DP asks of its clip:
        norm                 the round's clip: C_t, or S (None without DP)
        ready                whether the aggregate's noise multiplier is known
        noise_multiplier()   z, or adaptive clipping's z_u (Andrew et al. 2021, Theorem 1)
        max_noise_multiplier()  the z it allows below: adaptive clipping's sigma_b / s_b
        observe(N)           what the population fixes (the default sigma_b)
        step(...)            the round's noised count and the next clip (row fields)
        start_info, state_dict, load_state_dict
    FixedClip            --dp-clip S alone (or no DP): z, S, nothing to remember
    AdaptiveClipping     --dp-clip-quantile: fedkey.federation.privacy.adaptive_clip.AdaptiveClip
                         (Andrew et al. 2021, Algorithm 1) with its count noise from the secret

The count's noise comes from the secret as the model's does (fedkey.federation.privacy.secret),
keyed by the round, so a resumed run draws the same.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from fedkey.federation.config import FederationConfig
from fedkey.federation.influence.bounding import ClippedRound
from fedkey.federation.privacy.adaptive_clip import (
    AdaptiveClip,
    count_sensitivity,
    count_stddev_problem,
    default_count_stddev,
    update_noise_multiplier,
)
from fedkey.federation.privacy.calibrate import noise_multiplier_of
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.strategies.selection import cohort_size


class ClipRule(ABC):
    """How a round's updates are clipped under DP, and what that does to its noise."""

    def __init__(self, config: FederationConfig) -> None:
        self.config = config
        self.z = noise_multiplier_of(config.privacy)

    @property
    @abstractmethod
    def norm(self) -> float | None:
        """The round's clip."""

    @property
    def count_stddev(self) -> float | None:
        """sigma_b of adaptive clipping's count (None: no count, or not fixed yet)."""
        return None

    @property
    def ready(self) -> bool:
        """Whether :meth:`noise_multiplier` is known (adaptive clipping: sigma_b is fixed)."""
        return True

    def noise_multiplier(self) -> float:
        """The aggregate's noise multiplier: z."""
        return self.z

    def max_noise_multiplier(self) -> float:
        """The z the rule allows below (exclusive): any (a fixed clip)."""
        return math.inf

    def observe(self, population: int) -> bool:
        """A population the run draws from; True when it fixed the noise multiplier now."""
        return False

    def step(self, r: int, bounded: ClippedRound, population: int) -> dict:
        """What round r's row says of the clip after the round (nothing here)."""
        return {}

    def start_info(self) -> dict:
        """What round 0's ``info.dp`` says of the clip (nothing here)."""
        return {}

    def state_dict(self) -> dict:
        """The server state's "clip" where the rule has one."""
        return {}

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """A run resumes as it clipped (one line saying how where it did otherwise)."""


class FixedClip(ClipRule):
    """The configured clip S every round (--dp-clip; None without DP), at noise multiplier z."""

    @property
    def norm(self) -> float | None:
        return self.config.privacy.clip_norm

    def load_state_dict(self, state: dict) -> None:
        stored = state.get("clip")
        if stored is not None:
            raise ValueError(
                "this run adapted its DP clip: resume it with --dp-clip-quantile "
                f"{stored.get('quantile')}"
            )


class AdaptiveClipping(ClipRule):
    """Adaptive clipping (fedkey.federation.privacy.adaptive_clip: Andrew et al. 2021,
    Algorithm 1): the clip C_t follows a quantile of the update norms through a noised count;
    the aggregate's noise multiplier is z_u, so that both releases together cost z."""

    def __init__(self, config: FederationConfig, secret: RunSecret) -> None:
        super().__init__(config)
        p = config.privacy
        if p.clip_norm is None or p.clip_quantile is None:
            raise ValueError("adaptive clipping needs --dp-clip and --dp-clip-quantile")
        self.secret = secret
        self.rule = AdaptiveClip(
            p.clip_norm,
            p.clip_quantile,
            p.clip_lr,
            p.clip_count_stddev,
            count_sensitivity(p.sampling),
        )

    @property
    def norm(self) -> float:
        """C_t, what the next round clips to."""
        return self.rule.norm

    @property
    def count_stddev(self) -> float | None:
        return self.rule.count_stddev

    @property
    def ready(self) -> bool:
        return self.rule.count_stddev is not None

    def noise_multiplier(self) -> float:
        """z_u = (z^-2 - (sigma_b / s_b)^-2)^(-1/2) (Andrew et al. 2021, Theorem 1; the
        count noise must be fixed by then)."""
        if self.rule.count_stddev is None:
            raise RuntimeError("adaptive clipping's count noise is not fixed yet")
        return update_noise_multiplier(self.z, self.rule.count_stddev, self.rule.sensitivity)

    def max_noise_multiplier(self) -> float:
        """sigma_b / s_b: the count's noise must exceed s_b z (count_stddev_problem); any z
        while sigma_b is not fixed."""
        sigma_b = self.rule.count_stddev
        return math.inf if sigma_b is None else sigma_b / self.rule.sensitivity

    def observe(self, population: int) -> bool:
        """The default sigma_b, the expected cohort / 20, fixed by the first population seen
        (refused in one line when too small for z); True when it was fixed now."""
        if self.rule.count_stddev is not None:
            return False
        if self.config.privacy.sampling == "poisson":
            expected: float = self.config.fraction * population
        else:
            expected = cohort_size(self.config.fraction, population)
        sigma_b = default_count_stddev(expected)
        problem = count_stddev_problem(self.z, sigma_b, self.rule.sensitivity, expected)
        if problem is not None:
            raise ValueError(problem)
        self.rule.count_stddev = sigma_b
        return True

    def step(self, r: int, bounded: ClippedRound, population: int) -> dict:
        """The noised fraction of round r's updates within C_t, and C_{t+1}; the denominator is
        the cohort, or Poisson sampling's fixed q N (as the aggregate's)."""
        if self.config.privacy.sampling == "poisson":
            denominator: float = self.config.fraction * population
        else:
            denominator = len(bounded)
        draw = float(self.secret.key().normals(1, "clip-count", r)[0])
        return {
            **self.rule.step(bounded.norms, denominator, draw),
            "update_noise_multiplier": self.noise_multiplier(),
        }

    def start_info(self) -> dict:
        """The first round's clip."""
        return {"clip": self.rule.norm, "clip_quantile": self.rule.quantile}

    def state_dict(self) -> dict:
        return {"clip": self.rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The next round's clip and sigma_b: a run resumes adaptively, with the same sigma_b."""
        stored = state.get("clip")
        if stored is None:
            if state.get("accountant"):
                raise ValueError(
                    "this run clipped at a fixed --dp-clip: resume it without --dp-clip-quantile"
                )
            return
        configured = self.config.privacy.clip_count_stddev
        sigma_b = stored.get("count_stddev")
        if configured is not None and sigma_b is not None and float(sigma_b) != configured:
            raise ValueError(
                f"this run's clip count was noised with sigma_b = {sigma_b}: resume it with "
                f"--dp-clip-count-stddev {sigma_b}"
            )
        self.rule.load_state_dict(stored)
