"""Where `fedkey server` completes its rounds: in a child process (the default) or a thread.

Aggregating a round (bound, aggregate, evaluate, checkpoint) is seconds to minutes of CPU. In a
thread of the server process it shared the GIL with the event loop: at 10,000 phones /healthz
stalled up to 6.8 s while 1,000 uploads were aggregated (experiments/results/load). In a child process
the loop shares nothing with it but the CPUs, and the child runs ``AGGREGATION_NICE`` below the
loop (fedkey.server.runtime.worker_threads), so the loop wins a CPU whenever both want one.

The child is a pure function of what it is sent. Each round the server sends its Federation's
in-memory state (engine.FederationState: weights, strategy memory, accountant, server
optimizer), the plan and the stored uploads' paths; the child adopts the state, runs
``Federation.complete_round`` (which writes the checkpoint and the metrics row) and sends back
the row and the new state, which the server adopts. Nothing of the server's Federation changes
until then, so a round that fails in the child (an exception, or the child killed) leaves the
server as before, as in the thread, and the next attempt gets a fresh child.

    aggregator = Aggregator(federation, spec, "process")   # spec: Federation(**spec) in the child
    row = aggregator.complete(plan, uploads)                # blocking: call it from a thread
    aggregator.close()

The child is forked from multiprocessing's forkserver with torch and the engine imported, not
from the server (which runs threads), and builds its own Federation once from `spec`.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, get_args

from fedkey.federation.config import AggregateIn
from fedkey.federation.engine import Federation, FederationState
from fedkey.federation.plan import RoundPlan
from fedkey.federation.strategies import ClientUpdate
from fedkey.federation.updates.store import StoredState
from fedkey.server.round_state import Upload
from fedkey.server.runtime.worker_threads import AGGREGATION_NICE

#: The modules the forkserver imports once, so a new aggregation process starts in well under a
#: second instead of importing torch again.
PRELOAD = ["fedkey.server.aggregator"]

CHOICES: tuple[AggregateIn, ...] = get_args(AggregateIn)


def updates_of(uploads: list[tuple[str, Upload]]) -> list[ClientUpdate]:
    """The round's stored uploads as the engine's updates, each read lazily from its file
    (fedkey.federation.updates.store.StoredState), so memory does not grow with the cohort."""
    return [
        ClientUpdate(
            state=StoredState(up.path),
            num_samples=up.num_samples,
            train_loss=up.train_loss,
            device_id=device_id,
        )
        for device_id, up in uploads
    ]


class Aggregator:
    """Completes rounds of `federation` in a thread of this process (``"thread"``) or in one
    child process (``"process"``), one round at a time."""

    def __init__(
        self, federation: Federation, spec: dict[str, Any], where: AggregateIn = "process"
    ):
        if where not in CHOICES:
            raise ValueError(f"aggregate_in must be one of {', '.join(CHOICES)}, not {where!r}")
        self.federation, self.spec, self.where = federation, spec, where
        # Made on the event loop's thread: the child runs AGGREGATION_NICE below it (a thread's
        # nice is its own on Linux, and the worker threads that start the child run lower).
        self.nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + AGGREGATION_NICE)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def complete(self, plan: RoundPlan, uploads: list[tuple[str, Upload]]) -> dict:
        """Complete the round and return its metrics row; blocking (the driver calls it in its
        aggregation thread). All or nothing, wherever it runs."""
        fed = self.federation
        if self.where == "thread":
            return fed.complete_round(plan, updates_of(uploads))
        with self._lock:
            pool = self._start()
            try:
                future = pool.submit(_complete_in_child, fed.snapshot(), plan, uploads)
                row, state = future.result()
            except BrokenProcessPool as e:  # killed (out of memory?): the next round starts anew
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
                raise RuntimeError(
                    f"the aggregation process of round {plan.round} died ({e}); nothing was "
                    "applied, the round is run again with a new one"
                ) from None
        fed.restore(state)
        return row

    def pid(self) -> int | None:
        """The aggregation process's pid, once it runs (None in thread mode)."""
        pool = self._pool
        if pool is None:
            return None
        pids = list(pool._processes)  # ProcessPoolExecutor has no public accessor
        return pids[0] if pids else None

    def start(self) -> None:
        """Start the child now (process mode), so the first round does not wait for it."""
        if self.where == "process":
            with self._lock:
                self._start().submit(os.getpid).result()

    def _start(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=ctx,
                initializer=_init_child,
                initargs=(self.spec, self.nice, os.getpid()),
            )
        return self._pool

    def close(self) -> None:
        """Stop the child (after the round it is completing, if any)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None


# -- in the child ------------------------------------------------------------------------------

_federation: Federation | None = None


def _init_child(spec: dict[str, Any], nice: int, server_pid: int) -> None:
    global _federation
    import torch

    threading.Thread(target=_exit_with, args=(server_pid,), daemon=True).start()
    # A terminal's Ctrl-C reaches the server's whole process group. It is the server's to handle
    # (it finishes the round in progress, then stops this process): dying of it here would fail
    # that round, and print a traceback into the server's log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:  # not allowed here: the child keeps the server's priority
        pass
    torch.set_num_threads(1)  # as the server's own aggregation thread: one core for the phones
    _federation = Federation(**spec)


def _complete_in_child(
    state: FederationState, plan: RoundPlan, uploads: list[tuple[str, Upload]]
) -> tuple[dict, FederationState]:
    fed = _federation
    if fed is None:
        raise RuntimeError("the aggregation process was not initialized")
    fed.restore(state)
    row = fed.complete_round(plan, updates_of(uploads))
    return row, fed.snapshot()


def _exit_with(pid: int) -> None:
    """End this process as soon as the server `pid` is gone (killed, say): the executor's own
    queues would keep it waiting for work for ever, and with it the forkserver. Watched by a
    pidfd where Linux has one, else by polling once a second."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll
        while _alive(pid):
            time.sleep(1.0)
    else:
        select.select([fd], [], [])
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True
