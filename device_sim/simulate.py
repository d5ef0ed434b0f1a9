"""`fedkey simulate` and `fedkey train-central`: the round engine with phones in local processes.

A pool of worker processes (one torch thread each: on a 2-core machine two single-threaded
trainers side by side beat one two-threaded trainer by far) holds every phone's private shard;
each round the server's Federation plans a cohort, the pool trains it, and the Federation
aggregates. Training is seeded per (seed, round, device), so the global weights do not depend
on the number of workers or on the transport.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from tqdm import tqdm

from device_sim.corpora import Corpus, load_corpus
from device_sim.partition import partition
from device_sim.trainer import TrainConfig, TrainResult, train_local
from models.model import ModelConfig
from models.tokenizers import Tokenizer, build_tokenizer
from server import privacy
from server.engine import Federation, FederationConfig, client_seed
from server.storage import RunStorage
from server.strategies import ClientUpdate


@dataclass
class DataConfig:
    data: str = "demo"  # "demo" or a directory (see device_sim.corpora.load_corpus)
    paper_protocol: bool = (
        False  # seeds' preprocessing: lowercase, split on " . ", vocab from all splits
    )
    tokenizer: str = "word"
    vocab_size: int = 10_000
    clients: int = 100
    partition: str = "iid"
    alpha: float = 0.5  # Dirichlet concentration
    max_train_tokens: int | None = None  # keep the first N training words (reduced CPU runs)
    max_eval_sentences: int | None = None  # cap valid and test (reduced CPU runs)
    seed: int = 0


@dataclass
class PreparedData:
    corpus: Corpus
    tokenizer: Tokenizer
    shards: dict[str, list[list[int]]]  # device id -> encoded private sentences


def cut_tokens(sentences: list[str], max_tokens: int | None) -> int:
    """How many leading sentences hold at most max_tokens words."""
    if max_tokens is None:
        return len(sentences)
    total = 0
    for i, s in enumerate(sentences):
        total += len(s.split()) + 1
        if total > max_tokens:
            return i
    return len(sentences)


def prepare(cfg: DataConfig) -> PreparedData:
    """Load, cut, tokenize and partition the corpus into private shards."""
    corpus = load_corpus(cfg.data, paper_protocol=cfg.paper_protocol, seed=cfg.seed)
    # The vocabulary is the server's: built from text it holds (the seeds build it from all splits).
    vocab_text = corpus.train + corpus.valid + corpus.test if cfg.paper_protocol else corpus.train
    tokenizer = build_tokenizer(cfg.tokenizer, vocab_text, cfg.vocab_size)
    n = cut_tokens(corpus.train, cfg.max_train_tokens)
    m = cfg.max_eval_sentences
    corpus = Corpus(
        name=corpus.name,
        train=corpus.train[:n],
        valid=corpus.valid[:m] if m else corpus.valid,
        test=corpus.test[:m] if m else corpus.test,
        train_users=corpus.train_users[:n] if corpus.train_users else None,
    )
    parts = partition(corpus, cfg.partition, cfg.clients, cfg.seed, alpha=cfg.alpha)
    width = len(str(len(parts) - 1))
    shards = {
        f"device-{i:0{width}d}": [tokenizer.encode(corpus.train[j]) for j in idx]
        for i, idx in enumerate(parts)
    }
    return PreparedData(corpus=corpus, tokenizer=tokenizer, shards=shards)


# -- the worker processes -------------------------------------------------------------------------

_SHARDS: dict[str, list[list[int]]] = {}


def _init_worker(shards: dict[str, list[list[int]]]) -> None:
    torch.set_num_threads(1)
    _SHARDS.update(shards)


@dataclass
class LocalTask:
    device_id: str
    round: int
    seed: int
    model_config: ModelConfig
    train: TrainConfig
    beta: float  # the seeds' client-side randomization
    sigma: float
    device: str


def run_task(task: LocalTask, global_state: dict[str, torch.Tensor]) -> TrainResult:
    """What one phone does in a round: train, then randomize its weights if asked to."""
    seed = client_seed(task.seed, task.round, task.device_id)
    result = train_local(
        task.model_config, global_state, _SHARDS[task.device_id], task.train, seed, task.device
    )
    if task.beta > 0:
        gen = torch.Generator().manual_seed(seed + 1)
        result.state = privacy.randomize(result.state, task.beta, task.sigma, gen)
    return result


class TrainerPool:
    """Phones simulated in `workers` processes (or in this process when workers == 0)."""

    def __init__(self, shards: dict[str, list[list[int]]], workers: int):
        self.workers = workers
        if workers > 0:
            self.pool = ProcessPoolExecutor(
                max_workers=workers,
                mp_context=mp.get_context("spawn"),  # fork after torch has started is unsafe
                initializer=_init_worker,
                initargs=(shards,),
            )
        else:
            self.pool = None
            _init_worker(shards)

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> dict[str, TrainResult]:
        if self.pool is None:
            return {t.device_id: run_task(t, global_state) for t in tasks}
        futures = {t.device_id: self.pool.submit(run_task, t, global_state) for t in tasks}
        return {d: f.result() for d, f in futures.items()}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def simulate(
    data: DataConfig,
    fed: FederationConfig,
    model_config_for,  # Callable[[int], ModelConfig]: vocab size -> model config
    out_dir: str,
    workers: int | None = None,
    device: str = "auto",
    progress: bool = True,
    resume: bool = False,
) -> list[dict]:
    """Run rounds in-process up to `fed.rounds`; returns the metrics rows (also in out_dir).

    With `resume`, a run directory that already holds checkpoints continues after its last one.
    """
    prepared = prepare(data)
    model_config = model_config_for(prepared.tokenizer.vocab_size)
    storage = RunStorage(out_dir)
    sizes = {d: sum(len(s) - 1 for s in shard) for d, shard in prepared.shards.items()}
    federation = Federation(
        fed,
        model_config,
        prepared.tokenizer,
        sizes,
        prepared.corpus.valid,
        prepared.corpus.test,
        storage,
    )
    torch.set_num_threads(1)
    if resume and federation.resume():
        rows = storage.read_metrics()
    else:
        storage.reset()
        rows = [federation.start()]
    pool = TrainerPool(prepared.shards, default_workers() if workers is None else workers)
    bar = tqdm(
        range(federation.round, fed.rounds),
        initial=federation.round,
        total=fed.rounds,
        desc=f"{fed.strategy} on {prepared.corpus.name}",
        disable=not progress,
        unit="round",
    )
    bar.set_postfix(test_ppl=f"{rows[0]['test_ppl']:.1f}")
    try:
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
                    plan.round,
                    fed.seed,
                    model_config,
                    plan.train,
                    fed.privacy.beta,
                    fed.privacy.sigma,
                    device,
                )
                for d in plan.cohort
            ]
            results = pool.run(tasks, federation.global_state)
            uploaders = federation.choose_uploaders(
                plan, {d: r.train_loss for d, r in results.items()}
            )
            updates = [
                ClientUpdate(
                    state=results[d].state,
                    num_samples=results[d].num_tokens,
                    train_loss=results[d].train_loss,
                    device_id=d,
                )
                for d in uploaders
            ]
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
) -> list[dict]:
    """The ceiling: the same model trained on the union of every phone's data, one row per epoch."""
    prepared = prepare(data)
    model_config = model_config_for(prepared.tokenizer.vocab_size)
    storage = RunStorage(out_dir)
    storage.reset()
    union = [s for shard in prepared.shards.values() for s in shard]
    sizes = {"central": sum(len(s) - 1 for s in union)}
    fed = FederationConfig(
        strategy="fedavg", label="central", fraction=1.0, rounds=epochs, seed=seed, train=train
    )
    federation = Federation(
        fed,
        model_config,
        prepared.tokenizer,
        sizes,
        prepared.corpus.valid,
        prepared.corpus.test,
        storage,
    )
    torch.set_num_threads(1)
    rows = [federation.start()]
    one_epoch = TrainConfig(**{**train.__dict__, "epochs": 1})
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
