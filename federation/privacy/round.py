"""A round's differential privacy: the one object the round engine (fedkey.federation.engine) composes for it.

    RoundPrivacy(config, strategy)  the accountant, DP-FTRL's noise (the tree's or the BLT's), the
                                    adaptive clip and the separation record, from the run's config
    observe(population)             what the population fixes: delta, the tree's b, sigma_b
    selection_rng(round, attempt)   under DP the secret's generator for the round's cohort
    cohort(round, available, rng)   the cohort the analysis assumes (tree, Poisson), or None
    clip_norm()                     the round's clip: C_t (adaptive) or S
    noise(plan, ...)                noise the aggregate, account for it, step the adaptive clip
    start_info(), row_fields()      what round 0's row and every row report of it
    would_exceed(population)        the budget stop
    state_dict(), load_state_dict() the server state's "accountant", "tree" or "blt", and "clip"

The mechanisms are fedkey.federation.privacy.gaussian (the gaussian mechanism and its RDP accountant), fedkey.federation.privacy.tree
(DP-FTRL's tree aggregation, Kairouz et al. 2021), fedkey.federation.privacy.blt (DP-FTRL's BLT matrix
factorization, Dvijotham et al. 2024) and fedkey.federation.privacy.adaptive_clip (Andrew et al. 2021, Algorithm 1).
Without DP (no --dp-clip) the object holds none of them and every call is a no-op: the engine
calls it the same way either way. Its noise and, where the analysis samples, its cohorts are
drawn from the server's secret (fedkey.federation.privacy.secret: 256 bits from the operating system, kept in
RUN_DIR/secret.key), never from the run's seed, which phones are told; keyed by round, so a resumed
run draws the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fedkey.federation.config import FederationConfig, dp_problem
from fedkey.federation.influence.bounding import BoundedRound, scale_deltas
from fedkey.federation.privacy import blt as dp_blt
from fedkey.federation.privacy import gaussian as privacy
from fedkey.federation.privacy import tree as dp_ftrl
from fedkey.federation.privacy.adaptive_clip import (
    AdaptiveClip,
    count_sensitivity,
    count_stddev_problem,
    default_count_stddev,
    update_noise_multiplier,
)
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.strategies import ClientUpdate, Strategy, sensitivity
from fedkey.federation.strategies.selection import cohort_size, draw_uniform

if TYPE_CHECKING:
    from fedkey.federation.engine import RoundPlan


class RoundPrivacy:
    """The DP state of a run and what each round does with it (see the module's docstring)."""

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret | None = None
    ) -> None:
        """Refuses, in one line, a federation that cannot run with a DP guarantee
        (fedkey.federation.config.dp_problem). `strategy` is the run's, set up: its fraction, population
        and sensitivity are DP's too. `secret`: where the noise comes from (the run directory's;
        None: one of this process alone, or the configured --dp-secret)."""
        self.config = config
        self.strategy = strategy
        self.secret = secret or RunSecret(passphrase=config.privacy.secret)
        p = config.privacy
        problem = dp_problem(config.strategy, p, config.influence, config.strategy_params)
        if problem is not None:
            raise ValueError(problem)
        self.accountant: privacy.PrivacyAccountant | dp_ftrl.TreeAccountant | None = None
        # DP-FTRL (--dp-mechanism tree, fedkey.federation.privacy.tree): the tree's noise, and the round each
        # phone last trained in (the minimum-separation rule), both part of the server state.
        self.tree: dp_ftrl.TreeNoise | None = None
        # --dp-mechanism blt (fedkey.federation.privacy.blt): the BLT's streaming noise; the same separation rule.
        self.blt: dp_blt.BLTNoise | None = None
        self.last_trained: dict[str, int] = {}
        # Adaptive clipping (--dp-clip-quantile, fedkey.federation.privacy.adaptive_clip): the next round's clip C_t
        # and the count noise sigma_b, part of the server state.
        self.clip: AdaptiveClip | None = None
        if p.dp and p.clip_quantile is not None and p.clip_norm is not None:
            self.clip = AdaptiveClip(
                p.clip_norm,
                p.clip_quantile,
                p.clip_lr,
                p.clip_count_stddev,
                count_sensitivity(p.sampling),
            )
        if p.dp and p.mechanism == "tree":
            # The nodes' multiplier is z_u under adaptive clipping (_apply_update_z).
            self.tree = dp_ftrl.TreeNoise(self.secret, p.noise_multiplier)
            self.accountant = dp_ftrl.TreeAccountant(
                p.noise_multiplier, p.min_separation, p.delta, p.target_epsilon
            )
        elif p.dp and p.mechanism == "blt":
            self.blt = dp_blt.BLTNoise(self.secret, p.noise_multiplier)
            self.accountant = dp_blt.BLTAccountant(
                p.noise_multiplier, p.min_separation, config.rounds, p.delta, p.target_epsilon
            )
        elif p.dp:
            self.accountant = privacy.PrivacyAccountant(
                noise_multiplier=p.noise_multiplier,
                sampling=p.sampling,
                sampling_rate=config.fraction,
                delta=p.delta,
                target_epsilon=p.target_epsilon,
            )
        if self.clip is not None and self.clip.count_stddev is not None:
            self._apply_update_z()

    # -- what a DP run fixes once it knows its population ------------------------------------

    def observe(self, population: int, check: bool = False) -> None:
        """The accountant sees the population (the default delta, 1 / N^1.1, follows the
        largest); the tree's b and adaptive clipping's default sigma_b (the expected cohort /
        20, refused in one line when too small for z) are fixed by the first one seen. With
        `check` (a population known from the start), a configured b that `population` phones
        cannot fill a cohort under every round is refused."""
        if self.accountant is None or population <= 0:
            return
        self.accountant.observe(population)
        if self._ftrl:
            self._min_separation(population, check=check)
        clip = self.clip
        if clip is not None and clip.count_stddev is None:
            p = self.config.privacy
            if p.sampling == "poisson":
                expected: float = self.config.fraction * population
            else:
                expected = cohort_size(self.config.fraction, population)
            sigma_b = default_count_stddev(expected)
            problem = count_stddev_problem(p.noise_multiplier, sigma_b, clip.sensitivity, expected)
            if problem is not None:
                raise ValueError(problem)
            clip.count_stddev = sigma_b
            self._apply_update_z()

    def _update_z(self) -> float:
        """The aggregate's noise multiplier: z, or z_u under adaptive clipping (its count noise
        must be fixed by then)."""
        z = self.config.privacy.noise_multiplier
        if self.clip is None:
            return z
        if self.clip.count_stddev is None:
            raise RuntimeError("adaptive clipping's count noise is not fixed yet")
        return update_noise_multiplier(z, self.clip.count_stddev, self.clip.sensitivity)

    @property
    def _ftrl(self) -> bool:
        """DP-FTRL (tree or blt): no sampling, the minimum-separation rule."""
        return self.tree is not None or self.blt is not None

    def _apply_update_z(self) -> None:
        """DP-FTRL's noise and its accountant take z_u and sigma_b (adaptive clipping)."""
        z_u = self._update_z()
        for noise in (self.tree, self.blt):
            if noise is not None:
                noise.noise_multiplier = z_u
        if isinstance(self.accountant, dp_ftrl.TreeAccountant) and self.clip is not None:
            self.accountant.noise_multiplier = z_u
            self.accountant.count_stddev = self.clip.count_stddev

    # -- the cohort the analysis assumes -------------------------------------------------------

    def selection_rng(self, r: int, attempt: int = 0) -> np.random.Generator | None:
        """Under DP, the generator of round r's cohort (its `attempt`-th draw), keyed by the
        secret: the accountant's amplification by sampling assumes nobody can predict who is
        drawn. None without DP (the run's seed then draws it, reproducibly)."""
        if not self.config.privacy.dp:
            return None
        return self.secret.key().rng("cohort", r, attempt)

    def cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str] | None:
        """Round r's cohort from the sorted `available` phones where DP's analysis decides how it
        is drawn: the tree's separation rule, or Poisson sampling; None where the strategy
        selects it (no DP, or fixed-size sampling)."""
        p = self.config.privacy
        if self._ftrl:
            return self._tree_cohort(r, available, rng)
        if p.dp and p.sampling == "poisson":
            return self._poisson_cohort(available, rng)
        return None

    def _min_separation(self, population: int, check: bool = False) -> int:
        """DP-FTRL's b: the configured one (with `check`, refused when `population` phones
        cannot fill a cohort every round under it), or, left to the default, the largest the
        first population seen allows, fixed for the run (the accountant keeps it); it fixes the
        BLT's factorization (fedkey.federation.privacy.blt.select_blt)."""
        if not isinstance(self.accountant, dp_ftrl.TreeAccountant):
            raise RuntimeError("the minimum separation is DP-FTRL's")
        m = cohort_size(self.strategy.fraction, population)
        b = self.accountant.min_separation
        if b is None:
            b = self.accountant.min_separation = dp_ftrl.default_separation(population, m)
        elif check:
            problem = dp_ftrl.separation_problem(population, m, b)
            if problem is not None:
                raise ValueError(problem)
        if self.blt is not None and isinstance(self.accountant, dp_blt.BLTAccountant):
            self.blt.blt = self.accountant.blt
        return b

    def _tree_rule(self) -> dict:
        """What every DP-FTRL row says of the rule the accounting assumes."""
        acc = self.accountant
        b = acc.min_separation if isinstance(acc, dp_ftrl.TreeAccountant) else None
        return {
            "mechanism": self.config.privacy.mechanism,
            "noise_multiplier": self.config.privacy.noise_multiplier,
            "min_separation": b,
        }

    def _tree_cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str]:
        """Round r's cohort under the tree: m = the strategy's share of the available phones,
        drawn uniformly (as the uniform selector draws) from those that did not train in the
        last b - 1 rounds; fewer when fewer are eligible (a server whose phones are offline)."""
        b = self._min_separation(len(available))
        ids = dp_ftrl.eligible(available, self.last_trained, r, b)
        return draw_uniform(ids, cohort_size(self.strategy.fraction, len(available)), rng)

    def _poisson_cohort(self, available: list[str], rng: np.random.Generator) -> list[str]:
        """Each phone independently with probability q (= the fraction), as the Poisson analysis
        assumes. An empty draw (probability (1 - q)^N) is drawn again: a round needs an update."""
        q = self.config.fraction
        for _ in range(1000):
            cohort = [
                d for d, x in zip(available, rng.random(len(available)), strict=True) if x < q
            ]
            if cohort:
                return cohort
        raise ValueError(f"Poisson sampling at q={q} of {len(available)} phones drew no one")

    # -- one round -----------------------------------------------------------------------------

    def clip_norm(self) -> float | None:
        """The round's clip: adaptive clipping's C_t, else the configured S (None without DP)."""
        return self.clip.norm if self.clip is not None else self.config.privacy.clip_norm

    def noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: dict[str, torch.Tensor],
        bounded: BoundedRound,
        global_state: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], dict | None]:
        """The aggregate `new_state` of the round's `bounded` updates with DP's noise added and
        accounted for (from `global_state`, the model before the round), and the row's
        ``info.dp``; under adaptive clipping the clip steps to C_{t+1}. Without DP: `new_state`
        as it is, and None."""
        if self._ftrl:
            new_state, dp = self._add_tree_noise(plan, updates, new_state, bounded, global_state)
        elif self.config.privacy.dp:
            new_state, dp = self._add_noise(plan, new_state, bounded, global_state)
        else:
            return new_state, None
        if self.clip is not None:
            dp.update(self._step_clip(plan, bounded))
        return new_state, dp

    def _population(self, plan: RoundPlan) -> int:
        """The N the round's cohort was drawn from (simulate's plans: its whole population)."""
        return plan.population or len(self.strategy.client_sizes)

    def _add_noise(
        self,
        plan: RoundPlan,
        new_state: dict[str, torch.Tensor],
        bounded: BoundedRound,
        global_state: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """``N(0, (z Delta)^2)`` on the aggregate; the accountant steps (fedkey.federation.privacy.gaussian)."""
        p, m, bound = self.config.privacy, len(bounded), bounded.bound
        if self.accountant is None or bound is None:  # __init__ makes both whenever DP is on
            raise RuntimeError("DP needs the privacy accountant and a bound")
        population = self._population(plan)
        if p.sampling == "poisson":
            # McMahan et al. 2018's fixed denominator: sum_k u_k / (q N), not the mean.
            expected = self.config.fraction * population
            factors = dict.fromkeys(bound.layers, m / expected)  # bound.layers: the floating keys
            new_state = scale_deltas(global_state, new_state, factors)
            sens = sensitivity.poisson_mean_sensitivity(expected, bound.norm)
        else:
            sens = self.strategy.sensitivity(global_state, bound, m)
        # Float32 models: the clip and the cast round, which moved the tight example of
        # tests/federation/strategies/test_sensitivity.py up to 6e-5 past Delta at S = 0.01.
        std = self._update_z() * sens * (1 + 1e-4)
        unit = self.secret.key().normal_state(new_state, "gaussian", plan.round)
        new_state = privacy.add_gaussian_noise(new_state, std, unit)
        self.accountant.step(population, len(plan.cohort))
        return new_state, {
            "mechanism": "gaussian",
            "sensitivity": sens,
            "noise_std": std,
            "sampling": p.sampling,
            "clip": bound.norm,
        }

    def _step_clip(self, plan: RoundPlan, bounded: BoundedRound) -> dict:
        """Adaptive clipping (fedkey.federation.privacy.adaptive_clip): the noised fraction of the round's updates
        within C_t, and C_{t+1}. The count's noise comes from the secret as the model's does,
        keyed by the round, so a resumed run draws the same."""
        p, clip = self.config.privacy, self.clip
        if clip is None:
            raise RuntimeError("adaptive clipping is off")
        if p.sampling == "poisson":  # the fixed denominator q N, as the aggregate's
            denominator = self.config.fraction * self._population(plan)
        else:
            denominator = len(bounded)
        draw = float(self.secret.key().normals(1, "clip-count", plan.round)[0])
        return {
            **clip.step(bounded.norms, denominator, draw),
            "update_noise_multiplier": self._update_z(),
        }

    def _add_tree_noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: dict[str, torch.Tensor],
        bounded: BoundedRound,
        global_state: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """DP-FTRL (fedkey.federation.privacy.tree, fedkey.federation.privacy.blt): the aggregate's step ``g_t = new_state -
        theta_{t-1}`` plus ``n_t - n_{t-1}`` (the tree's, or the BLT's ``z Delta_t x_t``), so
        that ``theta_t = theta_0 + (noisy prefix sum of the g's)``; the cohort's phones are
        recorded for the separation rule."""
        bound, noise = bounded.bound, self.tree or self.blt
        if not isinstance(self.accountant, dp_ftrl.TreeAccountant) or noise is None:
            raise RuntimeError("DP-FTRL needs its accountant and its noise")
        if bound is None:
            raise RuntimeError("DP needs a bound")
        b = self._min_separation(self._population(plan))
        sens = self.strategy.sensitivity(global_state, bound, len(bounded))
        # The float32 margin of _add_noise: every node's noise is z times at least this.
        residual = noise.release(global_state, sens * (1 + 1e-4))
        if residual is not None:
            new_state = {
                k: (v.double() + residual[k].to(v.device)).to(v.dtype) if k in residual else v
                for k, v in new_state.items()
            }
        self.accountant.step(plan.population)
        r = plan.round
        trained = {*plan.cohort, *(u.device_id for u in updates)}
        self.last_trained = {
            d: s for d, s in self.last_trained.items() if d not in trained and r + 1 - s < b
        }
        if b > 1:  # with b = 1 every phone may train every round: nothing to remember
            self.last_trained.update(dict.fromkeys(sorted(trained), r))
        dp = {
            **self._tree_rule(),
            "sensitivity": sens,
            "noise_std": noise.noise_multiplier * sens * (1 + 1e-4),
            "clip": bound.norm,
            "release_noise_std": noise.release_std(),
            "max_participations": -(-r // b),
        }
        if self.tree is not None:
            dp["tree_nodes"] = len(dp_ftrl.prefix_nodes(r))
        return new_state, dp

    # -- what the rows report ------------------------------------------------------------------

    def start_info(self) -> dict:
        """Round 0's ``info``: under DP-FTRL its rule, under adaptive clipping the first
        round's clip; {} otherwise."""
        dp = self._tree_rule() if self._ftrl else {}
        if self.clip is not None:  # the first round's clip
            dp = {**dp, "clip": self.clip.norm, "clip_quantile": self.clip.quantile}
        return {"dp": dp} if dp else {}

    def row_fields(self) -> dict:
        """Every metrics row's epsilon, rho, delta and noise_reproducible (fedkey.federation.metrics_row):
        None without DP."""
        acc = self.accountant
        return {
            "epsilon": acc.epsilon if acc is not None else None,
            "rho": acc.rho if acc is not None else None,
            "delta": acc.delta if acc is not None else None,
            "noise_reproducible": self.secret.reproducible if acc is not None else None,
        }

    def would_exceed(self, population: int) -> bool:
        """True when one more DP round (of the usual cohort of `population` phones) would take
        epsilon past the budget; False without DP or a budget."""
        if self.accountant is None:
            return False
        if self.accountant.delta_for(population) is None:
            return False  # no phone seen yet (a server before its first round): nothing spent
        if isinstance(self.accountant, dp_ftrl.TreeAccountant):
            # b and sigma_b are fixed at the first round (a server's phones enroll first)
            fixed = self.clip is None or self.clip.count_stddev is not None
            return (
                self.accountant.min_separation is not None
                and fixed
                and self.accountant.would_exceed(population)
            )
        return self.accountant.would_exceed(
            population, cohort_size(self.config.fraction, population)
        )

    # -- memory across rounds, for a restarted server ------------------------------------------

    def state_dict(self) -> dict:
        """The server state's DP part (JSON-serializable): "accountant" (None without DP), and
        "tree" or "blt" (DP-FTRL: the rounds' sensitivities, the separation rule) and "clip"
        (adaptive clipping: the next round's clip, sigma_b) where they apply; under DP "secret",
        the secret's fingerprint (fedkey.federation.privacy.secret), so that a resume with another is refused."""
        state: dict = {
            "accountant": self.accountant.state_dict() if self.accountant is not None else None
        }
        if self.accountant is not None:
            state["secret"] = self.secret.key().fingerprint
        for name, noise in (("tree", self.tree), ("blt", self.blt)):
            if noise is not None:
                state[name] = {**noise.state_dict(), "last_trained": dict(self.last_trained)}
        if self.clip is not None:
            state["clip"] = self.clip.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Adopt the DP part of a server state (the whole of it may be passed); a run resumes
        only with the mechanism, the clip and the secret it was noised with (one line saying
        which)."""
        if self.accountant is not None and state.get("accountant"):
            self._check_secret(state.get("secret"))
            self.accountant.load_state_dict(state["accountant"])
        for name, noise in (("tree", self.tree), ("blt", self.blt)):
            if noise is None:
                continue
            stored = state.get(name)
            if stored is None and state.get("accountant"):
                raise ValueError(
                    "this run was noised with another mechanism: resume it with the "
                    "--dp-mechanism it ran with"
                )
            stored = stored or {}
            noise.load_state_dict(stored)
            self.last_trained = {str(d): int(s) for d, s in stored.get("last_trained", {}).items()}
        if isinstance(self.accountant, dp_blt.BLTAccountant) and self.blt is not None:
            if self.accountant.min_separation is not None:
                self.blt.blt = self.accountant.blt
        self._load_clip_state(state)

    def _check_secret(self, fingerprint: str | None) -> None:
        """A DP run resumes only with the secret its noise was drawn from."""
        if fingerprint is None:
            raise ValueError(
                "this run's DP noise was drawn from its public seed (a fedkey without a secret): "
                "its epsilon bounds nothing; start the run again"
            )
        if not self.secret.exists():
            raise ValueError(
                "this run's DP secret is gone (secret.key is missing from the run directory): "
                "its noise cannot continue; restore the file or start the run again"
            )
        if self.secret.key().fingerprint != fingerprint:
            raise ValueError(
                "this run's DP noise was drawn with another secret: resume it with the "
                "secret.key (or the --dp-secret) it ran with"
            )

    def _load_clip_state(self, state: dict) -> None:
        """Adaptive clipping's state: a run resumes as it clipped (adaptively, with the same
        sigma_b, or at the fixed clip)."""
        stored = state.get("clip")
        if self.clip is None:
            if stored is not None:
                raise ValueError(
                    "this run adapted its DP clip: resume it with --dp-clip-quantile "
                    f"{stored.get('quantile')}"
                )
            return
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
        self.clip.load_state_dict(stored)
        if self.clip.count_stddev is not None:
            self._apply_update_z()
