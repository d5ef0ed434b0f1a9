"""`fedkey simulate`: the round engine with the phones' training on a training backend
(fedkey.device_sim.training.backends): this machine's processes (`local`) or trainer actors on a Ray cluster
(`ray`, fedkey.device_sim.training.ray_pool).

Each round the server's Federation plans a cohort, the backend trains it (one torch thread per
trainer: on a 2-core machine two single-threaded trainers side by side beat one two-threaded
trainer by far), and the Federation aggregates. Training is seeded per (seed, round, device), so
the global weights depend neither on the number of workers nor on the backend. Results arrive as
phones finish and each upload is prepared and checked on arrival; the aggregation itself takes
the updates in the cohort's order (Federation.complete_round sums floats in list order, so a
completion order would make the weights depend on timing). Under `ray` a phone whose trainer
died twice in a round is left out of it and named in the row's `lost` field; the row's
`trained_on` counts the phones each Ray node trained.

With `malicious` > 0 the last phones (by name, as in `fedkey devices`) attack
(fedkey.device_sim.attacks), and every upload passes the HTTP server's checks (fedkey.federation.updates.validation): a
refused one (NaN, wrong tensors) is dropped and named in the row's `rejected` field, as the server
drops it with a 422. With attack "backdoor" every row reports the backdoor's success
(backdoor_top1, backdoor_top3), also with no attacker: the clean model's rate.

The round engine's setup (make_federation) and its start or resumption (start_or_resume) also
serve `fedkey train-central` (fedkey.runners.baselines). On a corpus with held-out senders (NUS SMS,
Ubuntu IRC: ``Corpus.unseen_test``) every row also scores their messages (`UnseenProbe`: the
``unseen_*`` fields), as `fedkey ngram` does its n-gram's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from fedkey.common.config import DataConfig
from fedkey.corpora.dataset import PreparedData, prepare
from fedkey.device_sim.attacks import (
    BackdoorProbe,
    apply_attack,
    backdoor_ids,
    backdoor_task,
    boost_factor,
    trigger_contexts,
)
from fedkey.device_sim.config import ATTACKS, Attack, BackdoorConfig
from fedkey.device_sim.ray_cluster import RayOptions
from fedkey.device_sim.training.backends import Backend, TrainingBackend, make_backend
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.device_sim.training.resident import ResidentPool
from fedkey.device_sim.training.trainer import TrainResult
from fedkey.federation.config import FederationConfig
from fedkey.federation.engine import Federation, Probe, client_seed
from fedkey.federation.plan import RoundPlan
from fedkey.federation.storage import RunStorage
from fedkey.federation.strategies import ClientUpdate
from fedkey.federation.updates.summed import PartialSum, SummedRound, widened
from fedkey.federation.updates.validation import ValidationError, check_finite, check_tensors
from fedkey.models.batching import count_targets
from fedkey.models.config import ModelConfig
from fedkey.models.held_out import fields, merged
from fedkey.models.metrics import words_of
from fedkey.models.precision import resolve_device, resolve_precision
from fedkey.runners.spool import UploadSpool, tensor_bytes


class _Rejections:
    """A probe: the round's refused uploads as the row's `rejected` field, {device: reason}."""

    def __init__(self) -> None:
        self.current: dict[str, str] = {}

    def __call__(self, model, tokenizer) -> dict:
        return {"rejected": dict(self.current)}


class _Placement:
    """A probe for the ray backend: the round's lost phones ({device: why}) and how many phones
    each Ray node trained ({node id: phones})."""

    def __init__(self) -> None:
        self.lost: dict[str, str] = {}
        self.trained_on: dict[str, int] = {}

    def __call__(self, model, tokenizer) -> dict:
        return {"lost": dict(self.lost), "trained_on": dict(self.trained_on)}


class UnseenProbe:
    """A round metric: the model's test fields on the messages of the held-out senders who never
    trained (fedkey.models.metrics.unseen_scores), scored on the CPU as the probes are."""

    def __init__(
        self,
        unseen: list[str],
        ksr_sentences: int,
        batch_size: int = 64,
        precision="fp32",
        topk: bool = True,
    ) -> None:
        self.unseen = unseen
        self.ksr_sentences = ksr_sentences
        self.batch_size = batch_size
        self.precision = precision
        self.topk = topk

    def __call__(self, model, tokenizer) -> dict:
        from fedkey.models.metrics import unseen_scores

        return unseen_scores(
            model, tokenizer, self.unseen, self.batch_size, "cpu", self.precision,
            self.ksr_sentences, self.topk,
        )  # fmt: skip


def _lost_phones(pool: TrainingBackend, cohort: list[str], results: dict) -> dict[str, str]:
    """The cohort's phones that came back with no result, and why (the ray backend says)."""
    why = getattr(pool, "lost", {})
    return {d: why.get(d, "no result") for d in cohort if d not in results}


