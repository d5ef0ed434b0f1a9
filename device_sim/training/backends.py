"""Where the phones' training runs: the training backend interface and its two implementations.

    local   fedkey.device_sim.training.process_pool.TrainerPool: this machine's processes (one torch thread each);
            for `fedkey simulate` fedkey.device_sim.training.resident.ResidentPool: the same processes keeping
            their phones' data and model for the run, and summing a round where it can be
    ray     fedkey.device_sim.training.ray_pool.RayTrainerPool: long-lived Ray actors across a cluster
    stacked fedkey.device_sim.training.stacked.StackedTrainer: a round's phones as one stacked model, in this
            process on one device (a GPU: one phone's step is bound by kernel launches there);
            for `fedkey simulate --workers N`, N resident processes each stacking its share

All take the same LocalTask (the phone's shard and its training seed travel with it), so which
backend, process, actor or node trains a phone never changes its update: `--backend ray` gives
bitwise the weights of `--backend local`; `stacked` the same up to float rounding (its recurrent
layer is written out), and other dropout masks. Results come back in the order phones finish
(`stream`), so a caller can check each upload while the others still train.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal, Protocol, get_args

if TYPE_CHECKING:
    import torch

    from fedkey.device_sim.ray_cluster import RayOptions
    from fedkey.device_sim.training.process_pool import LocalTask
    from fedkey.device_sim.training.trainer import TrainResult

#: The training backends; the CLI's --backend choices come from here.
Backend = Literal["local", "ray", "stacked"]
BACKENDS: tuple[str, ...] = get_args(Backend)


class TrainingBackend(Protocol):
    """What the round loops need from whatever trains the phones.

    `stream` yields (device_id, result) as each phone finishes; a phone whose worker died twice
    (an actor lost mid-round, retried once) yields (device_id, None): its update is lost for the
    round, the run goes on. A training error (a bug, bad data) is raised, not swallowed."""

    workers: int

    def submit(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> Future:
        """Train one task; a Future of its TrainResult (the fleet's per-phone path)."""
        ...

    def train(self, task: LocalTask, global_state: dict[str, torch.Tensor]) -> TrainResult:
        """Train one task and wait for it."""
        ...

    def stream(
        self, tasks: Iterable[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, TrainResult | None]]:
        """Train a round's tasks from one global state; results in completion order."""
        ...

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, torch.Tensor]
    ) -> dict[str, TrainResult]:
        """Train a round's tasks; results keyed by device in the tasks' order (lost ones left out)."""
        ...

    def close(self) -> None:
        """Stop the workers (and whatever the backend started)."""
        ...


def settled(call: Callable[[], TrainResult]) -> Future:
    """A Future already holding `call()`'s result, or its exception: `submit` for a backend that
    trains whole rounds (it trains the one task at once)."""
    future: Future = Future()
    try:
        future.set_result(call())
    except Exception as e:
        future.set_exception(e)
    return future


def ordered(
    tasks: list[LocalTask], results: Iterable[tuple[str, TrainResult | None]]
) -> dict[str, TrainResult]:
    """Results in the tasks' order whatever order they finished in (aggregation sums floats in
    this order, so the global weights do not depend on timing); lost phones left out."""
    got = {d: r for d, r in results if r is not None}
    return {t.device_id: got[t.device_id] for t in tasks if t.device_id in got}


def make_backend(
    backend: Backend,
    workers: int | None = None,
    ray: RayOptions | None = None,
    resident: bool = False,
) -> TrainingBackend:
    """The backend named `backend`: `workers` local processes (None: one per core), trainer
    actors on the Ray cluster `ray` describes (its workers: None, as many as the cluster holds),
    or a round's phones stacked in this process. `resident`: local processes that keep their
    phones' data and are given whole rounds (ResidentPool: a simulation's), not phones one at a
    time (TrainerPool: the fleet's); then `stacked` with `workers` N > 0 stacks each process's
    share in N such processes."""
    if backend == "local":
        from fedkey.device_sim.training.process_pool import TrainerPool, default_workers

        n = default_workers() if workers is None else workers
        if resident:
            from fedkey.device_sim.training.resident import ResidentPool

            return ResidentPool(n)
        return TrainerPool(n)
    if backend == "ray":
        from fedkey.device_sim.ray_cluster import RayOptions
        from fedkey.device_sim.training.ray_pool import RayTrainerPool

        return RayTrainerPool(ray or RayOptions())
    if backend == "stacked":
        if resident and workers:  # stacks in that many resident processes, one per core
            from fedkey.device_sim.training.resident import ResidentPool

            return ResidentPool(workers, stacked=True)
        from fedkey.device_sim.training.stacked import StackedTrainer

        return StackedTrainer()
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
