"""`fedkey simulate` and `fedkey train-central`: the round engine with phones in local processes.

A pool of worker processes (one torch thread each: on a 2-core machine two single-threaded
trainers side by side beat one two-threaded trainer by far) holds every phone's private shard;
each round the server's Federation plans a cohort, the pool trains it, and the Federation
aggregates. Training is seeded per (seed, round, device), so the global weights do not depend
on the number of workers or on the transport.

With `malicious` > 0 the last phones (by name, as in `fedkey devices`) attack
(device_sim.attacks), and every upload passes the HTTP server's checks (server.validation): a
refused one (NaN, wrong tensors) is dropped and named in the row's `rejected` field, as the server
drops it with a 422. With attack "backdoor" every row reports the backdoor's success
(backdoor_top1, backdoor_top3), also with no attacker: the clean model's rate.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from tqdm import tqdm

from common.config import DataConfig, TrainConfig
from corpora.dataset import prepare
from device_sim.attacks import (
    BackdoorProbe,
    apply_attack,
    backdoor_ids,
    backdoor_task,
    boost_factor,
    trigger_contexts,
)
from device_sim.config import ATTACKS, Attack, BackdoorConfig
from device_sim.pool import LocalTask, TrainerPool, default_workers
from device_sim.trainer import resolve_device, train_local
from models.batching import count_targets
from models.precision import resolve_precision
from server.config import FederationConfig
from server.engine import Federation, Probe, client_seed
from server.storage import RunStorage
from server.strategies import ClientUpdate
from server.validation import ValidationError, check_finite, check_tensors


class _Rejections:
    """A probe: the round's refused uploads as the row's `rejected` field, {device: reason}."""

    def __init__(self) -> None:
        self.current: dict[str, str] = {}

    def __call__(self, model, tokenizer) -> dict:
        return {"rejected": dict(self.current)}


def _federation(
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
    return Federation(
        fed,
        model_config,
        prepared.tokenizer,
        sizes,
        prepared.corpus.valid,
        prepared.corpus.test,
        RunStorage(out_dir),
        probes=probes or [],
        train_precision=resolve_precision(fed.train.precision, resolve_device(device)),
    )


def simulate(
    data: DataConfig,
    fed: FederationConfig,
    model_config_for,  # Callable[[int], ModelConfig]: vocab size -> model config
    out_dir: str,
    workers: int | None = None,
    device: str = "auto",
    progress: bool = True,
    resume: bool = False,
    malicious: int = 0,
    attack: Attack = "scale",
    backdoor: BackdoorConfig | None = None,
    probes: list[Probe] | None = None,
) -> list[dict]:
    """Run rounds in-process up to `fed.rounds`; returns the metrics rows (also in out_dir).

    `probes`: extra round metrics (server.engine.Probe), e.g. a canary's exposure
    (models.exposure.ExposureProbe).

    With `resume`, a run directory that already holds checkpoints continues after its last one.
    The last `malicious` phones (sorted names) upload `attack` (`backdoor` configures the
    backdoor attack; default BackdoorConfig()).
    """
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; choose one of {ATTACKS}")
    backdoor = backdoor or BackdoorConfig()
    # Start the workers first: they import torch while the data loads and round 0 is evaluated.
    pool = TrainerPool(default_workers() if workers is None else workers)
    try:
        prepared = prepare(data)
        model_config = model_config_for(prepared.tokenizer.vocab_size)
        names = sorted(prepared.shards)
        if not 0 <= malicious <= len(names):
            raise ValueError(f"--malicious {malicious}: there are {len(names)} phones")
        bad = set(names[len(names) - malicious :]) if malicious else set()
        probes = list(probes or [])
        if attack == "backdoor":
            backdoor_ids(backdoor, prepared.tokenizer)  # refuses words the tokenizer lacks
            contexts = trigger_contexts(prepared.corpus.test, backdoor.trigger, seed=data.seed)
            probes.append(BackdoorProbe(backdoor, contexts))
        rejections = _Rejections()
        if bad:
            probes.append(rejections)
        federation = _federation(
            fed, model_config, prepared, prepared.shards, out_dir, device, probes
        )
        storage = federation.storage
        if resume and federation.resume():
            rows = storage.read_metrics()
        else:
            storage.reset()
            rows = [federation.start()]
        bar = tqdm(
            range(federation.round, fed.rounds),
            initial=federation.round,
            total=fed.rounds,
            desc=f"{fed.strategy} on {prepared.corpus.name}",
            disable=not progress,
            unit="round",
        )
        bar.set_postfix(test_ppl=f"{rows[0]['test_ppl']:.1f}")
        for _ in bar:
            if federation.budget_spent:
                bar.write(
                    f"privacy budget: another round would pass epsilon {fed.privacy.target_epsilon}; stopping"
                )
                break
            plan = federation.plan_round(list(prepared.shards))
            tasks = [
                LocalTask(
                    d,
                    prepared.shards[d],
                    client_seed(fed.seed, plan.round, d),
                    model_config,
                    plan.train,
                    fed.privacy.beta,
                    fed.privacy.sigma,
                    device,
                )
                for d in plan.cohort
            ]
            if attack == "backdoor":
                tasks = [
                    backdoor_task(t, prepared.tokenizer, backdoor) if t.device_id in bad else t
                    for t in tasks
                ]
            results = pool.run(tasks, federation.global_state)
            if attack == "backdoor":  # an attacker declares its own shard's size, as if honest
                for d in bad & set(results):
                    results[d] = replace(results[d], num_tokens=count_targets(prepared.shards[d]))
            uploaders = federation.choose_uploaders(
                plan, {d: r.train_loss for d, r in results.items()}
            )
            attackers = sum(d in bad for d in plan.cohort)
            boost = boost_factor(backdoor, len(plan.cohort), attackers)
            updates, rejections.current = [], {}
            for d in uploaders:
                state = apply_attack(
                    attack if d in bad else None, results[d].state, federation.global_state, boost
                )
                try:  # the HTTP server's checks on an upload's tensors
                    check_tensors(state, model_config)
                    check_finite(state)
                except ValidationError as e:
                    rejections.current[d] = f"{e.status} {e.message}"
                    continue
                updates.append(
                    ClientUpdate(
                        state=state,
                        num_samples=results[d].num_tokens,
                        train_loss=results[d].train_loss,
                        device_id=d,
                    )
                )
            if not updates:
                raise ValueError(
                    f"round {plan.round}: every upload was refused "
                    f"({'; '.join(f'{d}: {why}' for d, why in rejections.current.items())})"
                )
            row = federation.complete_round(plan, updates)
            rows.append(row)
            bar.set_postfix(val_ppl=f"{row['val_ppl']:.1f}", test_ppl=f"{row['test_ppl']:.1f}")
    finally:
        pool.close()
    storage.plot(f"{fed.strategy} on {prepared.corpus.name}")
    return rows


def train_central(
    data: DataConfig,
    train: TrainConfig,
    model_config_for,
    out_dir: str,
    epochs: int,
    seed: int = 0,
    device: str = "auto",
    progress: bool = True,
    ksr_sentences: int = 100,
) -> list[dict]:
    """The ceiling: the same model trained on the union of every phone's data, one row per epoch."""
    prepared = prepare(data)
    model_config = model_config_for(prepared.tokenizer.vocab_size)
    union = [s for shard in prepared.shards.values() for s in shard]
    fed = FederationConfig(
        strategy="fedavg",
        label="central",
        fraction=1.0,
        rounds=epochs,
        seed=seed,
        train=train,
        ksr_sentences=ksr_sentences,
    )
    federation = _federation(fed, model_config, prepared, {"central": union}, out_dir, device)
    storage = federation.storage
    storage.reset()
    rows = [federation.start()]
    one_epoch = replace(train, epochs=1)
    for epoch in tqdm(
        range(1, epochs + 1),
        desc=f"central on {prepared.corpus.name}",
        disable=not progress,
        unit="epoch",
    ):
        plan = federation.plan_round(["central"])
        plan.train = one_epoch
        res = train_local(
            model_config,
            federation.global_state,
            union,
            one_epoch,
            client_seed(seed, epoch, "central"),
            device,
        )
        update = ClientUpdate(
            state=res.state,
            num_samples=res.num_tokens,
            train_loss=res.train_loss,
            device_id="central",
        )
        rows.append(federation.complete_round(plan, [update]))
    storage.plot(f"central on {prepared.corpus.name}")
    return rows


