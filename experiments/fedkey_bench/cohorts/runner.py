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
what the code costs when other work shares the cores). The resident set is sampled after every
100 phones (`rss_mib_by_phones`): memory that grows with the cohort shows there.

`--processes N` splits the cohort between N child processes (one core each, balanced by each
phone's words), each training its part with the row's backend: what N single-threaded trainers
side by side give. They load the population, warm up, then start training together; the figure
is all phones over the wall-clock seconds from that start to the last one's end, the CPU seconds
and the peak resident sets summed over the processes. Rows go to OUT/results.json (a row of the
same workload, model, cohort, backend and processes replaced) and OUT/results.md.
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
import tempfile
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
    processes: int = 1  # the cohort split between this many processes side by side
    extra: dict[str, Any] = field(default_factory=dict)


#: RSS is sampled after every this many phones trained.
RSS_EVERY = 100


def _peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc has none), MiB."""
    return _status_mib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    """This process's resident set now (VmRSS), MiB; 0 where /proc has none."""
    return _status_mib("VmRSS")


def _status_mib(field: str) -> float:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def split_by_words(words: list[int], parts: int) -> list[list[int]]:
    """Indices of `words` (each phone's words) in `parts` groups of about equal total words:
    the most words first, each to the group with the fewest so far (ties: the lower group).
    Every group keeps its phones in their given order."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(words)), key=lambda i: -words[i]):
        g = min(range(parts), key=lambda g: totals[g])
        groups[g].append(i)
        totals[g] += words[i]
    return [sorted(g) for g in groups]


def _counted(stream: Any, every: int, samples: list[list[float]]) -> int:
    """How many results of `stream` were not None, each dropped as it comes; the resident set
    (MiB) appended to `samples` as [phones, rss] after every `every` phones and at the end."""
    done = seen = 0
    for _, result in stream:
        done += result is not None
        seen += 1
        del result
        if seen % every == 0:
            samples.append([seen, round(_rss_mib())])
    if not samples or samples[-1][0] != seen:
        samples.append([seen, round(_rss_mib())])
    return done


def measure(row: Row, part: int | None = None) -> dict[str, Any]:
    """Train `row`'s cohort once in this process and return its figures (one torch thread).
    `part`: train only that part of the cohort split between row.processes processes
    (split_by_words), after a line on stdin says go (run_row starts them together); the start
    and end of its training phase as time.time() in `started` and `ended`."""
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
    from fedkey.models.precision import resolve_precision

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
    words = [sum(len(s) for s in t.shard) for t in tasks]
    if part is not None:
        mine = split_by_words(words, row.processes)[part]
        tasks, words = [tasks[i] for i in mine], [words[i] for i in mine]
    if row.backend == "stacked":
        backend: Any = StackedTrainer(phones=row.stack_phones)
    else:
        backend = make_backend("local", workers=0)  # train_local in this process
    loaded = _peak_rss_mib()
    for _ in backend.stream(tasks[:1], state):  # warm-up: first-call costs, not counted
        pass
    if part is not None:  # run_row's go: every part loaded and warmed up
        print("ready", flush=True)
        sys.stdin.readline()
    started = time.time()
    wall, cpu = time.perf_counter(), time.process_time()
    samples: list[list[float]] = []
    done = _counted(backend.stream(tasks, state), RSS_EVERY, samples)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ended = time.time()
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
        "processes": row.processes,
        "precision": resolve_precision(w.precision, "cpu"),
        "phones_trained": done,
        "words": sum(words),
        "batches": sum(plan_length(t.shard, train) for t in tasks),
        "seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "phone_updates_per_s": round(done / wall, 2),
        "phone_updates_per_cpu_s": round(done / cpu, 2),
        "peak_rss_mib": round(_peak_rss_mib()),
        "rss_after_load_mib": round(loaded),
        "rss_mib_by_phones": samples,
        "population": len(prepared.shards),
        "started": started,
        "ended": ended,
    }


def run_row(row: Row, timeout: float) -> dict[str, Any]:
    """`row` measured in a child process of its own (its own peak RSS), or split between
    row.processes children side by side (run_parts): its figures, or its error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    arg = json.dumps({**asdict(row), "workload": asdict(row.workload)})
    cmd = [sys.executable, "-m", "fedkey_bench.cohorts.runner", arg]
    if row.processes > 1:
        return run_parts(cmd, row.processes, env, timeout)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT / "experiments")  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return {"error": tail[0]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for k in ("started", "ended"):
        result.pop(k)
    return result


def run_parts(cmd: list[str], parts: int, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One row's cohort split between `parts` children of `cmd` (each given its part): each
    loads and warms up, says ready; all are told go at once; their figures combined (merge)."""
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(parts)]
        children = [subprocess.Popen([*cmd, str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=logs[p], text=True, env=env, cwd=ROOT / "experiments")
                    for p in range(parts)]  # fmt: skip
        try:
            for child in children:  # each says ready (or ends: its error is read below)
                assert child.stdout is not None
                child.stdout.readline()
            for child in children:
                with contextlib.suppress(BrokenPipeError):
                    assert child.stdin is not None
                    child.stdin.write("go\n")
                    child.stdin.flush()
            outs = [c.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                    for c in children]  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:g} s"}
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        for child, log in zip(children, logs, strict=True):
            if child.returncode != 0:
                log.seek(0)
                tail = log.read().strip().splitlines()[-1:] or [f"exit {child.returncode}"]
                return {"error": tail[0]}
    return merge([json.loads(out.strip().splitlines()[-1]) for out in outs])


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one cohort trained in parts side by side: phones, words, batches, CPU
    seconds and peak resident sets summed; the wall-clock seconds from the first part's start
    to the last one's end; each part's own phones, words, seconds and peak in `parts`."""
    wall = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    done = sum(p["phones_trained"] for p in parts)
    cpu = sum(p["cpu_seconds"] for p in parts)
    first = parts[0]
    return {
        **{
            k: first[k]
            for k in (
                "workload",
                "model",
                "hidden_size",
                "backend",
                "stack_phones",
                "precision",
                "population",
            )
        },  # fmt: skip
        "phones": first["phones"],
        "processes": len(parts),
        "phones_trained": done,
        "words": sum(p["words"] for p in parts),
        "batches": sum(p["batches"] for p in parts),
        "seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "phone_updates_per_s": round(done / wall, 2),
        "phone_updates_per_cpu_s": round(done / cpu, 2),
        "peak_rss_mib": sum(p["peak_rss_mib"] for p in parts),
        "rss_after_load_mib": sum(p["rss_after_load_mib"] for p in parts),
        "parts": [
            {
                k: p[k]
                for k in (
                    "phones_trained",
                    "words",
                    "seconds",
                    "cpu_seconds",
                    "peak_rss_mib",
                    "rss_mib_by_phones",
                )
            }
            for p in parts
        ],  # fmt: skip
    }


def run_cohorts(
    w: Workload,
    cohorts: list[int],
    backends: list[str],
    models: list[str],
    out: Path,
    command: str,
    stack_phones: int | None = None,
    timeout: float = 1800,
    processes: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Every (model, cohort, backend, processes) row, backends side by side per cohort; rows
    written to OUT/results.json (replacing those of the same keys) and OUT/results.md as each
    ends."""
    rows = []
    load = os.getloadavg()[0]
    for model in models:
        for k in cohorts:
            for n in processes or [1]:
                for backend in backends:
                    size = MODELS[model]
                    stack = stack_phones if backend == "stacked" else None
                    got = run_row(Row(w, model, size, k, backend, stack, n), timeout)
                    got = {"workload": w.name, "model": model, "hidden_size": size, "phones": k,
                           "backend": backend, "processes": n,
                           **got, "command": command, "load_at_start": round(load, 2),
                           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}  # fmt: skip
                    print(_line(got), flush=True)
                    rows.append(got)
                    write_results(out, [got])
    return rows


def _line(r: dict[str, Any]) -> str:
    where = f"  {r['model']} {r['phones']} phones, {r['backend']}"
    where += f" x{r['processes']} processes" if r.get("processes", 1) > 1 else ""
    if "error" in r:
        return f"{where}: error: {r['error']}"
    return (f"{where}: {r['phone_updates_per_s']} phone-updates/s "
            f"({r['phone_updates_per_cpu_s']} per CPU-s), {r['seconds']} s, "
            f"peak RSS {r['peak_rss_mib']} MiB")  # fmt: skip


KEY = ("workload", "model", "phones", "backend", "processes")
#: Row fields renamed: rows written before keep their figures under the new names.
RENAMED = {"updates_per_s": "phone_updates_per_s", "updates_per_cpu_s": "phone_updates_per_cpu_s"}


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(r.get(k, 1) if k == "processes" else r[k] for k in KEY)


def upgrade(r: dict[str, Any]) -> dict[str, Any]:
    """A row as this runner writes it: renamed fields, processes 1 where it has none."""
    r = {RENAMED.get(k, k): v for k, v in r.items()}
    r.setdefault("processes", 1)
    return r


def write_results(out: Path, new: list[dict[str, Any]]) -> None:
    """Merge `new` into OUT/results.json (same KEY: replaced) and rebuild OUT/results.md."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    rows = [upgrade(r) for r in json.loads(path.read_text())["rows"]] if path.exists() else []
    keys = {_key(r) for r in new}
    rows = [r for r in rows if _key(r) not in keys] + new
    rows.sort(key=_key)
    notes = json.loads(path.read_text()).get("notes", []) if path.exists() else []
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "notes": notes,
            "rows": rows}  # fmt: skip
    path.write_text(json.dumps(meta, indent=1) + "\n")
    (out / "results.md").write_text(markdown(rows, notes))


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
    processes: list[int] = typer.Option(
        [1],
        "--processes",
        "-p",
        min=1,
        help="Split each cohort between this many processes side by side (repeatable).",
    ),  # fmt: skip
    timeout: float = typer.Option(1800, "--timeout", min=1, help="Seconds one row may take."),
    out: Path = typer.Option(
        RESULTS / "cohorts", "--out", help="Where results.json and results.md are written."
    ),
) -> None:
    """Phone-updates per second of --backend local (one process, one thread) and stacked on the
    CPU, at each cohort size: one phone per sender of the corpus, E 1, B 10, each row in a child
    process (its peak RSS its own), or --processes N side by side (one thread each, the cohort
    split by words; their CPU seconds and peak RSS summed). Rows replace those of the same keys
    in OUT/results.json."""
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
                stack_phones, timeout, processes)  # fmt: skip


# A child of run_row: one row (or its part), its figures as one JSON line.
if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    given["workload"] = Workload(**given["workload"])
    part = int(sys.argv[2]) if len(sys.argv) > 2 else None
    print(json.dumps(measure(Row(**given), part)), flush=True)