def _trained_on(pool: TrainingBackend, devices) -> dict[str, int]:
    """Phones per Ray node this round (empty for the local backend)."""
    nodes_used = getattr(pool, "nodes_used", None)
    return nodes_used(devices) if nodes_used is not None else {}


def make_federation(
    fed,
    model_config,
    prepared,
    shards,
    out_dir: str,
    device: str,
    probes: list[Probe] | None = None,
) -> Federation:
    """The round engine over `shards` (device -> sentences), storing the run in `out_dir`; the
    phones train on `device` of this machine, so their precision is known (and recorded)."""
    torch.set_num_threads(1)
    sizes = {d: sum(len(s) - 1 for s in shard) for d, shard in shards.items()}
    probes = list(probes or [])
    if prepared.corpus.unseen_test:
        precision = resolve_precision(fed.train.precision, "cpu")
        probes.append(
            UnseenProbe(prepared.corpus.unseen_test, fed.ksr_sentences, fed.eval_batch_size,
                        precision, fed.eval_topk)
        )  # fmt: skip
    return Federation(
        fed,
        model_config,
        prepared.tokenizer,
        sizes,
        prepared.corpus.valid,
        prepared.corpus.test,
        RunStorage(out_dir),
        probes=probes,
        train_precision=resolve_precision(fed.train.precision, resolve_device(device)),
        data=prepared.corpus.name,
    )


@dataclass
class SimulationConfig:
    """What `simulate` runs: `fed.rounds` rounds of `fed` on the phones of `data`, the model
    `model_config_for(vocab size)`, the run stored in `out_dir`.

    The phones train on `backend`: `workers` local processes (None: one per core, 0: in this
    process) on `device`, or the trainer actors of the Ray cluster `ray` describes.
    `progress`: a progress bar. `resume`: a run directory that already holds checkpoints
    continues after its last one. The last `malicious` phones (sorted names) upload `attack`
    (`backdoor` configures the backdoor attack; default BackdoorConfig()). `probes`: extra round
    metrics (fedkey.federation.engine.Probe), e.g. a canary's exposure (fedkey.models.exposure.ExposureProbe).
    """

    data: DataConfig
    fed: FederationConfig
    model_config_for: Callable[[int], ModelConfig]  # vocab size -> model config
    out_dir: str
    workers: int | None = None
    device: str = "auto"
    progress: bool = True
    resume: bool = False
    malicious: int = 0
    attack: Attack = "scale"
    backdoor: BackdoorConfig | None = None
    probes: list[Probe] | None = None
    backend: Backend = "local"
    ray: RayOptions | None = None


@dataclass
class _Run:
    """A simulation under way: its data, its attackers, its round engine and its own probes."""

    config: SimulationConfig
    prepared: PreparedData
    model_config: ModelConfig
    backdoor: BackdoorConfig
    bad: set[str]  # the attacking phones
    federation: Federation
    rejections: _Rejections
    placement: _Placement
    spool: UploadSpool  # the round's uploads until aggregated: in memory, or on disk if large

    @property
    def summed(self) -> bool:
        """Whether the rounds are summed where the phones train (fedkey.federation.updates.summed):
        a FedAvg round nothing needs per phone, no attacker, and a backend that gives its
        results in a fixed order (not Ray's: a round's sum would depend on timing)."""
        return self.federation.summable and not self.bad and self.config.backend != "ray"


def simulate(config: SimulationConfig) -> list[dict]:
    """Run rounds up to `config.fed.rounds` (SimulationConfig); returns the metrics rows (also in
    config.out_dir)."""
    if config.attack not in ATTACKS:
        raise ValueError(f"unknown attack {config.attack!r}; choose one of {ATTACKS}")
    # Start the workers first: they import torch while the data loads and round 0 is evaluated.
    pool = make_backend(config.backend, config.workers, config.ray, resident=True)
    try:
        run = _prepare_run(config)
        _score_in_workers(run.federation, pool)
        rows, _ = start_or_resume(run.federation, config.resume)
        _run_rounds(run, pool, rows)
    finally:
        pool.close()
    run.federation.storage.plot(_title(run))
    return rows


