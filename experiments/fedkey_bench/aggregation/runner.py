"""`fedkey-bench aggregation`: the server's aggregation of a round against the time to read the
round's uploads once.

N uploads of the default model (``small``: a 300-unit GRU over a 10,000-word vocabulary, tied
embeddings; float32, as phones upload it) are written once to a work folder as safetensors files,
as the server stores them: honest phones are the global model plus a shared direction and their
own noise, at norms spread over 2x; a few (``OUTLIERS`` of them) push the opposite way, so the
cosine outlier filter has phones to reject. Then, interleaved and repeated, each measurement in a
fresh process with one torch thread (as the server's aggregation process,
fedkey.server.aggregator._init_child), the page cache warmed by one read first:

* ``read``: every upload read once with safetensors (``safetensors.torch.load_file``, each
  tensor copied out of the file's mapping);
* ``fedavg`` / ``fedatt``: the server's round aggregation at the default bound
  (fedkey.federation.config.InfluenceConfig(): adaptive clip at the median, trim 0.1, cosine filter 3.5):
  fedkey.federation.influence.bounding.bound_round, then the strategy's aggregate, over the uploads as the
  aggregation process sees them (fedkey.server.aggregator.updates_of: lazily read StoredState files),
  which is what fedkey.federation.engine.Federation._aggregate does without DP.

Each row: the median wall and CPU seconds (user and system), each as a ratio to ``read``'s, and
the peak RSS of its process.
``--baseline DIR`` measures the same with the server code of another checkout (a git worktree of
an earlier commit) in the same run, interleaved, so before and after are side by side.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import typer

from fedkey.cli.errors import UserError
from fedkey_bench.aggregation.report import page
from fedkey_bench.common.checkout import RESULTS
from fedkey_bench.common.provenance import git, machine_line

#: The measurements, in the order they are interleaved.
WHAT = ("read", "fedavg", "fedatt")
#: The module of the server's bounding, whose presence makes a folder a fedkey checkout.
BOUNDING = Path("fedkey", "federation", "influence", "bounding.py")
#: The share of phones that push against the others (rejected by the cosine filter).
OUTLIERS = 0.02


@dataclass(frozen=True)
class Cohort:
    """The written round: the global model's file and the uploads' files and declared counts."""

    global_path: str
    paths: list[str]
    samples: list[int]
    parameters: int
    upload_bytes: int


def write_cohort(folder: Path, n: int, vocab_size: int, hidden_size: int, seed: int = 0) -> Cohort:
    """The global model (fedkey's model at these sizes, seeded) and ``n`` uploads around it, as
    safetensors files in ``folder`` (module docstring)."""
    import torch
    from safetensors.torch import save_file

    from fedkey.models.checkpoint import build_model, model_state
    from fedkey.models.config import ModelConfig

    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab_size, emb_size=hidden_size, hidden_size=hidden_size)
    glob = {k: v.contiguous() for k, v in model_state(build_model(config)).items()}
    folder.mkdir(parents=True, exist_ok=True)
    global_path = str(folder / "global.safetensors")
    save_file(glob, global_path)
    rng = np.random.default_rng(seed)
    keys = [k for k, v in glob.items() if torch.is_floating_point(v)]
    scale = {k: 1e-3 * float(glob[k].std()) + 1e-4 for k in keys}
    shared = {k: rng.standard_normal(glob[k].shape, dtype=np.float32) for k in keys}
    bad = (
        set(rng.choice(n, max(1, round(OUTLIERS * n)), replace=False).tolist()) if n > 4 else set()
    )
    paths, samples = [], []
    for i in range(n):
        size = float(rng.uniform(0.7, 1.4))
        sign = -3.0 if i in bad else 1.0
        state = {}
        for k, g in glob.items():
            if k not in scale:
                state[k] = g
                continue
            noise = rng.standard_normal(g.shape, dtype=np.float32)
            delta = scale[k] * size * (sign * shared[k] + noise)
            state[k] = g + torch.from_numpy(delta)
        path = str(folder / f"dev-{i:05d}.safetensors")
        save_file(state, path)
        paths.append(path)
        samples.append(int(rng.integers(20, 200)))
    params = sum(glob[k].numel() for k in keys)
    return Cohort(global_path, paths, samples, params, os.path.getsize(paths[0]))


def _in_child(tree: str | None, what: str, cohort: Cohort) -> tuple[float, float, float]:
    """One measurement in this (fresh) process: wall seconds, CPU seconds (user and system: on a
    shared machine the wall time counts the others' load too) and peak RSS in MB. ``tree``:
    import the server from that checkout."""
    if tree is not None:
        _import_from(tree)
    import torch

    torch.set_num_threads(1)
    jobs: dict[str, Callable[[], Any]] = {"read": lambda: _read(cohort)}
    if what != "read":
        jobs[what] = _aggregation(what, cohort)
    start, cpu = time.perf_counter(), _cpu()
    jobs[what]()
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    return seconds, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _import_from(tree: str) -> None:
    """Import the server from the checkout ``tree``: its folder first on the path, and every
    module of its packages that this process imported already (the bench's own imports bring
    in the ``fedkey`` package from this checkout, and a package's
    submodules are looked up in its folder, whatever the path says) forgotten, so they are
    imported again from ``tree``. Without it, ``--baseline`` timed this checkout's
    ``fedkey.federation.influence.bounding`` and ``fedkey.federation.influence.cohort_scan`` (found under the ``server`` package already
    imported from here) as the baseline's."""
    sys.path.insert(0, tree)
    tops = {p.name for p in Path(tree).iterdir() if (p / "__init__.py").is_file()}
    for name in list(sys.modules):
        if name.partition(".")[0] in tops:
            del sys.modules[name]


def _cpu() -> float:
    """This process's CPU seconds so far, user and system (a read from the page cache is a copy
    in the kernel: system time)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _read(cohort: Cohort) -> None:
    """Every upload read once, whole, with safetensors: its tensors copied out of the file's
    mapping (``load_file`` alone maps the file and touches none of it: 0.13 s for 200 uploads
    where the copy takes 1.3)."""
    from safetensors.torch import load_file

    for p in cohort.paths:
        for t in load_file(p).values():
            t.clone()


def _aggregation(strategy: str, cohort: Cohort) -> Callable[[], Any]:
    """The server's aggregation of the cohort with ``strategy`` at the default bound, ready to
    run (the global model loaded and the strategy built outside the timing)."""
    from safetensors.torch import load_file

    from fedkey.federation.config import InfluenceConfig
    from fedkey.federation.influence.bounding import bound_round
    from fedkey.federation.strategies import get_strategy
    from fedkey.server.aggregator import updates_of
    from fedkey.server.round_state import Upload

    glob = load_file(cohort.global_path)
    s = get_strategy(strategy)
    uploads = [
        (f"dev-{i:05d}", Upload(f"r{i}", "", cohort.upload_bytes, p, n, 1.0))
        for i, (p, n) in enumerate(zip(cohort.paths, cohort.samples, strict=True))
    ]

    def run() -> Any:
        updates = sorted(updates_of(uploads), key=lambda u: u.device_id)
        bounded = bound_round(InfluenceConfig(), glob, updates, None)
        return s.aggregate(glob, bounded, bounded.bound)

    return run


def measure(tree: str | None, what: str, cohort: Cohort) -> tuple[float, float, float]:
    """:func:`_in_child` in a fresh spawned process (its own peak RSS; no state carried)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_in_child, tree, what, cohort).result()


def run_aggregation(
    n: int,
    repeats: int,
    work: Path,
    out: Path | None,
    baseline: Path | None = None,
    vocab_size: int = 10_000,
    hidden_size: int = 300,
    keep: bool = False,
    echo: Callable[[str], None] = print,
) -> dict:
    """Write the cohort, measure (module docstring) and write OUT/results.json and results.md;
    the run's record. The uploads are removed afterwards unless ``keep``."""
    folder = work / f"uploads-{n}-{vocab_size}-{hidden_size}"
    echo(f"writing {n} uploads to {folder} ...")
    cohort = write_cohort(folder, n, vocab_size, hidden_size)
    trees: list[tuple[str, str | None]] = [("this checkout", None)]
    if baseline is not None:
        trees.append((str(baseline), str(baseline.resolve())))
    try:
        measure(None, "read", cohort)  # the page cache warmed
        times: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r in range(repeats):
            for label, tree in trees:
                for what in WHAT:
                    if what == "read" and tree is not None:
                        continue
                    got = measure(tree, what, cohort)
                    times.setdefault((label, what), []).append(got)
                    echo(
                        f"repeat {r + 1}/{repeats} {label} {what}: {got[0]:.2f} s "
                        f"({got[1]:.2f} s CPU), {got[2]:.0f} MB"
                    )
    finally:
        if not keep:
            for p in [*cohort.paths, cohort.global_path]:
                Path(p).unlink(missing_ok=True)
            if not any(folder.iterdir()):
                folder.rmdir()
    reads = times[("this checkout", "read")]
    read, read_cpu = (statistics.median(t[i] for t in reads) for i in (0, 1))
    rows = []
    for (label, what), done in times.items():
        seconds, cpu = (statistics.median(t[i] for t in done) for i in (0, 1))
        rows.append(
            {
                "server": label,
                "what": what,
                "seconds": round(seconds, 4),
                "cpu_seconds": round(cpu, 4),
                "all_seconds": [round(t[0], 4) for t in done],
                "per_read": round(seconds / read, 2),
                "cpu_per_read": round(cpu / read_cpu, 2),
                "peak_rss_mb": round(max(t[2] for t in done)),
            }
        )
    record = {
        "command": "fedkey-bench aggregation " + shlex.join(sys.argv[2:]),
        "uploads": n,
        "parameters": cohort.parameters,
        "upload_bytes": cohort.upload_bytes,
        "repeats": repeats,
        "git_commit": git("rev-parse", "HEAD"),
        "baseline_commit": git("rev-parse", "HEAD", tree=baseline) if baseline else None,
        "machine": machine_line(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if out is not None:
        save(out, record)
    return record


def save(out: Path, record: dict) -> None:
    """Add the run to OUT/results.json (replacing a run of the same size and model) and write
    OUT/results.md from it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    same = ("uploads", "parameters")
    runs = [r for r in runs if any(r[k] != record[k] for k in same)] + [record]
    runs.sort(key=lambda r: (r["parameters"], r["uploads"]))
    path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    (out / "results.md").write_text(page(runs))


def command(
    uploads: int = typer.Option(1000, "--uploads", "-n", min=2, help="Uploads in the round."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Interleaved repeats (medians)."),
    baseline: Path | None = typer.Option(
        None,
        "--baseline",
        help="Also measure the server code of this checkout (e.g. a git worktree of an earlier "
        "commit), interleaved, side by side.",
    ),
    vocab_size: int = typer.Option(10_000, "--vocab-size", min=4, help="The model's vocabulary."),
    hidden_size: int = typer.Option(300, "--hidden-size", min=1, help="GRU units (= embedding)."),
    work: Path = typer.Option(
        Path("runs/bench/aggregation"),
        "--work",
        help="Where the uploads are written (removed after).",
    ),
    out: Path = typer.Option(
        RESULTS / "aggregation", "--out", help="Where results.json and results.md are written."
    ),
    page_only: bool = typer.Option(
        False, "--page", help="Only rebuild OUT/results.md from OUT/results.json."
    ),
) -> None:
    """The server's aggregation of one round of UPLOADS stored uploads at the default bound (FedAvg
    and FedAtt), against reading them once: seconds, peak RSS and the ratio, in OUT/results.md.
    Needs UPLOADS x the model's size on disk (13.5 GB at 1,000 of the default model), and that
    much page cache to measure reads from memory."""
    if page_only:
        data = out / "results.json"
        if not data.is_file():
            raise UserError(f"--page: no {data} to rebuild the page from")
        (out / "results.md").write_text(page(json.loads(data.read_text())["runs"]))
        return
    if baseline is not None and not (baseline / BOUNDING).is_file():
        raise UserError(f"--baseline: {baseline} is not a fedkey checkout (no {BOUNDING})")
    run_aggregation(uploads, repeats, work, out, baseline, vocab_size, hidden_size)
