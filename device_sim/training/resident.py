"""Resident trainers: `fedkey simulate`'s `local` backend, worker processes that keep what a run
sends them.

The per-phone pool (fedkey.device_sim.training.process_pool.TrainerPool, which the HTTP fleet
still uses) ships the global weights and the phone's data with every phone, and a model back.
Here each worker process keeps, for the whole run:

* the phones' data: a phone's shard crosses to a worker the first time that worker trains it
  (a shard the caller replaced, as the backdoor attack does, crosses again);
* one model, the global weights copied in for each phone (fedkey.device_sim.training.trainer.phone_model).

Per round a worker receives the global weights once and a share of the cohort, balanced by the
phones' words (:func:`assign`: the longest first, each to the least-loaded worker; a fixed
order, so a run does not depend on timing), and trains it phone by phone with each task's own
seed, so a phone's weights are bit for bit those of every other backend. It returns either
each phone's result as it finishes (:meth:`ResidentPool.stream`: what the trim, the outlier
filter and the attentive strategies need), or, where the round can be summed
(fedkey.federation.updates.summed), one running sum of its phones' weighted (under DP clipped)
deltas and a record per phone (:meth:`ResidentPool.sum_round`): one model back per worker
instead of one per phone, and memory that does not grow with the cohort.

The workers also score each round's model while the server would otherwise score it alone:
each keeps a part of the validation and test sets, encoded once for the run
(fedkey.models.held_out), and returns its part's tally (:meth:`ResidentPool.score`).

With ``workers`` = 0 the same code runs in this process (and the server scores). A worker's
error is raised here with its traceback; a worker that dies fails the round (as a broken process
pool does).
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch

from fedkey.common.config import Precision
from fedkey.device_sim.training.backends import settled
from fedkey.device_sim.training.process_pool import LocalTask, run_task
from fedkey.device_sim.training.trainer import TrainResult
from fedkey.federation.updates.summed import PartialSum, SumRule, widened
from fedkey.models.batching import count_targets
from fedkey.models.checkpoint import build_model, load_model_state
from fedkey.models.config import ModelConfig
from fedkey.models.held_out import HeldOutSet, parts, tally_part
from fedkey.models.model import LanguageModel
from fedkey.models.scoring import Tally
from fedkey.models.tokenizers import Tokenizer

if TYPE_CHECKING:
    from fedkey.device_sim.training.stacked import StackedTrainer

#: A phone's result as it finishes, its worker's partial sum when the round is summed.
OnPhone = Callable[[str, TrainResult], None]


@dataclass
class _Share:
    """One worker's part of a round: the global weights, its phones' tasks (their shards left
    out: the worker holds them), the shards it has not seen yet, and whether to sum."""

    seq: int  # the round's number in this pool (a stale worker's messages are dropped)
    global_state: dict[str, torch.Tensor]
    tasks: list[LocalTask]
    shards: dict[str, list[list[int]]] = field(default_factory=dict)
    rule: SumRule | None = None  # None: each phone's result; else one PartialSum by this rule
    stacked: bool = False  # the share's phones stacked (fedkey.device_sim.training.stacked)


@dataclass
class _Sets:
    """What a worker keeps to score rounds: its part of each held-out set, and how to score."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    sets: dict[str, HeldOutSet]
    batch_size: int
    precision: Precision


@dataclass
class _Score:
    """Score `global_state` on the sets the worker keeps."""

    seq: int
    global_state: dict[str, torch.Tensor]


class _Worker:
    """A worker's memory for the run: the shards it was sent, its held-out parts, its scoring
    model."""

    def __init__(self) -> None:
        self.shards: dict[str, list[list[int]]] = {}
        self.sets: _Sets | None = None
        self.model: LanguageModel | None = None
        self.stacked: StackedTrainer | None = None  # its stacks kept from round to round

    def score(self, job: _Score) -> dict[str, Tally]:
        if self.sets is None:
            raise RuntimeError("no held-out sets to score: send them first (hold_sets)")
        sets = self.sets
        if self.model is None:
            self.model = build_model(sets.model_config)
        load_model_state(self.model, job.global_state)
        return {
            name: tally_part(self.model, sets.tokenizer, part, sets.batch_size, sets.precision)
            for name, part in sets.sets.items()
        }