def _score_in_workers(federation: Federation, pool: TrainingBackend) -> None:
    """Have resident trainer processes score every round's held-out fields while they would
    otherwise wait (fedkey.models.held_out): where there are such processes, the server
    evaluates on the CPU, and no n-gram reads the batches."""
    if not (isinstance(pool, ResidentPool) and pool.workers > 0):
        return
    if federation.eval_device.type != "cpu" or federation.mixture is not None:
        return
    tok, valid, test = federation.tokenizer, federation.valid, federation.test
    sets = {"valid": (valid, False), "test": (test, federation.config.eval_topk)}
    config, precision = federation.config, federation.eval_precision
    pool.hold_sets(tok, federation.model_config, sets, config.eval_batch_size, precision)
    valid_words, test_words = words_of(tok, valid), words_of(tok, test)

    def score(state: dict[str, torch.Tensor]) -> dict:
        tallies = pool.score(state)
        return fields(
            merged(tallies["valid"]), valid_words, merged(tallies["test"]), test_words, None
        )

    federation.held_out_scorer = score


def _title(run: _Run) -> str:
    return f"{run.config.fed.strategy} on {run.prepared.corpus.name}"


def _prepare_run(config: SimulationConfig) -> _Run:
    """The data, the attackers, the probes and the round engine of a simulation."""
    backdoor = config.backdoor or BackdoorConfig()
    prepared = prepare(config.data)
    model_config = config.model_config_for(prepared.tokenizer.vocab_size)
    bad = _attackers(sorted(prepared.shards), config.malicious)
    probes = list(config.probes or [])
    if config.attack == "backdoor":
        backdoor_ids(backdoor, prepared.tokenizer)  # refuses words the tokenizer lacks
        contexts = trigger_contexts(prepared.corpus.test, backdoor.trigger, seed=config.data.seed)
        probes.append(BackdoorProbe(backdoor, contexts))
    rejections = _Rejections()
    if bad:
        probes.append(rejections)
    placement = _Placement()
    if config.backend == "ray":
        probes.append(placement)
    federation = make_federation(
        config.fed, model_config, prepared, prepared.shards, config.out_dir, config.device, probes
    )
    spool = UploadSpool(Path(config.out_dir) / "uploads")
    return _Run(
        config, prepared, model_config, backdoor, bad, federation, rejections, placement, spool
    )


def _attackers(names: list[str], malicious: int) -> set[str]:
    """The last `malicious` of the phones `names` (sorted)."""
    if not 0 <= malicious <= len(names):
        raise ValueError(f"--malicious {malicious}: there are {len(names)} phones")
    return set(names[len(names) - malicious :]) if malicious else set()


def _run_rounds(run: _Run, pool: TrainingBackend, rows: list[dict]) -> None:
    """The rounds after the last of `rows` up to fed.rounds (each row appended), under a progress
    bar; stops early when another round would pass the privacy budget."""
    fed, federation = run.config.fed, run.federation
    bar = tqdm(
        range(federation.round, fed.rounds),
        initial=federation.round,
        total=fed.rounds,
        desc=_title(run),
        disable=not run.config.progress,
        unit="round",
    )
    last = rows[-1]  # round 0's, or the round a resumed run continues from
    bar.set_postfix({k: f"{last[k]:.1f}" for k in ("test_ppl", "val_ppl") if k in last})
    for _ in bar:
        if federation.budget_spent:
            bar.write(
                f"privacy budget: another round would pass epsilon {fed.privacy.target_epsilon}; stopping"
            )
            break
        row = _run_round(run, pool, bar)
        rows.append(row)
        bar.set_postfix(val_ppl=f"{row['val_ppl']:.1f}", test_ppl=f"{row['test_ppl']:.1f}")


def _run_round(run: _Run, pool: TrainingBackend, bar: tqdm) -> dict:
    """One round: plan it, train its cohort, check the uploads, aggregate; its metrics row."""
    federation = run.federation
    plan = federation.plan_round(list(run.prepared.shards))
    tasks = _round_tasks(run, plan)
    if run.summed:
        return _run_summed_round(run, pool, plan, tasks)
    run.spool.start(len(plan.cohort), tensor_bytes(federation.global_state))
    try:
        results, uploads = _train_and_check(run, pool, plan, tasks)
        lost = _lost_phones(pool, plan.cohort, results)
        run.placement.lost, run.placement.trained_on = lost, _trained_on(pool, results)
        if lost:
            bar.write(f"round {plan.round}: lost {len(lost)} phone(s) ({', '.join(lost)})")
        updates = _round_updates(run, plan, results, uploads, lost)
        return federation.complete_round(plan, updates)
    finally:
        run.spool.clear()


