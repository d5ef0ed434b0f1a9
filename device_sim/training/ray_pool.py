"""The `ray` training backend: long-lived trainer actors on a Ray cluster train the phones.

Flower's Ray simulation starts an actor per client and users report per-client start-up costs
and actors running out of memory; here a few long-lived actors (one per CPU, or a fraction of a
GPU each: --ray-cpus-per-worker / --ray-gpus-per-worker) each train many phones, one at a time,
with one torch thread. Per round the global state goes into the object store once (`put_state`)
and every task refers to it; a phone's shard is put once for the whole run and each node's
object store keeps the copy it fetched. A task goes to whichever actor is free next, as in the
local pool, and the training seed comes with the task, so which actor or node trains a phone
never changes its update: the weights are bitwise those of the local backend.

An actor that dies mid-round (its process killed, its node lost) costs at most its phones'
updates for that round: each of its tasks is retried once on another actor, a replacement
actor is started in its place, and a phone whose retry also fails is reported lost (None in
`stream`) and left out of the round. A training error (a bug, bad data) is raised as it is.

The fleet (`fedkey devices --backend ray`) awaits training from its own async actors: it gets
the trainers' handles (`handles`), a state's reference from `put_state`, and calls
`train_remote(handle, task, state_ref)`, whose ObjectRef an asyncio actor can await.
"""

from __future__ import annotations

import os
import socket
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from ray.exceptions import ObjectLostError, RayActorError

from fedkey.device_sim.ray_cluster import RayOptions, RayUnavailable, cluster_capacity, connect
from fedkey.device_sim.training.process_pool import LocalTask, run_task
from fedkey.device_sim.training.trainer import TrainResult

__all__ = ["Placement", "RayTrainerPool", "TrainerActor", "train_remote"]

#: What a dead actor's task raises: the actor's process or node is gone, or the result with it.
_LOST = (RayActorError, ObjectLostError)


@dataclass(frozen=True)
class Placement:
    """Where a task was trained: the Ray node, its host name and the actor's process id."""

    node_id: str
    host: str
    pid: int


class TrainerActor:
    """One long-lived trainer: one torch thread, trains the tasks it is sent one at a time."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # as the local pool's processes: one thread per trainer
        self.placement = Placement(
            ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid()
        )

    def where(self) -> Placement:
        """This actor's node, host and pid (and a sign that it has started)."""
        return self.placement

    def train(
        self,
        task: LocalTask,
        global_state: dict[str, torch.Tensor],
        shard: list[list[int]] | None = None,
    ) -> tuple[TrainResult, Placement]:
        """Train `task` from `global_state` (Ray resolves both references before the call);
        `shard`, when given, is the phone's shard put once in the object store."""
        if shard is not None:
            task = replace(task, shard=shard)
        return run_task(task, global_state), self.placement


def train_remote(
    handle: Any, task: LocalTask, state_ref: ray.ObjectRef, shard_ref: ray.ObjectRef | None = None
) -> ray.ObjectRef:
    """Train `task` on the trainer actor `handle`; an ObjectRef of (TrainResult, Placement),
    awaitable from an asyncio actor. `state_ref` from RayTrainerPool.put_state (one per round);
    `shard_ref`: the shard put once (then task.shard may be empty), or None to send it inline."""
    return handle.train.remote(task, state_ref, shard_ref)