def _train_share(share: _Share, worker: _Worker) -> Iterator[tuple]:
    """What a worker sends for `share`, message by message: ("phone", device, result) as each
    phone finishes (its state left out when summing), then ("done", None, partial sum or None)."""
    worker.shards.update(share.shards)
    state = share.global_state
    partial = None if share.rule is None else PartialSum.empty(state, share.rule)
    wide = widened(state) if partial is not None else state
    tasks = [replace(t, shard=worker.shards[t.device_id]) for t in share.tasks]
    for device, result in _trained(tasks, state, share.stacked, worker):
        if partial is not None:
            partial.add(device, result.state, result.num_tokens, result.train_loss, wide)
            result = replace(result, state={})
        yield "phone", device, result
    yield "done", None, partial


def _trained(
    tasks: list[LocalTask], state: dict[str, torch.Tensor], stacked: bool, worker: _Worker
) -> Iterator[tuple[str, TrainResult]]:
    """The tasks trained one phone at a time, or stacked (in the stacks' fixed order)."""
    if not stacked:
        for task in tasks:
            yield task.device_id, run_task(task, state)
        return
    if worker.stacked is None:
        from fedkey.device_sim.training.stacked import StackedTrainer

        worker.stacked = StackedTrainer()
    for device, result in worker.stacked.stream(tasks, state):
        if result is not None:
            yield device, result


def _serve(conn: Connection) -> None:
    """A worker process: one torch thread; does the jobs it is sent until it gets None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)
    worker = _Worker()
    while (job := conn.recv()) is not None:
        if isinstance(job, _Sets):
            worker.sets, worker.model = job, None
            continue
        try:
            if isinstance(job, _Score):
                conn.send((job.seq, "done", None, worker.score(job)))
                continue
            for kind, device, payload in _train_share(job, worker):
                conn.send((job.seq, kind, device, payload))
        except Exception:
            conn.send((job.seq, "error", None, traceback.format_exc()))


def words(task: LocalTask) -> int:
    return count_targets(task.shard)


def assign(tasks: list[LocalTask], workers: int) -> list[list[LocalTask]]:
    """The round's tasks shared among `workers` by words: the longest phone first, each to the
    least-loaded worker (ties: the lower index); each share in the cohort's order."""
    loads = [0] * workers
    shares: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(tasks)), key=lambda i: -words(tasks[i])):
        w = min(range(workers), key=lambda j: (loads[j], j))
        shares[w].append(i)
        loads[w] += words(tasks[i])
    return [[tasks[i] for i in sorted(share)] for share in shares]


