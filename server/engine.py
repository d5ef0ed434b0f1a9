"""The round engine: one implementation of a federated round, shared by every transport.

    plan_round()      the strategy selects a cohort and the task it is given
    choose_uploaders  (FedMed topK) which of the trained devices upload
    complete_round()  privacy -> aggregate -> evaluate -> checkpoint -> metrics row

`fedkey simulate` drives it with a pool of local worker processes; the HTTP server drives the
same object with real devices. Selection and noise are seeded by (seed, round), so a run is
deterministic and can resume at any round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.config import TrainConfig
from common.files import atomic_write
from models.checkpoint import (
    build_model,
    check_state,
    checkpoint_bytes,
    model_state,
    public_bytes,
    read_metadata,
    save_checkpoint,
)
from models.config import ModelConfig
from models.model import LanguageModel
from models.precision import resolve_device, resolve_precision
from models.tokenizers import Tokenizer
from server import dp_ftrl, privacy
from server.adaptive_clip import (
    AdaptiveClip,
    count_sensitivity,
    count_stddev_problem,
    default_count_stddev,
    update_noise_multiplier,
)
from server.config import FederationConfig, dp_problem, scheduled_lr
from server.influence import BoundedRound, bound_round, scale_deltas
from server.server_opt import ServerOptimizer
from server.storage import RunStorage, prune_checkpoints
from server.strategies import ClientUpdate, Info, get_strategy, sensitivity
from server.strategies.selection import cohort_size


@dataclass
class RoundPlan:
    round: int
    cohort: list[str]
    train: TrainConfig
    started: float
    attempt: int = 0
    population: int = 0  # how many phones the cohort was drawn from (the DP accountant's N)


@dataclass
class FederationState:
    """Everything :meth:`Federation.complete_round` reads and changes in memory (the files it
    writes aside): what crosses to and from the aggregation process (server.aggregator)."""

    round: int
    global_state: dict[str, torch.Tensor]
    server: dict  # Federation.server_state(): strategy memory, accountant, best
    opt_buffers: dict[str, torch.Tensor]
    public: tuple[int, bytes] | None  # (round, public checkpoint bytes)


Evaluator = Callable[[dict[str, torch.Tensor]], dict]
#: A round metric besides perplexity (a backdoor's success, a canary's exposure): called with the
#: evaluated model and the tokenizer, its dict is merged into the round's metrics row.
Probe = Callable[[LanguageModel, Tokenizer], dict]


def client_seed(seed: int, round_idx: int, device_id: str) -> int:
    """A device's training seed for a round: independent of which process trains it."""
    ss = np.random.SeedSequence([seed, round_idx, *device_id.encode()])
    return int(ss.generate_state(1)[0])


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the safetensors body that carries `state` over the wire."""
    return len(st_save({k: v.contiguous() for k, v in state.items()}))


class Federation:
    def __init__(
        self,
        config: FederationConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        client_sizes: dict[str, int],
        valid: list[str],
        test: list[str],
        storage: RunStorage,
        evaluator: Evaluator | None = None,
        probes: Sequence[Probe] = (),
        train_precision: str | None = None,
        data: str = "",
    ):
        """`train_precision`: what the phones' training resolved config.train.precision to,
        when the caller knows it (simulate: its one machine); else the explicit fp32 / bf16 of
        the task, or None for "auto" (each phone resolves it on its own hardware). `data`: the
        corpus's name, which every metrics row records."""
        self.config = config
        self.data = data
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.valid, self.test = valid, test
        self.storage = storage
        self.evaluator = evaluator or self.evaluate
        self.probes = list(probes)
        asked = config.train.precision
        # The evaluator runs on config.eval_device (auto: the GPU where there is one), in the
        # precision "auto" resolves to there (models.precision). Both are in every metrics row.
        self.eval_device = resolve_device(config.eval_device)
        self.eval_precision = resolve_precision(asked, self.eval_device)
        self.train_precision = train_precision or (None if asked == "auto" else asked)
        self.strategy = get_strategy(
            config.strategy, fraction=config.fraction, **config.strategy_params
        )
        self.strategy.setup(client_sizes, config.rounds)
        p = config.privacy
        problem = dp_problem(config.strategy, p, config.influence, config.strategy_params)
        if problem is not None:
            raise ValueError(problem)
        self.accountant: privacy.PrivacyAccountant | dp_ftrl.TreeAccountant | None = None
        # DP-FTRL (--dp-mechanism tree, server.dp_ftrl): the tree's noise, and the round each
        # phone last trained in (the minimum-separation rule), both part of the server state.
        self.tree: dp_ftrl.TreeNoise | None = None
        self.last_trained: dict[str, int] = {}
        # Adaptive clipping (--dp-clip-quantile, server.adaptive_clip): the next round's clip C_t
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
            self.tree = dp_ftrl.TreeNoise(config.seed, p.noise_multiplier)
            self.accountant = dp_ftrl.TreeAccountant(
                p.noise_multiplier, p.min_separation, p.delta, p.target_epsilon
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
        if client_sizes:  # simulate knows its population: b, sigma_b and delta are fixed now
            self._fix_population(len(client_sizes), check=True)
        self.server_opt = ServerOptimizer(config.server_opt)
        torch.manual_seed(config.seed)
        self.global_state = model_state(build_model(model_config))
        self.model_bytes = state_bytes(self.global_state)
        self.round = 0  # rounds completed
        self.best: dict | None = None
        self._public: tuple[int, bytes] | None = None  # (round, public checkpoint bytes)

    # -- evaluation ---------------------------------------------------------------------------

    def evaluate(self, state: dict[str, torch.Tensor]) -> dict:
        """Validation and test perplexity, top-1/top-3 and keystroke savings of `state`."""
        from models.metrics import column_perplexity, held_out_scores

        device = self.eval_device
        model = build_model(self.model_config, state).to(device)
        precision = self.eval_precision
        scores: dict = held_out_scores(
            model, self.tokenizer, self.valid, self.test, self.config.eval_batch_size, device,
            precision, self.config.ksr_sentences,
        )  # fmt: skip
        if self.config.train.batching == "columns":  # the seed papers' code's measure, beside ours
            for key, text in (("col_val_ppl", self.valid), ("col_test_ppl", self.test)):
                scores[key] = column_perplexity(
                    model, self.tokenizer, text, device=device, precision=precision
                )
        model.to("cpu")  # the probes (models.exposure) score on the CPU
        for probe in self.probes:
            scores.update(probe(model, self.tokenizer))
        return scores

    def start(self) -> dict:
        """Evaluate and checkpoint the initial model as round 0."""
        dp = self._tree_rule() if self.tree is not None else {}
        if self.clip is not None:  # the first round's clip
            dp = {**dp, "clip": self.clip.norm, "clip_quantile": self.clip.quantile}
        info = {"dp": dp} if dp else {}
        return self._record(
            0, self.global_state, [], [], bytes_up=0, bytes_down=0, seconds=0.0, info=info
        )

    # -- what a DP run fixes once it knows its population ------------------------------------

    def _fix_population(self, population: int, check: bool = False) -> None:
        """The accountant sees the population (the default delta, 1 / N^1.1, follows the
        largest); the tree's b and adaptive clipping's default sigma_b (the expected cohort /
        20, refused in one line when too small for z) are fixed by the first one seen."""
        if self.accountant is None or population <= 0:
            return
        self.accountant.observe(population)
        if self.tree is not None:
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

    def _apply_update_z(self) -> None:
        """The tree's nodes and its accountant take z_u and sigma_b (adaptive clipping)."""
        z_u = self._update_z()
        if self.tree is not None:
            self.tree.noise_multiplier = z_u
        if isinstance(self.accountant, dp_ftrl.TreeAccountant) and self.clip is not None:
            self.accountant.noise_multiplier = z_u
            self.accountant.count_stddev = self.clip.count_stddev

    # -- DP-FTRL's participation rule ----------------------------------------------------------

    def _min_separation(self, population: int, check: bool = False) -> int:
        """The tree's b: the configured one (with `check`, refused when `population` phones
        cannot fill a cohort every round under it), or, left to the default, the largest the
        first population seen allows, fixed for the run (the accountant keeps it)."""
        if not isinstance(self.accountant, dp_ftrl.TreeAccountant):
            raise RuntimeError("the minimum separation is the tree mechanism's")
        m = cohort_size(self.strategy.fraction, population)
        b = self.accountant.min_separation
        if b is None:
            b = self.accountant.min_separation = dp_ftrl.default_separation(population, m)
        elif check:
            problem = dp_ftrl.separation_problem(population, m, b)
            if problem is not None:
                raise ValueError(problem)
        return b

    def _tree_rule(self) -> dict:
        """What every tree row says of the rule the accounting assumes."""
        acc = self.accountant
        b = acc.min_separation if isinstance(acc, dp_ftrl.TreeAccountant) else None
        return {
            "mechanism": "tree",
            "noise_multiplier": self.config.privacy.noise_multiplier,
            "min_separation": b,
        }

    def _tree_cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str]:
        """Round r's cohort under the tree: m = the strategy's share of the available phones,
        drawn uniformly (as the uniform selector draws) from those that did not train in the
        last b - 1 rounds; fewer when fewer are eligible (a server whose phones are offline)."""
        b = self._min_separation(len(available))
        ids = dp_ftrl.eligible(available, self.last_trained, r, b)
        m = min(cohort_size(self.strategy.fraction, len(available)), len(ids))
        if m >= len(ids):
            return ids
        return sorted(ids[i] for i in rng.choice(len(ids), size=m, replace=False))

    # -- one round -----------------------------------------------------------------------------

    def plan_round(self, available: list[str], attempt: int = 0) -> RoundPlan:
        """The next round's cohort, drawn from `available` with an rng seeded by (seed, round).

        `attempt` > 0 re-plans a round that missed its quorum with a fresh draw.
        """
        r = self.round + 1
        rng = np.random.default_rng([self.config.seed, r] + ([attempt] if attempt else []))
        p = self.config.privacy
        self._fix_population(len(available))
        if self.tree is not None:
            cohort = self._tree_cohort(r, sorted(available), rng)
        elif p.dp and p.sampling == "poisson":
            cohort = self._poisson_cohort(sorted(available), rng)
        else:
            # Strategies count rounds from 0; the engine's round 0 is the initial model.
            cohort = sorted(self.strategy.select(r - 1, sorted(available), rng))
        train = self.config.train
        epochs = self.strategy.local_epochs_override
        if epochs is not None:
            train = replace(train, epochs=epochs)
        if self.config.lr_decay != 1.0:
            train = replace(train, lr=scheduled_lr(train.lr, self.config.lr_decay, r))
        return RoundPlan(
            round=r,
            cohort=cohort,
            train=train,
            started=time.perf_counter(),
            attempt=attempt,
            population=len(available),
        )

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

    def choose_uploaders(self, plan: RoundPlan, losses: dict[str, float]) -> list[str]:
        return sorted(self.strategy.select_uploaders(plan.round - 1, losses))

    def complete_round(self, plan: RoundPlan, updates: list[ClientUpdate]) -> dict:
        """Aggregate the round's updates into a new global model, evaluate it and record it.

        All or nothing: if anything fails, the global model, the strategy's memory and the
        accountant are as before the call, and no checkpoint or metrics row is written.
        """
        if plan.round != self.round + 1:
            raise ValueError(f"round {plan.round} is not the open round {self.round + 1}")
        if not updates:
            raise ValueError(f"round {plan.round}: no updates to aggregate")
        updates = sorted(updates, key=lambda u: u.device_id)
        snapshot = json.loads(json.dumps(self.server_state()))  # a deep copy
        try:
            new_state, info = self._aggregate(plan, updates)
            new_state, opt_buffers = self.server_opt.step(self.global_state, new_state, plan.round)
            return self._record(
                plan.round,
                new_state,
                plan.cohort,
                [u.device_id for u in updates],
                bytes_up=self.model_bytes * len(updates),
                bytes_down=self.model_bytes * len(plan.cohort),
                seconds=time.perf_counter() - plan.started,
                info=info,
                opt_buffers=opt_buffers,
            )
        except BaseException:
            self.load_server_state(snapshot)
            raise

    def _aggregate(
        self, plan: RoundPlan, updates: list[ClientUpdate]
    ) -> tuple[dict[str, torch.Tensor], Info]:
        """Bound the updates (server.influence), aggregate them with the strategy, and under DP
        add the Gaussian noise calibrated to the aggregate's sensitivity and account for it."""
        p = self.config.privacy
        clip_norm = self.clip.norm if self.clip is not None else p.clip_norm  # C_t, or S
        bounded = bound_round(
            self.config.influence, self.global_state, updates, clip_norm, uniform=p.dp
        )
        new_state, info = self.strategy.aggregate(self.global_state, bounded, bounded.bound)
        info = {**info, "clip": bounded.info}
        if self.tree is not None:
            new_state, info["dp"] = self._add_tree_noise(plan, updates, new_state, bounded)
        elif p.dp:
            new_state, info["dp"] = self._add_noise(plan, new_state, bounded)
        if self.clip is not None:
            info["dp"].update(self._step_clip(plan, bounded))
        self.strategy.after_round(plan.round - 1, new_state, bounded)
        return {k: v.contiguous() for k, v in new_state.items()}, info

    def _add_noise(
        self, plan: RoundPlan, new_state: dict[str, torch.Tensor], bounded: BoundedRound
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """``N(0, (z Delta)^2)`` on the aggregate; the accountant steps (server.privacy)."""
        p, m, bound = self.config.privacy, len(bounded), bounded.bound
        if self.accountant is None or bound is None:  # __init__ makes both whenever DP is on
            raise RuntimeError("DP needs the privacy accountant and a bound")
        population = plan.population or len(self.strategy.client_sizes)
        if p.sampling == "poisson":
            # McMahan et al. 2018's fixed denominator: sum_k u_k / (q N), not the mean.
            expected = self.config.fraction * population
            factors = dict.fromkeys(bound.layers, m / expected)  # bound.layers: the floating keys
            new_state = scale_deltas(self.global_state, new_state, factors)
            sens = sensitivity.poisson_mean_sensitivity(expected, bound.norm)
        else:
            sens = self.strategy.sensitivity(self.global_state, bound, m)
        # Float32 models: the clip and the cast round, which moved the tight example of
        # tests/server/test_sensitivity_search.py up to 6e-5 past Delta at S = 0.01.
        std = self._update_z() * sens * (1 + 1e-4)
        gen = torch.Generator().manual_seed(
            client_seed(self.config.seed, plan.round, "server-noise")
        )
        new_state = privacy.add_gaussian_noise(new_state, std, gen)
        self.accountant.step(population, len(plan.cohort))
        return new_state, {
            "mechanism": "gaussian",
            "sensitivity": sens,
            "noise_std": std,
            "sampling": p.sampling,
            "clip": bound.norm,
        }

    def _step_clip(self, plan: RoundPlan, bounded: BoundedRound) -> dict:
        """Adaptive clipping (server.adaptive_clip): the noised fraction of the round's updates
        within C_t, and C_{t+1}. The count's noise is seeded by (seed, round) as the model's is,
        so a resumed run draws the same."""
        p, clip = self.config.privacy, self.clip
        if clip is None:
            raise RuntimeError("adaptive clipping is off")
        if p.sampling == "poisson":  # the fixed denominator q N, as the aggregate's
            denominator = self.config.fraction * (
                plan.population or len(self.strategy.client_sizes)
            )
        else:
            denominator = len(bounded)
        seed = client_seed(self.config.seed, plan.round, "clip-count-noise")
        draw = float(np.random.default_rng(seed).standard_normal())
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
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """DP-FTRL (server.dp_ftrl): the aggregate's step ``g_t = new_state - theta_{t-1}`` plus
        the tree's ``n_t - n_{t-1}``, so that ``theta_t = theta_0 + (noisy prefix sum of the
        g's)``; the cohort's phones are recorded for the separation rule."""
        bound, tree = bounded.bound, self.tree
        if not isinstance(self.accountant, dp_ftrl.TreeAccountant) or tree is None:
            raise RuntimeError("the tree mechanism needs its accountant and its tree")
        if bound is None:
            raise RuntimeError("DP needs a bound")
        b = self._min_separation(plan.population or len(self.strategy.client_sizes))
        sens = self.strategy.sensitivity(self.global_state, bound, len(bounded))
        # The float32 margin of _add_noise: every node's noise is z times at least this.
        residual = tree.release(self.global_state, sens * (1 + 1e-4))
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
        return new_state, {
            **self._tree_rule(),
            "sensitivity": sens,
            "noise_std": tree.noise_multiplier * sens * (1 + 1e-4),
            "clip": bound.norm,
            "release_noise_std": tree.release_std(),
            "tree_nodes": len(dp_ftrl.prefix_nodes(r)),
            "max_participations": -(-r // b),
        }

    # -- memory across rounds, for a restarted server ----------------------------------------------

    def server_state(self) -> dict:
        """Everything besides the weights that the next round depends on (JSON-serializable)."""
        state = {
            "strategy": self.strategy.state_dict(),
            "accountant": self.accountant.state_dict() if self.accountant is not None else None,
            "best": self.best,
        }
        if self.tree is not None:  # DP-FTRL: the rounds' sensitivities, the separation rule
            state["tree"] = {**self.tree.state_dict(), "last_trained": dict(self.last_trained)}
        if self.clip is not None:  # adaptive clipping: the next round's clip, sigma_b
            state["clip"] = self.clip.state_dict()
        return state

    def load_server_state(self, state: dict) -> None:
        self.strategy.load_state_dict(state["strategy"])
        if self.accountant is not None and state.get("accountant"):
            self.accountant.load_state_dict(state["accountant"])
        if self.tree is not None:
            tree = state.get("tree")
            if tree is None and state.get("accountant"):
                raise ValueError(
                    "this run was noised with the gaussian mechanism: resume it with "
                    "--dp-mechanism gaussian"
                )
            tree = tree or {}
            self.tree.load_state_dict(tree)
            self.last_trained = {str(d): int(s) for d, s in tree.get("last_trained", {}).items()}
        self._load_clip_state(state)
        self.best = state["best"]

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

    def snapshot(self) -> FederationState:
        """The in-memory state a round changes (shared tensors, not copies: nothing mutates them
        in place; a new round replaces them)."""
        return FederationState(
            self.round,
            self.global_state,
            self.server_state(),
            self.server_opt.buffers,
            self._public,
        )

    def restore(self, state: FederationState) -> None:
        """Adopt `state`, as :meth:`snapshot` gave it (here or in another process)."""
        self.load_server_state(state.server)
        self.server_opt.commit(state.opt_buffers)
        self.global_state = state.global_state
        self.round = state.round
        self._public = state.public

    def resume(self) -> bool:
        """Continue from the run's last checkpoint, if there is one; True when resumed.

        The checkpoint is the source of truth: metrics rows of later rounds (a crash between
        the two writes) are dropped, and a missing row is restored from the checkpoint.
        """
        path = self.storage.latest_checkpoint()
        if path is None:
            return False
        meta = read_metadata(path)
        name = self.config.label or self.config.strategy
        if meta["strategy"] != name:
            raise ValueError(
                f"{path} was written by strategy {meta['strategy']!r}, this run is {name!r}"
            )
        state = st_load(path.read_bytes())
        check_state(state, self.model_config)
        # In the model's own key order, as an uninterrupted run holds it (safetensors sorts
        # them): the gaussian noise (common.noise) is drawn key by key in this order.
        state = (
            {k: state[k] for k in self.global_state}
            if set(state) == set(self.global_state)
            else state
        )
        if self.server_opt.active and meta["round"] > 0:
            opt_path = self.storage.server_opt_path(meta["round"])
            if not opt_path.exists():
                raise ValueError(f"{opt_path} is missing: the server optimizer cannot resume")
            self.server_opt.commit(st_load(opt_path.read_bytes()))
        self.global_state = state
        self.round = meta["round"]
        self.load_server_state(meta["server"])
        rows = [r for r in self.storage.read_metrics() if r["round"] <= self.round]
        if not rows or rows[-1]["round"] < self.round:
            rows.append(meta["metrics"])
        self.storage.write_metrics(rows)
        return True

    def public_checkpoint(self) -> bytes:
        """The current global model as devices download it (models.checkpoint.public_bytes):
        kept in memory from the round that wrote it; read from its file once after a resume."""
        if self._public is None or self._public[0] != self.round:
            self._public = (self.round, public_bytes(self.storage.checkpoint_path(self.round)))
        return self._public[1]

    @property
    def budget_spent(self) -> bool:
        """True when one more DP round (of the usual cohort) would take epsilon past the budget."""
        if self.accountant is None:
            return False
        population = len(self.strategy.client_sizes)
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

    def _record(
        self,
        r,
        new_state,
        selected,
        aggregated,
        *,
        bytes_up,
        bytes_down,
        seconds,
        info,
        opt_buffers=None,
    ) -> dict:
        """Evaluate `new_state`, checkpoint it (atomic) and append its metrics row."""
        scores = self.evaluator(new_state)
        # Column-batched runs pick their best model as the seed papers' code did: by column
        # perplexity.
        key = "col_val_ppl" if "col_val_ppl" in scores else "val_ppl"
        if self.best is None or scores[key] < self.best[key]:
            kept = ("val_ppl", "test_ppl", "col_val_ppl", "col_test_ppl")
            self.best = {"round": r, **{k: scores[k] for k in kept if k in scores}}
        row = {
            "round": r,
            "strategy": self.config.label or self.config.strategy,
            "data": self.data,
            "selected": selected,
            "aggregated": aggregated,
            **scores,
            **{f"best_{k}": v for k, v in self.best.items()},
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "epsilon": self.accountant.epsilon if self.accountant is not None else None,
            "rho": self.accountant.rho if self.accountant is not None else None,
            "delta": self.accountant.delta if self.accountant is not None else None,
            "seconds": round(seconds, 3),
            "train_precision": self.train_precision,
            "eval_precision": self.eval_precision,
            "eval_device": self.eval_device.type,
            "info": info,
        }
        if self.server_opt.active and opt_buffers:
            # Written before the checkpoint, which is the commit point of the round.
            buffers = st_save({k: v.contiguous() for k, v in opt_buffers.items()})
            atomic_write(self.storage.server_opt_path(r), buffers)
        strategy = self.config.label or self.config.strategy
        save_checkpoint(
            self.storage.checkpoint_path(r),
            new_state,
            self.model_config,
            self.tokenizer,
            round_idx=r,
            strategy=strategy,
            extra={"metrics": row, "server": self.server_state()},
        )
        self.storage.append_metrics(row)
        if self.config.keep_checkpoints:  # after the commit point: a crash keeps what it had
            latest = range(r - self.config.keep_checkpoints + 1, r + 1)
            prune_checkpoints(self.storage.root, {*latest, self.best["round"]})
        # What devices download: the same file without the server's private memory, from memory.
        public = checkpoint_bytes(
            new_state,
            self.model_config,
            self.tokenizer,
            round_idx=r,
            strategy=strategy,
            extra={"metrics": row},
        )
        self._public = (r, public)
        if opt_buffers is not None:
            self.server_opt.commit(opt_buffers)
        self.global_state = new_state
        self.round = r
        return row
