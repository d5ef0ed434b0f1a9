"""`fedkey-bench cohorts`: many phones a round, fast: phone-updates per second
of the training backends at cohorts of 100, 1,000 and 5,000 phones.

The workload is the one `fedkey simulate --data ubuntu-irc --partition user` trains: one phone
per sender of the Ubuntu IRC logs (most hold a handful of short messages, a few thousands), the
server's 10k-word vocabulary, local epochs E, batches of B messages. A cohort is k phones drawn
uniformly from the population (fedkey.federation.strategies.selection.draw_uniform, seeded). Each row
trains one cohort once from the same initial weights on one backend: `local` (train_local one
phone after another in this process, one torch thread: what each of --backend local's worker
processes does) or `stacked` (fedkey.device_sim.training.stacked.StackedTrainer on the CPU). A row runs in a
child process of its own, so its peak RSS is its own; the rows of a cohort size run one after
another, backends alternating (the machine is shared: compare rows measured side by side).

A phone-update is one phone's local training; the figure is phones over the seconds of the
training phase (the results streamed and dropped as they come, as the round's streaming
aggregation would take them), wall-clock and per CPU-second of this process (the second tells
what the code costs when other work shares the cores). Rows go to OUT/results.json (a row of
the same workload, model, cohort and backend replaced) and OUT/results.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from fedkey.cli.errors import UserError
from fedkey_bench.cohorts.report import markdown
from fedkey_bench.common.checkout import RESULTS, ROOT

if TYPE_CHECKING:
    from fedkey.common.config import Precision

#: The backends a row can measure (fedkey.device_sim.training.backends' names).
BACKENDS = ("local", "stacked")
#: Model sizes: name -> hidden units (= embedding, tied, 1-layer GRU). "small" is the default
#: model (`--model small`, the seed papers' 300), "h96" the size the NUS SMS demo runs.
MODELS = {"small": 300, "h96": 96}


@dataclass(frozen=True)
class Workload:
    """What every row trains; `name` keys the rows."""

    name: str = "ubuntu-irc-user"
    data: str = "ubuntu-irc"  # a corpus spec, as `fedkey simulate --data` takes it
    vocab_size: int = 10_000
    epochs: int = 1
    batch_size: int = 10
    lr: float = 1.0
    precision: str = "auto"
    seed: int = 0


@dataclass(frozen=True)
class Row:
    """One cohort trained once on one backend: what a child process measures."""

    workload: Workload
    model: str
    hidden_size: int
    phones: int
    backend: str
    stack_phones: int | None = None  # stacked: phones a stack (None: the backend's default)
    extra: dict[str, Any] = field(default_factory=dict)


def _peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc has none), MiB."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(row: Row) -> dict[str, Any]:
    """Train `row`'s cohort once in this process and return its figures (one torch thread)."""
    import numpy as np
    import torch

    from fedkey.common.config import DataConfig, TrainConfig
    from fedkey.corpora.dataset import prepare
    from fedkey.device_sim.training.backends import make_backend
    from fedkey.device_sim.training.process_pool import LocalTask
    from fedkey.device_sim.training.stacked import StackedTrainer, plan_length
    from fedkey.federation.strategies.selection import draw_uniform
    from fedkey.models.checkpoint import build_model, model_state
    from fedkey.models.config import ModelConfig

    torch.set_num_threads(1)
    w = row.workload
    # clients None: one phone per sender (fedkey.corpora.partition.by_user), the whole population.
    prepared = prepare(DataConfig(data=w.data, partition="user", clients=None,  # type: ignore[arg-type]
                                  vocab_size=w.vocab_size, seed=w.seed))  # fmt: skip
    cohort = draw_uniform(sorted(prepared.shards), row.phones, np.random.default_rng(w.seed))
    size = row.hidden_size
    cfg = ModelConfig(vocab_size=prepared.tokenizer.vocab_size, emb_size=size, hidden_size=size)
    precision = cast("Precision", w.precision)
    train = TrainConfig(epochs=w.epochs, batch_size=w.batch_size, lr=w.lr, precision=precision)
    torch.manual_seed(w.seed)
    state = model_state(build_model(cfg))
    tasks = [LocalTask(d, prepared.shards[d], w.seed + i, cfg, train, device="cpu")
             for i, d in enumerate(cohort)]  # fmt: skip
    if row.backend == "stacked":
        backend: Any = StackedTrainer(phones=row.stack_phones)
    else:
        backend = make_backend("local", workers=0)  # train_local in this process
    loaded = _peak_rss_mib()
    for _ in backend.stream(tasks[:1], state):  # warm-up: first-call costs, not counted
        pass
    wall, cpu = time.perf_counter(), time.process_time()
    done = sum(1 for _, result in backend.stream(tasks, state) if result is not None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    backend.close()
    return {
        "workload": w.name,
        "model": row.model,
        "hidden_size": size,
        "phones": row.phones,
        "backend": row.backend,
        "stack_phones": (
            backend.stack_size(tasks[0], len(tasks)) if row.backend == "stacked" else None
        ),  # fmt: skip
        "phones_trained": done,
        "batches": sum(plan_length(t.shard, train) for t in tasks),
        "seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "updates_per_s": round(done / wall, 2),
        "updates_per_cpu_s": round(done / cpu, 2),
        "peak_rss_mib": round(_peak_rss_mib()),
        "rss_after_load_mib": round(loaded),
        "population": len(prepared.shards),
    }


def run_row(row: Row, timeout: float) -> dict[str, Any]:
    """`row` measured in a child process of its own (its own peak RSS): its figures, or its
    error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    arg = json.dumps({**asdict(row), "workload": asdict(row.workload)})
    cmd = [sys.executable, "-m", "fedkey_bench.cohorts.runner", arg]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT / "experiments")  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return {"error": tail[0]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_cohorts(
    w: Workload,
    cohorts: list[int],
    backends: list[str],
    models: list[str],
    out: Path,
    command: str,
    stack_phones: int | None = None,
    timeout: float = 1800,
) -> list[dict[str, Any]]:
    """Every (model, cohort, backend) row, backends side by side per cohort; rows written to
    OUT/results.json (replacing those of the same keys) and OUT/results.md as each ends."""
    rows = []
    load = os.getloadavg()[0]
    for model in models:
        for k in cohorts:
            for backend in backends:
                size = MODELS[model]
                row = Row(
                    w, model, size, k, backend, stack_phones if backend == "stacked" else None
                )
                got = run_row(row, timeout)
                got = {"workload": w.name, "model": model, "hidden_size": size, "phones": k,
                       "backend": backend,
                       **got, "command": command, "load_at_start": round(load, 2),
                       "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}  # fmt: skip
                print(_line(got), flush=True)
                rows.append(got)
                write_results(out, [got])
    return rows


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['model']} {r['phones']} phones, {r['backend']}: error: {r['error']}"
    return (f"  {r['model']} {r['phones']} phones, {r['backend']}: {r['updates_per_s']} "
            f"phone-updates/s ({r['updates_per_cpu_s']} per CPU-s), {r['seconds']} s, "
            f"peak RSS {r['peak_rss_mib']} MiB")  # fmt: skip


KEY = ("workload", "model", "phones", "backend")


def write_results(out: Path, new: list[dict[str, Any]]) -> None:
    """Merge `new` into OUT/results.json (same KEY: replaced) and rebuild OUT/results.md."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    keys = {tuple(r[k] for k in KEY) for r in new}
    rows = [r for r in rows if tuple(r[k] for k in KEY) not in keys] + new
    rows.sort(key=lambda r: (r["workload"], r["model"], r["phones"], r["backend"]))
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "rows": rows}
    path.write_text(json.dumps(meta, indent=1) + "\n")
    (out / "results.md").write_text(markdown(rows))


