"""`fedkey devices --backend ray`: one fleet of phones spread over the machines of a Ray cluster.

The phones are asyncio tasks (fedkey.device_sim.fleets.async_phone: the thread fleet's protocol, fedkey.device_sim.fleets.phone,
over one lean keep-alive connection each) inside *phone hosts*: async Ray actors that reserve no
CPU, placed round-robin on the cluster's nodes (at least one per node, and at most
PHONES_PER_HOST phones each). An idle phone is a suspended coroutine and a socket, so a host holds
thousands cheaply (fedkey_bench.fleet_memory measures it). Each phone's private shard is shipped once,
to the host that runs it.

Their training goes to the long-lived trainer actors of fedkey.device_sim.training.ray_pool (one CPU or a fraction
of a GPU each): a host puts each global model version in the object store once (not once per
phone) and awaits the ObjectRef of each of its phones' training, so its other phones keep polling
meanwhile. The training seed comes with the task, so which actor trains a phone never changes the
upload: the weights are bitwise those of the thread fleet (tests/ray/test_ray_fleet.py).

A host that dies (its node lost, the actor killed) costs only its phones: their reports say so,
the server closes the round without them (at its quorum or deadline), and the other hosts carry
on. The summary is run_fleet's dict.

Flower's simulation engine also runs clients on Ray; it starts an actor's client per round and
ships the model per client, which its users meet as start-up costs and out-of-memory actors. Here
actors live for the whole run and the model travels once per host and round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import ray
from ray.exceptions import ObjectLostError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fedkey.device_sim.client.async_http import raise_nofile
from fedkey.device_sim.client.http import DeviceClient, FedkeyError, GlobalModel
from fedkey.device_sim.config import FleetConfig, PhoneConfig
from fedkey.device_sim.fleets.async_phone import (
    AsyncDeviceClient,
    AsyncModelCache,
    AsyncTrainer,
    run_phone,
)
from fedkey.device_sim.fleets.phone import DeviceReport
from fedkey.device_sim.fleets.thread_fleet import RoundsBar, fleet_phones, summarize
from fedkey.device_sim.ray_cluster import RayOptions
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.device_sim.training.trainer import TrainResult

log = logging.getLogger("fedkey.device")

#: The most phones one host runs (fedkey_bench.fleet_memory: 10,000 idle phones fit in well under 1 GB).
PHONES_PER_HOST = 10_000

Phone = tuple[str, list[list[int]], PhoneConfig]  # name, private shard, behaviour

__all__ = [
    "PHONES_PER_HOST",
    "PhoneHost",
    "fleet_on_ray",
    "plan_hosts",
    "rss_bytes",
    "run_ray_fleet",
]


def rss_bytes() -> int:
    """This process's resident memory (VmRSS), in bytes; 0 where /proc is not there."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ObjectStoreTrainer:
    """A host's training on the trainer actors `handles` (fedkey.device_sim.training.ray_pool): each global
    model version put in the object store once, each phone's shard once (for the run), each task
    sent to the actor this host has given the least work (`offset` spreads the hosts' first
    choices), its ObjectRef awaited. A task whose actor died is sent once more to another one;
    an actor that died is not used again by this host."""

    def __init__(self, handles: list[Any], offset: int = 0) -> None:
        if not handles:
            raise ValueError("no trainer actors to train on")
        self.handles = handles[offset % len(handles) :] + handles[: offset % len(handles)]
        self.load = [0] * len(self.handles)
        self.dead: set[int] = set()
        self.model: GlobalModel | None = None
        self.state_ref: Any = None
        self.shards: dict[str, tuple[list[list[int]], Any]] = {}
        self.trained_on: Counter[str] = Counter()  # Ray node id -> trainings of this host

    def _state(self, model: GlobalModel) -> Any:
        if self.model is not model:  # a new version (the shared cache hands out one object)
            self.model, self.state_ref = model, ray.put(model.state)
        return self.state_ref

    def _shard(self, task: LocalTask) -> Any:
        cached = self.shards.get(task.device_id)
        if cached is None or cached[0] is not task.shard:  # e.g. a backdoor's poisoned copy
            cached = self.shards[task.device_id] = (task.shard, ray.put(task.shard))
        return cached[1]

    async def __call__(self, task: LocalTask, model: GlobalModel) -> TrainResult:
        from fedkey.device_sim.training.ray_pool import train_remote

        state, shard = self._state(model), self._shard(task)
        for attempt in (1, 2):
            alive = [i for i in range(len(self.handles)) if i not in self.dead]
            if not alive:
                raise FedkeyError(f"{task.device_id}: every trainer actor this host knew died")
            actor = min(alive, key=self.load.__getitem__)
            self.load[actor] += 1
            try:
                result, where = await train_remote(
                    self.handles[actor], replace(task, shard=[]), state, shard
                )
            except (RayActorError, ObjectLostError) as e:
                self.dead.add(actor)
                log.warning("%s: its trainer actor died (%s)", task.device_id, type(e).__name__)
                if attempt == 2:
                    raise FedkeyError(f"{task.device_id}: two trainer actors died") from None
                continue
            finally:
                self.load[actor] -= 1
            self.trained_on[where.node_id] += 1
            return result
        raise AssertionError("unreachable")


