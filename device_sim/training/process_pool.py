"""The processes that do the phones' training, for the in-process simulation and the HTTP fleet.

A task carries its phone's shard (a few KB beside the model it also carries), so a phone's
training goes to whichever core is free next (phones pinned to processes would load the cores
unevenly with a random cohort) and the pool can start before any data is loaded: importing torch
in the workers overlaps the server's start-up. One torch thread per process: on a 2-core machine
two single-threaded trainers side by side beat one two-threaded trainer by far. The training seed
comes with the task, so which process trains a phone never changes the result.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass

import torch

from fedkey.common.config import TrainConfig
from fedkey.device_sim.training.trainer import TrainResult, phone_round
from fedkey.models.config import ModelConfig

#: Tasks a worker process has submitted at once while a round streams: one training, one queued
#: behind it so the worker never waits on the parent.
IN_FLIGHT = 2


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)


def _ready() -> int:
    return os.getpid()


@dataclass
class LocalTask:
    """One phone's work for a round: train on its shard from the global model with `seed`."""

    device_id: str
    shard: list[list[int]]  # the phone's training sentences (token ids)
    seed: int  # the task's training seed (fedkey.federation.engine.client_seed of seed, round, device)
    model_config: ModelConfig
    train: TrainConfig
    beta: float = 0.0  # the seed papers' client-side randomization
    sigma: float = 1.0
    device: str = "auto"


def run_task(task: LocalTask, global_state: dict[str, torch.Tensor]) -> TrainResult:
    return phone_round(
        task.model_config,
        global_state,
        task.shard,
        task.train,
        task.seed,
        task.beta,
        task.sigma,
        task.device,
    )


class TrainerPool:
    """`workers` spawn-context processes (workers == 0: train in this process): the `local`
    training backend (fedkey.device_sim.training.backends.TrainingBackend)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._lock = threading.Lock()  # in-process: one training at a time (torch's global seed)
        self.pool: ProcessPoolExecutor | None = None
        if workers > 0:
            self.pool = ProcessPoolExecutor(
                max_workers=workers,
                mp_context=mp.get_context("spawn"),  # fork after torch has started is unsafe
                initializer=_init_worker,
            )
            # Start the processes now (importing torch takes seconds), not at the first task.
            for _ in range(workers):
                self.pool.submit(_ready)

    def submit(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> Future:
        if self.pool is not None:
            return self.pool.submit(run_task, task, global_state)
        future: Future = Future()
        with self._lock:
            try:
                future.set_result(run_task(task, global_state))
            except Exception as e:
                future.set_exception(e)
        return future

    def train(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> TrainResult:
        return self.submit(task, global_state).result()

    def stream(
        self, tasks: Iterable[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, TrainResult | None]]:
        """(device_id, result) as each task finishes, at most IN_FLIGHT tasks a worker submitted
        at once (in this process: one at a time), so a result the caller let go is freed: a
        round's results are not all held at once. A worker process that dies breaks the whole
        executor (BrokenProcessPool), so here that is an error, not a lost phone."""
        if self.pool is None:
            for t in tasks:
                yield t.device_id, self.train(t, global_state)
            return
        todo = iter(tasks)
        pending: dict[Future, str] = {}
        while True:
            while len(pending) < IN_FLIGHT * self.workers:
                if (task := next(todo, None)) is None:
                    break
                pending[self.submit(task, global_state)] = task.device_id
            if not pending:
                return
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield pending.pop(future), future.result()

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> dict[str, TrainResult]:
        futures = {t.device_id: self.submit(t, global_state) for t in tasks}
        return {d: f.result() for d, f in futures.items()}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))