def _run_summed_round(
    run: _Run, pool: TrainingBackend, plan: RoundPlan, tasks: list[LocalTask]
) -> dict:
    """One round summed where its phones train: the resident workers' partial sums, or (the
    stacked backend) each result added to the sum as it comes and dropped; no upload kept."""
    federation = run.federation
    state, rule = federation.global_state, federation.sum_rule()
    if isinstance(pool, ResidentPool):
        partial = pool.sum_round(tasks, state, rule)
    else:
        partial, wide = PartialSum.empty(state, rule), widened(state)
        for d, result in pool.stream(tasks, state):
            if result is not None:
                partial.add(d, result.state, result.num_tokens, result.train_loss, wide)
    run.rejections.current = dict(partial.rejected)
    if not partial.phones:
        why = "; ".join(f"{d}: {w}" for d, w in partial.rejected.items()) or "no phone trained"
        raise ValueError(f"round {plan.round}: every upload was refused ({why})")
    return federation.complete_summed_round(plan, SummedRound(partial))


def _round_tasks(run: _Run, plan: RoundPlan) -> list[LocalTask]:
    """The training task of each phone of the round's cohort (an attacker's, under the backdoor
    attack, trains on the backdoor's task)."""
    config, shards = run.config, run.prepared.shards
    fed = config.fed
    tasks = [
        LocalTask(
            d,
            shards[d],
            client_seed(fed.seed, plan.round, d),
            run.model_config,
            plan.train,
            fed.privacy.beta,
            fed.privacy.sigma,
            config.device,
        )
        for d in plan.cohort
    ]
    if config.attack == "backdoor":
        tasks = [
            backdoor_task(t, run.prepared.tokenizer, run.backdoor) if t.device_id in run.bad else t
            for t in tasks
        ]
    return tasks


def _train_and_check(
    run: _Run, pool: TrainingBackend, plan: RoundPlan, tasks: list[LocalTask]
) -> tuple[dict[str, TrainResult], dict[str, Mapping[str, torch.Tensor]]]:
    """(each phone's training result, each accepted upload) as the phones finish: an attacker's
    upload attacked, every upload through the HTTP server's checks (a refusal recorded in
    run.rejections)."""
    attack, bad, federation = run.config.attack, run.bad, run.federation
    attackers = sum(d in bad for d in plan.cohort)
    boost = boost_factor(run.backdoor, len(plan.cohort), attackers)
    results: dict[str, TrainResult] = {}
    uploads: dict[str, Mapping[str, torch.Tensor]] = {}
    run.rejections.current = {}
    for d, result in pool.stream(tasks, federation.global_state):
        if result is None:  # its trainer died twice: lost for this round
            continue
        if attack == "backdoor" and d in bad:  # declares its own shard's size, as if honest
            result = replace(result, num_tokens=count_targets(run.prepared.shards[d]))
        state = apply_attack(
            attack if d in bad else None, result.state, federation.global_state, boost
        )
        results[d] = replace(result, state={})  # the upload alone holds the tensors
        try:  # the HTTP server's checks on an upload's tensors, as it arrives
            check_tensors(state, run.model_config)
            check_finite(state)
            uploads[d] = run.spool.keep(state)
        except ValidationError as e:
            run.rejections.current[d] = f"{e.status} {e.message}"
    return results, uploads


def _round_updates(
    run: _Run,
    plan: RoundPlan,
    results: dict[str, TrainResult],
    uploads: dict[str, Mapping[str, torch.Tensor]],
    lost: dict[str, str],
) -> list[ClientUpdate]:
    """The updates to aggregate, in the cohort's order, from the phones chosen to upload; a
    ValueError when there is none."""
    trained = [d for d in plan.cohort if d in results]  # the cohort's order: see above
    uploaders = run.federation.choose_uploaders(plan, {d: results[d].train_loss for d in trained})
    chosen = set(uploaders)  # a refusal counts for a phone that was to upload
    rejections = run.rejections
    rejections.current = {d: w for d, w in rejections.current.items() if d in chosen}
    updates = [
        ClientUpdate(
            state=uploads[d],
            num_samples=results[d].num_tokens,
            train_loss=results[d].train_loss,
            device_id=d,
        )
        for d in uploaders
        if d in uploads
    ]
    if not updates:
        what = "every upload was refused" if not lost else "no upload to aggregate"
        why = {**{d: f"lost ({w})" for d, w in lost.items()}, **rejections.current}
        raise ValueError(
            f"round {plan.round}: {what} ({'; '.join(f'{d}: {w}' for d, w in why.items())})"
        )
    return updates


def start_or_resume(federation: Federation, resume: bool) -> tuple[list[dict], bool]:
    """(the run's rows so far, whether it resumed): after the run directory's last checkpoint
    with `resume` when there is one, else from a fresh round 0 (the directory emptied)."""
    if resume and federation.resume():
        return federation.storage.read_metrics(), True
    federation.storage.reset()
    return [federation.start()], False