@ray.remote(num_cpus=0)
class PhoneHost:
    """A Ray actor (async: its methods run in one event loop) that runs a share of the fleet's
    phones as asyncio tasks; see the module docstring. It reserves no CPU: the trainer actors
    have the cores."""

    def __init__(self, server: str, secret: str, retry_seconds: float) -> None:
        raise_nofile()  # a socket per phone
        self.server = server
        self.secret = secret
        self.retry_seconds = retry_seconds
        self.stop = asyncio.Event()
        self.reports: dict[str, DeviceReport] = {}
        self.trainer: ObjectStoreTrainer | None = None

    async def run(
        self, phones: list[Phone], trainers: list[Any] | None, offset: int = 0
    ) -> dict[str, dict]:
        """Run `phones` until each has finished, failed or been stopped; their reports. Their
        training goes to the trainer actors `trainers` (None: phones that never train, e.g.
        fedkey_bench.fleet_memory's idle ones); `offset`: this host's index, to spread first choices."""
        cache = AsyncModelCache()  # one download per model version for all of them
        train: AsyncTrainer = _no_training
        if trainers is not None:
            self.trainer = ObjectStoreTrainer(trainers, offset)
            train = self.trainer
        coros = []
        for name, shard, phone in phones:
            report = self.reports[name] = DeviceReport(name)
            client = AsyncDeviceClient(
                self.server, cache=cache, retry_seconds=self.retry_seconds, stop=self.stop
            )
            coros.append(
                run_phone(client, name, shard, self.secret, phone, train, self.stop, report)
            )
        await asyncio.gather(*coros)
        return {n: r.to_dict() for n, r in self.reports.items()}

    async def status(self) -> dict:
        """Where it runs and how its phones are doing: node, pid, RSS bytes, phones, enrolled,
        uploads, trained, and trained_on (Ray node id -> its phones' trainings there)."""
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "rss": rss_bytes(),
            "phones": len(self.reports),
            "enrolled": sum(r.device_id is not None for r in self.reports.values()),
            "uploads": sum(r.uploads for r in self.reports.values()),
            "trained": sum(r.trained for r in self.reports.values()),
            "trained_on": dict(self.trainer.trained_on) if self.trainer is not None else {},
        }

    async def halt(self) -> None:
        """Stop every phone (they return from their waits at once)."""
        self.stop.set()


async def _no_training(task: LocalTask, model: GlobalModel) -> TrainResult:
    raise RuntimeError(f"{task.device_id}: this phone host trains nothing (submit=None)")


@dataclass
class HostPlan:
    """One phone host: the node it is placed on and the phones it runs."""

    node: str
    phones: list[Phone]


def plan_hosts(
    phones: list[Phone], nodes: list[str], per_host: int = PHONES_PER_HOST
) -> list[HostPlan]:
    """Share the phones among hosts round-robin: at least one host per node (when there are
    enough phones), at most `per_host` phones each, the hosts spread over `nodes` in turn."""
    if not nodes:
        raise ValueError("the Ray cluster has no alive node")
    count = min(len(phones), max(len(nodes), math.ceil(len(phones) / per_host)))
    plans = [HostPlan(nodes[i % len(nodes)], []) for i in range(count)]
    for i, phone in enumerate(phones):
        plans[i % count].phones.append(phone)
    return plans


def alive_nodes() -> list[str]:
    """The ids of the cluster's alive nodes, the driver's own first."""
    here = ray.get_runtime_context().get_node_id()
    ids = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    return sorted(ids, key=lambda n: n != here)