def train_ngram(
    data: DataConfig,
    order: int,
    out_dir: str,
    ksr_sentences: int = 100,
    positional: bool = False,
) -> list[dict]:
    """The baseline: a Kneser-Ney n-gram on the union of every phone's data, scored as a round.
    `positional`: a unigram by position in the sentence instead, with the seed papers'
    column perplexity (models.ngram.PositionalUnigram)."""
    from models.metrics import keystroke_savings_of
    from models.ngram import KneserNey, PositionalUnigram
    from models.tokenizers import WordTokenizer

    prepared = prepare(data)
    tokenizer = prepared.tokenizer
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError(
            f"the n-gram baselines need a word vocabulary (tokenizer 'word'), not {data.tokenizer!r}"
        )
    start = time.perf_counter()
    union = [s for shard in prepared.shards.values() for s in shard]
    lm: KneserNey | PositionalUnigram
    if positional:
        lm = PositionalUnigram(tokenizer).fit(union).choose_prior(prepared.corpus.valid)
        name = f"positional-unigram-prior-{lm.prior:.0f}"
        columns = {
            "col_val_ppl": lm.column_perplexity(prepared.corpus.valid),
            "col_test_ppl": lm.column_perplexity(prepared.corpus.test),
        }
    else:
        lm = KneserNey(tokenizer, order).fit(union)
        name, columns = f"kneser-ney-{order}", {}
    val = lm.evaluate(prepared.corpus.valid)
    test = lm.evaluate(prepared.corpus.test)
    ksr = keystroke_savings_of(
        lm.sentence_log_probs, tokenizer, prepared.corpus.test[:ksr_sentences]
    )
    row: dict[str, object] = {
        "round": 0,
        "strategy": name,
        "selected": [],
        "aggregated": [],
        "val_ppl": val["ppl"],
        "test_ppl": test["ppl"],
        "top1": test["top1"],
        "top3": test["top3"],
        "ksr": ksr if ksr_sentences else None,
        **columns,
        "best_round": 0,
        "best_val_ppl": val["ppl"],
        "best_test_ppl": test["ppl"],
        **{f"best_{k}": v for k, v in columns.items()},
        "bytes_up": 0,
        "bytes_down": 0,
        "epsilon": None,
        "seconds": round(time.perf_counter() - start, 3),
        "info": {"train_sentences": len(union)},
    }
    storage = RunStorage(out_dir)
    storage.reset()
    storage.append_metrics(row)
    return [row]