def command(
    cohort: list[int] = typer.Option(
        [100, 1000], "--cohort", "-k", min=1, help="Phones a round (repeatable)."
    ),
    backend: list[str] = typer.Option(
        list(BACKENDS), "--backend", help=f"{' or '.join(BACKENDS)} (repeatable; default both)."
    ),
    model: list[str] = typer.Option(
        list(MODELS), "--model", help=f"{', '.join(MODELS)} (repeatable; default all)."
    ),
    data: str = typer.Option(
        "ubuntu-irc", "--data", help="The corpus (a `fedkey simulate --data` spec) with senders."
    ),
    precision: str = typer.Option("auto", "--precision", help="auto, fp32 or bf16."),
    stack_phones: int | None = typer.Option(
        None, "--stack-phones", min=1, help="stacked: phones a stack (default: the backend's)."
    ),
    timeout: float = typer.Option(1800, "--timeout", min=1, help="Seconds one row may take."),
    out: Path = typer.Option(
        RESULTS / "cohorts", "--out", help="Where results.json and results.md are written."
    ),
) -> None:
    """Phone-updates per second of --backend local (one process, one thread) and stacked on the
    CPU, at each cohort size: one phone per sender of the corpus, E 1, B 10, each row in a child
    process (its peak RSS its own). Rows replace those of the same keys in OUT/results.json."""
    unknown = sorted(set(backend) - set(BACKENDS)) + sorted(set(model) - set(MODELS))
    if unknown:
        raise UserError(f"unknown {', '.join(unknown)}: --backend is {' or '.join(BACKENDS)}, "
                        f"--model one of {', '.join(MODELS)}")  # fmt: skip
    from fedkey.common.config import PRECISIONS

    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision}: choose one of {', '.join(PRECISIONS)}")
    name = "ubuntu-irc-user" if data == "ubuntu-irc" else f"{Path(data).name}-user"
    name += "" if precision == "auto" else f"-{precision}"
    w = Workload(name=name, data=data, precision=precision)
    run_cohorts(w, cohort, backend, model, out, shlex.join(["fedkey-bench", *sys.argv[1:]]),
                stack_phones, timeout)  # fmt: skip


if __name__ == "__main__":  # a child of run_row: one row, its figures as one JSON line
    given = json.loads(sys.argv[1])
    given["workload"] = Workload(**given["workload"])
    print(json.dumps(measure(Row(**given))), flush=True)
