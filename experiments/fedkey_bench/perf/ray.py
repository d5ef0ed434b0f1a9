"""The ray training backend measured against the local one.

    round time   the same `fedkey simulate` workload with --backend local and --backend ray
                 (a private Ray instance on this machine, as many trainer actors as local
                 worker processes), each command a fresh process, interleaved (A B, B A, ...);
                 the figure is the summed per-round `seconds` of the metrics (no start-up in
                 them), best run against best run. Target: ray within 1.1x of local.
    start-up     in a fresh process: starting a local Ray instance (ray.init), its trainer
                 actors ready (each has imported torch), and the local pool's worker processes
                 ready, for comparison; and the whole commands' wall time.

Run through `fedkey-bench perf` (step ray) or `python -m fedkey_bench.perf.runner ray`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from fedkey_bench.common.checkout import ROOT


def _round_seconds(run_dir: Path) -> float:
    """The summed per-round `seconds` of a run (round 0, the start, left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sum(row["seconds"] for row in map(json.loads, filter(None, lines)) if row["round"] > 0)


def startup(workers: int) -> dict:
    """Seconds to start a local Ray instance, to get `workers` trainer actors ready on it, and
    to get the local pool's `workers` processes ready (run in a fresh process: see main)."""
    import os

    from fedkey.device_sim.ray_cluster import RayOptions, connect
    from fedkey.device_sim.training.process_pool import TrainerPool
    from fedkey.device_sim.training.ray_pool import RayTrainerPool

    opts = RayOptions(workers=workers, num_cpus=workers)
    t = time.perf_counter()
    session = connect(opts)
    ray_init = time.perf_counter() - t
    t = time.perf_counter()
    pool = RayTrainerPool(opts)  # joins the session's connection
    pool.ready()
    actors = time.perf_counter() - t
    t = time.perf_counter()
    pool.close()
    session.close()
    shutdown = time.perf_counter() - t
    t = time.perf_counter()
    local = TrainerPool(workers)
    assert local.pool is not None
    for f in [local.pool.submit(os.getpid) for _ in range(workers)]:
        f.result()  # queued after the start-up tasks: every process has imported torch
    local_ready = time.perf_counter() - t
    local.close()
    return {
        "workers": workers,
        "ray_init_seconds": round(ray_init, 2),
        "ray_actors_ready_seconds": round(actors, 2),
        "ray_shutdown_seconds": round(shutdown, 2),
        "ray_startup_seconds": round(ray_init + actors, 2),
        "local_pool_ready_seconds": round(local_ready, 2),
    }


def bench_ray(args: list[str], repeats: int, out: str, workers: int) -> dict:
    """`fedkey simulate ARGS --backend local|ray`, `repeats` times each, interleaved; then the
    start-up figures from a fresh process."""
    out_dir = Path(out).resolve()
    fedkey = [sys.executable, "-m", "fedkey", "simulate", *args, "--workers", str(workers)]
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    rounds: dict[str, list[float]] = {"local": [], "ray": []}
    for i in range(repeats):
        for backend in ("local", "ray") if i % 2 == 0 else ("ray", "local"):
            run_dir = out_dir / f"{backend}{i}"
            t = time.perf_counter()
            subprocess.run(
                [*fedkey, "--backend", backend, "--out", str(run_dir)],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            walls[backend].append(time.perf_counter() - t)
            rounds[backend].append(_round_seconds(run_dir))
        print(
            f"  repeat {i + 1}/{repeats}: local {walls['local'][-1]:.1f} s "
            f"(rounds {rounds['local'][-1]:.1f} s), ray {walls['ray'][-1]:.1f} s "
            f"(rounds {rounds['ray'][-1]:.1f} s)",
            flush=True,
        )
    done = subprocess.run(
        [sys.executable, "-m", "fedkey_bench.perf.runner", "_ray_startup", str(workers)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    start = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"  start-up: ray.init {start['ray_init_seconds']} s + {workers} actors "
        f"{start['ray_actors_ready_seconds']} s; local pool {start['local_pool_ready_seconds']} s",
        flush=True,
    )
    return {
        "args": " ".join([*args, "--workers", str(workers)]),
        "local_seconds": [round(x, 2) for x in walls["local"]],
        "ray_seconds": [round(x, 2) for x in walls["ray"]],
        "local_round_seconds": [round(x, 3) for x in rounds["local"]],
        "ray_round_seconds": [round(x, 3) for x in rounds["ray"]],
        "round_seconds_ratio_of_best": round(min(rounds["ray"]) / min(rounds["local"]), 3),
        "wall_ratio_of_best": round(min(walls["ray"]) / min(walls["local"]), 3),
        "startup": start,
    }