class RayTrainerPool:
    """Trainer actors on the cluster `opts` names: the `ray` training backend
    (fedkey.device_sim.training.backends.TrainingBackend). Connects on creation, stops its actors and closes
    the connection it opened on `close()`."""

    def __init__(self, opts: RayOptions) -> None:
        self.opts = opts
        self.session = connect(opts)
        # A remote class per connection: Ray's ActorClass remembers the job it was exported to,
        # and a module-level one reused after a reconnect gave actors that never started.
        self._remote = ray.remote(TrainerActor)
        try:
            capacity = cluster_capacity(opts)
            if opts.workers is not None and opts.workers > capacity:
                raise RayUnavailable(
                    f"--workers {opts.workers}: the Ray cluster holds {capacity} trainer actors "
                    f"of {opts.cpus_per_worker:g} CPU / {opts.gpus_per_worker:g} GPU; lower "
                    "--workers or add nodes (`ray start --address HEAD:PORT`)"
                )
            self.workers = opts.workers or capacity
            self._actors = [self._start_actor() for _ in range(self.workers)]
        except BaseException:
            self.session.close()
            raise
        self._shards: dict[str, tuple[list[list[int]], ray.ObjectRef]] = {}
        self._state: tuple[dict[str, torch.Tensor], ray.ObjectRef] | None = None
        self._load = [0] * self.workers  # tasks in flight per actor (the `submit` path)
        self.placements: dict[str, Placement] = {}  # device -> where its last task trained
        self.lost: dict[str, str] = {}  # the last round's lost phones: device -> why
        self.retried = 0  # tasks retried on another actor, over the run

    def _start_actor(self) -> Any:
        return self._remote.options(  # type: ignore[attr-defined]
            num_cpus=self.opts.cpus_per_worker,
            num_gpus=self.opts.gpus_per_worker,
            scheduling_strategy="SPREAD",  # across nodes before doubling up on one
        ).remote()

    # -- what the fleet and the round loop share --------------------------------------------

    @property
    def handles(self) -> list[Any]:
        """The trainer actors' handles (for `train_remote` from other actors)."""
        return list(self._actors)

    def ready(self) -> list[Placement]:
        """Wait until every trainer has started (imported torch); where each one runs."""
        return list(ray.get([a.where.remote() for a in self._actors]))

    def put_state(self, global_state: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """The round's global state in the object store, put once: the same dict again gives
        the same reference (the state of a round is not modified in place)."""
        if self._state is None or self._state[0] is not global_state:
            self._state = (global_state, ray.put(global_state))
        return self._state[1]

    def shard_ref(self, task: LocalTask) -> ray.ObjectRef:
        """The task's shard in the object store, put once per phone (again only when the
        phone's shard object changes, e.g. a backdoor attacker's poisoned copy)."""
        cached = self._shards.get(task.device_id)
        if cached is None or cached[0] is not task.shard:
            cached = (task.shard, ray.put(task.shard))
            self._shards[task.device_id] = cached
        return cached[1]

    def _call(self, actor: int, task: LocalTask, state_ref: ray.ObjectRef) -> ray.ObjectRef:
        return train_remote(
            self._actors[actor], replace(task, shard=[]), state_ref, self.shard_ref(task)
        )

    def submit_ref(self, task: LocalTask, state_ref: ray.ObjectRef) -> ray.ObjectRef:
        """Train `task` on the least busy trainer: an ObjectRef of (TrainResult, Placement)."""
        actor = min(range(self.workers), key=self._load.__getitem__)
        self._load[actor] += 1
        ref = self._call(actor, task, state_ref)

        def done(_: Any) -> None:
            self._load[actor] -= 1

        ref.future().add_done_callback(done)
        return ref

    def submit(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> Future:
        """A Future of the task's TrainResult (the local pool's interface)."""
        ref = self.submit_ref(task, self.put_state(global_state))
        result: Future = Future()

        def unpack(f: Future) -> None:
            try:
                trained, where = f.result()
            except BaseException as e:
                result.set_exception(e)
                return
            self.placements[task.device_id] = where
            result.set_result(trained)

        ref.future().add_done_callback(unpack)
        return result

    def train(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> TrainResult:
        return self.submit(task, global_state).result()

    # -- a round ------------------------------------------------------------------------------

    def _replace_actor(self, actor: int) -> None:
        """Kill what is left of a failed actor and start a fresh one in its place."""
        try:
            ray.kill(self._actors[actor], no_restart=True)
        except Exception:  # already gone
            pass
        self._actors[actor] = self._start_actor()

    def stream(
        self, tasks: Iterable[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, TrainResult | None]]:
        """Train a round: the state put once, each free actor given the next task, results
        yielded as they finish; a task of a dead actor retried once on another one, then
        (device_id, None) and the reason in `self.lost`."""
        state_ref = self.put_state(global_state)
        todo: deque[tuple[LocalTask, int | None]] = deque((t, None) for t in tasks)
        idle = deque(range(self.workers))
        running: dict[ray.ObjectRef, tuple[int, LocalTask, int | None]] = {}
        self.lost = {}
        while todo or running:
            while todo and idle:
                task, avoid = todo.popleft()
                others = [a for a in idle if a != avoid]
                actor = others[0] if others else idle[0]
                idle.remove(actor)
                running[self._call(actor, task, state_ref)] = (actor, task, avoid)
            (ref,), _ = ray.wait(list(running), num_returns=1)
            actor, task, avoid = running.pop(ref)
            try:
                trained, where = ray.get(ref)
            except _LOST as e:
                self._replace_actor(actor)
                idle.append(actor)
                if avoid is None:  # first failure: once more, elsewhere
                    self.retried += 1
                    todo.appendleft((task, actor))
                else:
                    self.lost[task.device_id] = type(e).__name__
                    yield task.device_id, None
                continue
            idle.append(actor)
            self.placements[task.device_id] = where
            yield task.device_id, trained

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> dict[str, TrainResult]:
        """The round's results in the tasks' order (lost phones left out)."""
        got = {d: r for d, r in self.stream(tasks, global_state) if r is not None}
        return {t.device_id: got[t.device_id] for t in tasks if t.device_id in got}

    def nodes_used(self, devices: Iterable[str]) -> dict[str, int]:
        """How many of `devices` each Ray node trained (by their last placements)."""
        return dict(Counter(self.placements[d].node_id for d in devices if d in self.placements))

    def close(self) -> None:
        """Stop the trainer actors and close the connection this pool opened."""
        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # the cluster may be gone already
                pass
        self._actors = []
        self._shards.clear()
        self._state = None
        self.session.close()
