"""The round engine: one implementation of a federated round, shared by every transport.

    plan_round()      the strategy selects a cohort and the task it is given
                      (fedkey.federation.plan)
    choose_uploaders  (FedMed topK) which of the trained devices upload
    complete_round()  privacy -> aggregate -> evaluate -> checkpoint -> metrics row

`fedkey simulate` drives it with a pool of local worker processes; the HTTP server drives the
same object with real devices. Differential privacy (the accountant, DP-FTRL's tree, adaptive
clipping) is one composed object, fedkey.federation.privacy.round.RoundPrivacy. Selection is seeded by (seed,
round), so a run without DP is deterministic; under DP the noise and the cohorts the accountant
samples come from the run's secret (fedkey.federation.privacy.secret), keyed by round. Either way a run can resume
at any round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.common.files import atomic_write
from fedkey.federation.config import FederationConfig
from fedkey.federation.influence.bounding import bound_round, make_bound
from fedkey.federation.metrics_row import public_info, public_row
from fedkey.federation.plan import plan_round
from fedkey.federation.privacy.round import RoundPrivacy
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.seeds import (
    client_seed as client_seed,  # re-exported: callers import it here
)
from fedkey.federation.server_opt import ServerOptimizer
from fedkey.federation.storage import RunStorage, prune_checkpoints
from fedkey.federation.strategies import ClientUpdate, Info, get_strategy
from fedkey.federation.updates.summed import SummedRound, SumRule, can_sum, sum_rule
from fedkey.models.checkpoint import (
    build_model,
    check_state,
    checkpoint_bytes,
    initial_state,
    public_bytes,
    read_metadata,
    save_checkpoint,
)
from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel
from fedkey.models.precision import resolve_device, resolve_precision
from fedkey.models.tokenizers import Tokenizer

if TYPE_CHECKING:
    from fedkey.federation.plan import RoundPlan
    from fedkey.models.mixture import NgramMixture


@dataclass
class FederationState:
    """Everything :meth:`Federation.complete_round` reads and changes in memory (the files it
    writes aside): what crosses to and from the aggregation process (fedkey.server.aggregator)."""

    round: int
    global_state: dict[str, torch.Tensor]
    server: dict  # Federation.server_state(): strategy memory, accountant, best
    opt_buffers: dict[str, torch.Tensor]
    public: tuple[int, bytes] | None  # (round, public checkpoint bytes)


Evaluator = Callable[[dict[str, torch.Tensor]], dict]
#: A round metric besides perplexity (a backdoor's success, a canary's exposure): called with the
#: evaluated model and the tokenizer, its dict is merged into the round's metrics row.
Probe = Callable[[LanguageModel, Tokenizer], dict]


def _mixture(
    config: FederationConfig, tokenizer: Tokenizer, valid: list[str], test: list[str]
) -> NgramMixture:
    """The run's n-gram (config.ngram, a fedkey-kn-1 file) beside its model: a ValueError of one
    line when it cannot be read, is not an n-gram file, or has another vocabulary."""
    from fedkey.models.mixture import NgramMixture
    from fedkey.models.ngram import KneserNey
    from fedkey.models.tokenizers import WordTokenizer

    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError("--ngram mixes an n-gram with a word-vocabulary model (--tokenizer word)")
    try:
        ngram = KneserNey.load(str(config.ngram), tokenizer)
        return NgramMixture(ngram, tokenizer, valid, test, config.ksr_sentences)
    except ValueError as e:
        raise ValueError(f"--ngram {e}") from None


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
        # precision "auto" resolves to there (fedkey.models.precision). Both are in every metrics row.
        self.eval_device = resolve_device(config.eval_device)
        self.eval_precision = resolve_precision(asked, self.eval_device)
        self.train_precision = train_precision or (None if asked == "auto" else asked)
        self.strategy = get_strategy(
            config.strategy, fraction=config.fraction, **config.strategy_params
        )
        self.strategy.setup(client_sizes, config.rounds)
        # DP (fedkey.federation.privacy.round): the accountant, the tree's noise, the adaptive clip; without DP
        # an empty one. It refuses, in one line, what cannot run with a DP guarantee.
        secret = RunSecret(storage.root, config.privacy.secret)
        self.privacy = RoundPrivacy(config, self.strategy, secret)
        if client_sizes:  # simulate knows its population: b, sigma_b and delta are fixed now
            self.privacy.observe(len(client_sizes), check=True)
        self.server_opt = ServerOptimizer(config.server_opt)
        torch.manual_seed(config.seed)
        self.global_state = initial_state(model_config, config.init)
        self.model_bytes = state_bytes(self.global_state)
        self.round = 0  # rounds completed
        self.best: dict | None = None
        # --ngram: every round also scores the model mixed with this n-gram (refused now, in one
        # line, when it cannot be read or was built for another vocabulary).
        self.mixture = _mixture(config, tokenizer, valid, test) if config.ngram else None
        self._public: tuple[int, bytes] | None = None  # (round, public checkpoint bytes)
        self._saved: list[int] = []  # the rounds this run checkpointed (pruning keeps the last)
        # Where the held-out fields of `evaluate` come from when not from the model here (a
        # simulation's resident trainers score them side by side): state -> those fields, the
        # keystroke savings left to `evaluate`. Not with an n-gram (its taps read the batches).
        self.held_out_scorer: Evaluator | None = None

    # -- evaluation ---------------------------------------------------------------------------

    def evaluate(self, state: dict[str, torch.Tensor]) -> dict:
        """Validation and test perplexity, top-1/top-3 and keystroke savings of `state`; with an
        n-gram, the mixture's too (fedkey.models.mixture.MIX_FIELDS), from the same batches."""
        from fedkey.models.metrics import column_perplexity, held_out_scores, ksr_of

        device = self.eval_device
        model = build_model(self.model_config, state).to(device)
        precision = self.eval_precision
        mixed = self.mixture.round() if self.mixture is not None else None
        scores: dict
        if self.held_out_scorer is not None and mixed is None:  # scored elsewhere, side by side
            scores = self.held_out_scorer(state)
            scores["ksr"] = ksr_of(
                model, self.tokenizer, self.test, self.config.ksr_sentences, precision
            )
        else:
            scores = held_out_scores(
                model, self.tokenizer, self.valid, self.test, self.config.eval_batch_size,
                device, precision, self.config.ksr_sentences,
                mixed.taps if mixed is not None else None, self.config.eval_topk,
            )  # fmt: skip
        if mixed is not None:
            scores.update(mixed.fields(model, precision))
        if self.config.train.batching == "columns":  # the seed papers' code's measure, beside ours
            for key, text in (("col_val_ppl", self.valid), ("col_test_ppl", self.test)):
                scores[key] = column_perplexity(
                    model, self.tokenizer, text, device=device, precision=precision
                )
        model.to("cpu")  # the probes (fedkey.models.exposure) score on the CPU
        for probe in self.probes:
            scores.update(probe(model, self.tokenizer))
        return scores

    def start(self) -> dict:
        """Evaluate and checkpoint the initial model as round 0."""
        info = self.privacy.start_info()
        return self._record(
            0,
            self.global_state,
            [],
            [],
            uploaded=[],
            bytes_up=0,
            bytes_down=0,
            seconds=0.0,
            info=info,
        )

    # -- one round -----------------------------------------------------------------------------

    def plan_round(self, available: list[str], attempt: int = 0) -> RoundPlan:
        """The next round's cohort, drawn from `available`, and its task
        (fedkey.federation.plan.plan_round); `attempt` > 0 re-plans a round that missed its
        quorum with a fresh draw."""
        return plan_round(
            self.config, self.strategy, self.privacy, self.round + 1, available, attempt
        )

    def choose_uploaders(self, plan: RoundPlan, losses: dict[str, float]) -> list[str]:
        return sorted(self.strategy.select_uploaders(plan.round - 1, losses))

    def complete_round(self, plan: RoundPlan, updates: list[ClientUpdate]) -> dict:
        """Aggregate the round's updates into a new global model, evaluate it and record it.

        All or nothing: if anything fails, the global model, the strategy's memory and the
        accountant are as before the call, and no checkpoint or metrics row is written.
        """
        if not updates:
            raise ValueError(f"round {plan.round}: no updates to aggregate")
        updates = sorted(updates, key=lambda u: u.device_id)
        uploaded = [u.device_id for u in updates]
        return self._commit(plan, uploaded, partial(self._aggregate, plan, updates))

    def complete_summed_round(self, plan: RoundPlan, summed: SummedRound) -> dict:
        """:meth:`complete_round` from the round's phones summed where they trained
        (fedkey.federation.updates.summed) by :meth:`sum_rule`, for a federation whose rounds
        can be (:attr:`summable`); all or nothing, as there."""
        if not self.summable:
            raise ValueError(
                "this federation's rounds need each phone's update (the trim, the outlier "
                "filter, or a strategy whose weights read the whole cohort): they cannot be "
                "summed where the phones train"
            )
        rule = self.sum_rule()
        if summed.partial.rule != rule:
            raise ValueError(
                f"round {plan.round} was summed as {summed.partial.rule}, not as this round "
                f"sums ({rule})"
            )
        return self._commit(plan, sorted(summed.device_ids), partial(self._sum, plan, summed))

    @property
    def summable(self) -> bool:
        """Whether a round may be summed where its phones train (fedkey.federation.updates.summed.can_sum)."""
        return can_sum(self.config, self.strategy)

    def sum_rule(self) -> SumRule:
        """How the open round's phones are summed where they train: FedAvg's weights, and
        under DP clipped to the round's clip (C_t, or S) with every weight 1 (FedAtt's fixed
        normalizer: its attention weights)."""
        clip = self.privacy.clip_norm()
        bound = None
        if clip is not None:
            bound = make_bound(self.config.influence, self.global_state, [], clip)
        return sum_rule(self.strategy, bound)

    def _commit(
        self,
        plan: RoundPlan,
        uploaded: list[str],
        aggregate: Callable[[], tuple[dict[str, torch.Tensor], Info, list[str]]],
    ) -> dict:
        """Aggregate (`aggregate()`: the new weights, the round's info, the phones aggregated),
        step the server optimizer, evaluate and record the round; on any failure the server's
        memory is restored."""
        if plan.round != self.round + 1:
            raise ValueError(f"round {plan.round} is not the open round {self.round + 1}")
        snapshot = json.loads(json.dumps(self.server_state()))  # a deep copy
        try:
            new_state, info, kept = aggregate()
            new_state, opt_buffers = self.server_opt.step(self.global_state, new_state, plan.round)
            return self._record(
                plan.round,
                new_state,
                plan.cohort,
                kept,
                uploaded=uploaded,
                bytes_up=self.model_bytes * len(uploaded),
                bytes_down=self.model_bytes * len(plan.cohort),
                seconds=time.perf_counter() - plan.started,
                info=info,
                opt_buffers=opt_buffers,
            )
        except BaseException:
            self.load_server_state(snapshot)
            raise

    def _sum(
        self, plan: RoundPlan, summed: SummedRound
    ) -> tuple[dict[str, torch.Tensor], Info, list[str]]:
        """FedAvg's step from a summed round and, under DP, its noise and accounting, as
        :meth:`_aggregate` does for the per-phone path (:attr:`summable`)."""
        new_state, info = self.strategy.aggregate(self.global_state, summed, summed.bound)
        info = {**info, "clip": summed.info(self.config.influence.weight_cap)}
        new_state, dp = self.privacy.noise(
            plan, list(summed.updates), new_state, summed, self.global_state
        )
        if dp is not None:
            info["dp"] = dp
        return {k: v.contiguous() for k, v in new_state.items()}, info, sorted(summed.device_ids)

    def _aggregate(
        self, plan: RoundPlan, updates: list[ClientUpdate]
    ) -> tuple[dict[str, torch.Tensor], Info, list[str]]:
        """Bound the updates (fedkey.federation.influence.bounding), aggregate them with the strategy, and under DP
        add the noise calibrated to the aggregate's sensitivity and account for it
        (fedkey.federation.privacy.round). -> (the new weights, the round's info, the phones aggregated: those
        the outlier filter kept)."""
        bounded = bound_round(
            self.config.influence,
            self.global_state,
            updates,
            self.privacy.clip_norm(),  # C_t, or S
            uniform=self.config.privacy.dp,
        )
        new_state, info = self.strategy.aggregate(self.global_state, bounded, bounded.bound)
        info = {**info, "clip": bounded.info}
        new_state, dp = self.privacy.noise(plan, updates, new_state, bounded, self.global_state)
        if dp is not None:
            info["dp"] = dp
        self.strategy.after_round(plan.round - 1, new_state, bounded)
        kept = [u.device_id for u in bounded.updates]
        return {k: v.contiguous() for k, v in new_state.items()}, info, kept

    # -- memory across rounds, for a restarted server ----------------------------------------------

    def server_state(self) -> dict:
        """Everything besides the weights that the next round depends on (JSON-serializable):
        the strategy's memory, DP's "accountant" (and "tree", "clip": fedkey.federation.privacy.round), best."""
        dp = self.privacy.state_dict()
        return {
            "strategy": self.strategy.state_dict(),
            "accountant": dp.pop("accountant"),
            "best": self.best,
            **dp,
        }

    def load_server_state(self, state: dict) -> None:
        self.strategy.load_state_dict(state["strategy"])
        self.privacy.load_state_dict(state)
        self.best = state["best"]

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
        # them): the gaussian noise (fedkey.common.noise) is drawn key by key in this order.
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
        self._saved = [self.round]
        self.load_server_state(meta["server"])
        rows = [r for r in self.storage.read_metrics() if r["round"] <= self.round]
        if not rows or rows[-1]["round"] < self.round:
            rows.append(meta["metrics"])
        self.storage.write_metrics(rows)
        return True

    def public_checkpoint(self) -> bytes:
        """The current global model as devices download it (fedkey.models.checkpoint.public_bytes):
        kept in memory from the round that wrote it; read from its file once after a resume."""
        if self._public is None or self._public[0] != self.round:
            path = self.storage.checkpoint_path(self.round)
            row = partial(public_row, privacy=self.config.privacy)
            self._public = (self.round, public_bytes(path, metrics=row))
        return self._public[1]

    @property
    def budget_spent(self) -> bool:
        """True when one more DP round (of the usual cohort) would take epsilon past the budget."""
        return self.privacy.would_exceed(len(self.strategy.client_sizes))

    def _checkpointed(self, r: int) -> bool:
        """Whether round `r` writes its checkpoint: every config.checkpoint_every rounds, round
        0, a new best round (what an export serves) and the run's last round."""
        every = self.config.checkpoint_every
        best = self.best is not None and self.best["round"] == r
        return r % every == 0 or best or r >= self.config.rounds

    def _record(
        self,
        r,
        new_state,
        selected,
        aggregated,
        *,
        uploaded,
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
            "uploaded": uploaded,
            "aggregated": aggregated,
            **scores,
            **{f"best_{k}": v for k, v in self.best.items()},
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            **self.privacy.row_fields(),  # epsilon, rho, delta
            "seconds": round(seconds, 3),
            "train_precision": self.train_precision,
            "eval_precision": self.eval_precision,
            "eval_device": self.eval_device.type,
            # Under DP only what the guarantee covers: the strategy keeps its memory, the row
            # publishes no exact function of the phones' updates (fedkey.federation.metrics_row).
            "info": public_info(info, self.config.privacy),
        }
        strategy = self.config.label or self.config.strategy
        if self._checkpointed(r):
            if self.server_opt.active and opt_buffers:
                # Written before the checkpoint, which is the commit point of the round.
                buffers = st_save({k: v.contiguous() for k, v in opt_buffers.items()})
                atomic_write(self.storage.server_opt_path(r), buffers)
            save_checkpoint(
                self.storage.checkpoint_path(r),
                new_state,
                self.model_config,
                self.tokenizer,
                round_idx=r,
                strategy=strategy,
                extra={"metrics": row, "server": self.server_state()},
            )
            self._saved.append(r)
        self.storage.append_metrics(row)
        if self.config.keep_checkpoints:  # after the commit point: a crash keeps what it had
            latest = self._saved[-self.config.keep_checkpoints :]
            prune_checkpoints(self.storage.root, {*latest, self.best["round"]})
        # What devices download: the same file without the server's private memory, from memory.
        public = checkpoint_bytes(
            new_state,
            self.model_config,
            self.tokenizer,
            round_idx=r,
            strategy=strategy,
            extra={"metrics": public_row(row, self.config.privacy)},
        )
        self._public = (r, public)
        if opt_buffers is not None:
            self.server_opt.commit(opt_buffers)
        self.global_state = new_state
        self.round = r
        return row