class ResidentPool:
    """`workers` resident trainer processes (0: train in this process): the `local` backend of
    `fedkey simulate` (a fedkey.device_sim.training.backends.TrainingBackend)."""

    def __init__(self, workers: int, stacked: bool = False) -> None:
        """`stacked`: each worker trains its share as the stacked backend does (its phones'
        weights side by side in one model), else phone by phone."""
        self.workers = workers
        self.stacked = stacked
        self._seq = 0
        self._here = _Worker()  # workers == 0: this process's shards and stacks
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        ctx = mp.get_context("spawn")  # fork after torch has started is unsafe
        for _ in range(workers):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(there,), daemon=True, name="fedkey-trainer")
            proc.start()  # importing torch there overlaps the data's loading here
            there.close()
            self._conns.append(here)
            self._procs.append(proc)
        # What each worker holds: device -> the shard object sent (a new object is sent again).
        self._sent: list[dict[str, list[list[int]]]] = [{} for _ in range(workers)]

    # -- a round ------------------------------------------------------------------------------

    def stream(
        self, tasks: Iterable[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, TrainResult | None]]:
        """(device, result) as each phone finishes."""
        for kind, device, payload in self._round(list(tasks), global_state, None):
            if kind == "phone":
                yield device, payload

    def sum_round(
        self,
        tasks: list[LocalTask],
        global_state: dict[str, torch.Tensor],
        rule: SumRule,
        on_phone: OnPhone | None = None,
    ) -> PartialSum:
        """Train `tasks` and return the sum of their deltas, weighted and clipped by `rule`
        (fedkey.federation.updates.summed.PartialSum: the workers' partial sums added in worker
        order); `on_phone` sees each phone's result (without its weights) as it finishes."""
        partials: dict[int, PartialSum] = {}
        for kind, key, payload in self._round(tasks, global_state, rule):
            if kind == "phone" and on_phone is not None:
                on_phone(key, payload)
            elif kind == "done":
                partials[key] = payload
        return PartialSum.combined([partials[w] for w in sorted(partials)])

    def _round(
        self, tasks: list[LocalTask], global_state: dict[str, torch.Tensor], rule: SumRule | None
    ) -> Iterator[tuple]:
        """Every worker's messages for this round as they come: ("phone", device, result) and
        ("done", worker index, partial sum)."""
        self._seq += 1
        if self.workers == 0:
            shards = {t.device_id: t.shard for t in tasks}
            share = _Share(self._seq, global_state, tasks, shards, rule, self.stacked)
            for kind, device, payload in _train_share(share, self._here):
                yield kind, (0 if kind == "done" else device), payload
            return
        waiting: dict[Any, int] = {}  # connection -> its worker
        for w, share_tasks in enumerate(assign(tasks, self.workers)):
            self._conns[w].send(self._share(w, share_tasks, global_state, rule))
            waiting[self._conns[w]] = w
        while waiting:
            for conn in wait(list(waiting)):
                w = waiting[conn]
                seq, kind, device, payload = self._recv(w)
                if seq != self._seq:  # a round an error abandoned: its late messages
                    continue
                if kind == "error":
                    raise RuntimeError(f"training failed in worker process {w}:\n{payload}")
                if kind == "done":
                    del waiting[conn]
                    yield kind, w, payload
                else:
                    yield kind, device, payload

    # -- scoring ------------------------------------------------------------------------------

    def hold_sets(
        self,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        sets: dict[str, tuple[list[str], bool]],
        batch_size: int,
        precision: Precision,
    ) -> None:
        """Give each worker its part of every held-out set (name -> (sentences, whether its
        top-k is read)), encoded once here, for :meth:`score` (workers > 0)."""
        if self.workers == 0:
            raise ValueError("a pool without worker processes scores nothing: score here")
        split = {name: parts(tokenizer, text, self.workers) for name, (text, _) in sets.items()}
        for w, conn in enumerate(self._conns):
            mine = {name: HeldOutSet(split[name][w], sets[name][1]) for name in sets}
            conn.send(_Sets(tokenizer, model_config, mine, batch_size, precision))

    def score(self, global_state: dict[str, torch.Tensor]) -> dict[str, list[Tally]]:
        """Each held-out set's tallies, one per worker in worker order, of `global_state`
        scored in the workers side by side."""
        self._seq += 1
        for conn in self._conns:
            conn.send(_Score(self._seq, global_state))
        out: dict[str, list[Tally]] = {}
        for w in range(self.workers):
            while True:
                seq, kind, _, payload = self._recv(w)
                if seq == self._seq:
                    break
            if kind == "error":
                raise RuntimeError(f"scoring failed in worker process {w}:\n{payload}")
            for name, tally in payload.items():
                out.setdefault(name, []).append(tally)
        return out

    def _share(
        self,
        w: int,
        tasks: list[LocalTask],
        global_state: dict[str, torch.Tensor],
        rule: SumRule | None,
    ) -> _Share:
        """Worker `w`'s message: its tasks without their shards, and the shards it lacks."""
        sent = self._sent[w]
        new = {t.device_id: t.shard for t in tasks if sent.get(t.device_id) is not t.shard}
        sent.update(new)
        light = [replace(t, shard=[]) for t in tasks]
        return _Share(self._seq, global_state, light, new, rule, self.stacked)

    def _recv(self, w: int) -> tuple:
        try:
            return self._conns[w].recv()
        except (EOFError, OSError):
            code = self._procs[w].exitcode
            raise RuntimeError(
                f"training worker process {w} died (exit code {code}): out of memory, or killed"
            ) from None

    # -- the backend interface ----------------------------------------------------------------

    def train(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> TrainResult:
        return self.run([task], global_state)[task.device_id]

    def submit(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> Future:
        return settled(partial(self.train, task, global_state))

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> dict[str, TrainResult]:
        got = {d: r for d, r in self.stream(tasks, global_state) if r is not None}
        return {t.device_id: got[t.device_id] for t in tasks if t.device_id in got}

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