def start_hosts(cfg: FleetConfig, plans: list[HostPlan]) -> list[Any]:
    """One PhoneHost actor per plan, pinned to its node (alive a moment ago). Not soft: Ray's
    soft affinity does not keep an actor without resources (num_cpus=0) on its node."""
    return [
        PhoneHost.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(plan.node, soft=False),
            name=None,
        ).remote(cfg.server, cfg.enrollment_secret, cfg.retry_seconds)
        for plan in plans
    ]


def fleet_on_ray(
    cfg: FleetConfig,
    opts: RayOptions,
    progress: bool = True,
    on_hosts: Callable[[list[dict]], None] | None = None,
) -> dict:
    """`fedkey devices --backend ray`: connect to the cluster `opts` names (a local instance by
    default), start the trainer actors (fedkey.device_sim.training.ray_pool), run the fleet (run_ray_fleet) and
    stop what was started. RayUnavailable (one line) when no cluster can be reached."""
    from fedkey.device_sim.training.ray_pool import RayTrainerPool

    pool = RayTrainerPool(opts)
    try:
        pool.ready()  # the trainers have imported torch before the phones need them
        return run_ray_fleet(cfg, pool.handles, pool.workers, progress, on_hosts)
    finally:
        pool.close()


def run_ray_fleet(
    cfg: FleetConfig,
    trainers: list[Any],
    workers: int,
    progress: bool = True,
    on_hosts: Callable[[list[dict]], None] | None = None,
) -> dict:
    """Run `cfg.count` phones on the connected Ray cluster until the server finishes (or Ctrl-C);
    returns run_fleet's summary. Their training goes to the trainer actors `trainers`
    (fedkey.device_sim.training.ray_pool handles; `workers`, their number, goes in the summary); `on_hosts`
    receives each host's last status (PhoneHost.status) before the hosts go.

    A host that dies costs its phones (their reports carry the reason, the summary's errors a
    crash line); the others run on. FleetError when every phone failed.
    """
    start = time.monotonic()
    with httpx.Client(timeout=60.0) as http:
        model = DeviceClient(cfg.server, http, retry_seconds=cfg.retry_seconds).download_model()
        plans = plan_hosts(fleet_phones(cfg, model.tokenizer), alive_nodes())
        hosts = start_hosts(cfg, plans)
        runs = {
            h.run.remote(p.phones, trainers, i): i
            for i, (h, p) in enumerate(zip(hosts, plans, strict=True))
        }
        done: dict[str, dict] = {}
        crashes: list[str] = []
        statuses: list[dict | None] = [None] * len(hosts)
        bar = RoundsBar(cfg, http, lambda: sum(s["uploads"] for s in statuses if s), progress)
        interrupted = False
        pending = list(runs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=2.0)
                for ref in ready:
                    i = runs[ref]
                    try:
                        done.update(ray.get(ref))
                    except ray.exceptions.RayError as e:
                        crashes.append(_lost(plans[i], i, e, done))
                _poll(hosts, statuses)
                bar.poll()
        except KeyboardInterrupt:
            interrupted = True
            bar.write("interrupted: stopping the phones")
            _halt(hosts, {ref: runs[ref] for ref in pending}, plans, done)
        finally:
            _poll(hosts, statuses)
            if on_hosts is not None:
                on_hosts([s for s in statuses if s is not None])
            for h in hosts:
                ray.kill(h)
            bar.close()
    seconds = time.monotonic() - start
    return summarize(cfg, workers, done, crashes, bar.completed, interrupted, seconds)


def _lost(plan: HostPlan, index: int, e: BaseException, done: dict[str, dict]) -> str:
    """A host died: its phones' reports say so; the crash line for the summary."""
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    line = f"phone host {index} on node {plan.node[:12]} died ({len(plan.phones)} phones lost): {reason}"
    log.error("%s", line)
    for name, _, _ in plan.phones:
        report = DeviceReport(name)
        report.error = f"its phone host died: {reason}"
        done[name] = report.to_dict()
    return line


def _poll(hosts: list[Any], statuses: list[dict | None]) -> None:
    """Each live host's status (a dead one keeps its last)."""
    refs = [h.status.remote() for h in hosts]
    for i, ref in enumerate(refs):
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            statuses[i] = ray.get(ref, timeout=10)


def _halt(hosts: list[Any], pending: dict, plans: list[HostPlan], done: dict[str, dict]) -> None:
    """Ctrl-C: stop every host's phones and collect what the running ones did."""
    for h in hosts:
        h.halt.remote()
    for ref, i in pending.items():
        try:
            done.update(ray.get(ref, timeout=30))
        except (ray.exceptions.RayError, TimeoutError) as e:
            _lost(plans[i], i, e, done)
