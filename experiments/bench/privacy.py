"""`fedkey-bench privacy`: the privacy-utility table of DP-FedAvg and DP-FedAtt (issue 15).

One workload, every cell the same but for the strategy and the noise: PTB cut to its first
``max_train_tokens`` training words, split IID over 1,000 phones, fixed-size cohorts of C = 0.1
(100 phones a round), one local epoch in steps of ``batch_size`` sentences, a GRU of
``hidden_size`` units, the same DP clip S and the same number of rounds R. S is the median
update norm of a short no-DP FedAvg run (the probe: its rows' ``info["clip"]["median_norm"]``)
unless given.

For each target epsilon (2, 8, 32 at delta 1e-5) :func:`calibrate_noise` finds the noise
multiplier z for which the server's own accountant (server.privacy: R rounds of
``SampledWithoutReplacementDpEvent(1000, 100, Gaussian(z))`` under replace-one adjacency) spends
exactly that epsilon. Both strategies get the same z, hence the same guarantee; the noise they get
differs through their sensitivity (server.strategies.sensitivity): the uniform mean's ``2 S / m``
(McMahan et al. 2018) against FedAtt's ``epsilon_step * a S (2 + sqrt(rho (m-1) / (rho+m-2)))``
with ``a = rho / (rho + m - 1)``, ``rho = e^(1/T)`` (the attention cap): 5.8x more at m = 100,
T = 1 and step 1.2. The no-DP cells use the same clip (``--bound fixed --bound-norm S``) without
noise.

Results: OUT/results.json (a cell already there with the same settings is not run again, so an
interrupted bench resumes), OUT/results.md and OUT/privacy.png. Each cell runs in-process
(runners.simulate.simulate) with its run folder (metrics.jsonl, checkpoints) under RUNS_DIR.
"""

from __future__ import annotations

import fnmatch
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.paper import Bench
from bench.runs import ROOT
from server.privacy import compute_epsilon

STRATEGIES = ("fedavg", "fedatt")
EPSILONS = (2.0, 8.0, 32.0)
PROBE_ID = "probe-fedavg-nodp"


@dataclass(frozen=True)
class Protocol:
    """What every cell shares."""

    data: str = str(ROOT.parent / "shared" / "data" / "ptb")
    clients: int = 1000
    fraction: float = 0.1
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 1  # sentences per local step: a phone's ~5 sentences give ~5 steps
    max_train_tokens: int = 100_000
    max_eval_sentences: int = 400
    vocab_size: int = 10_000
    hidden_size: int = 64
    seed: int = 0
    delta: float = 1e-5
    epsilons: tuple[float, ...] = EPSILONS
    clip: float | None = None  # the DP clip S; None: the probe's median update norm
    probe_rounds: int = 2
    workers: int | None = None  # training processes (None: one per core)

    @property
    def cohort(self) -> int:
        return max(1, round(self.fraction * self.clients))


@dataclass(frozen=True)
class Cell:
    """One run of the table: a strategy at a target epsilon (None: no DP, same clip)."""

    strategy: str
    epsilon: float | None
    noise_multiplier: float | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return f"{self.strategy}-" + ("nodp" if self.epsilon is None else f"eps{self.epsilon:g}")


# --------------------------------------------------------------------------- calibration


def epsilon_after(z: float, rounds: int, population: int, cohort: int, delta: float) -> float:
    """The accountant's epsilon after `rounds` fixed-size rounds of `cohort` of `population`."""
    return compute_epsilon(
        "fixed", float(z), ((float(population), int(cohort), int(rounds)),), delta
    )


def calibrate_noise(
    target: float,
    rounds: int,
    population: int,
    cohort: int,
    delta: float = 1e-5,
    rel_tol: float = 2e-3,
) -> float:
    """The noise multiplier z whose epsilon after `rounds` rounds is `target` (within `rel_tol`).

    Epsilon falls monotonically in z; the root is bracketed by doubling / halving z, then found by
    regula falsi with the Illinois modification on (log z, log epsilon), which is nearly linear:
    a handful of accountant calls (each ~0.5 s) instead of bisection's dozens.
    """
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"the target epsilon must be a positive number, got {target}")

    def f(log_z: float) -> float:
        return math.log(epsilon_after(math.exp(log_z), rounds, population, cohort, delta)) - (
            math.log(target)
        )

    lo, hi = math.log(0.5), math.log(2.0)
    f_lo, f_hi = f(lo), f(hi)
    for _ in range(40):  # f_lo > 0 (too little noise) and f_hi < 0 (too much)
        if f_lo > 0:
            break
        hi, f_hi, lo = lo, f_lo, lo - math.log(2.0)
        f_lo = f(lo)
    for _ in range(40):
        if f_hi < 0:
            break
        lo, f_lo, hi = hi, f_hi, hi + math.log(2.0)
        f_hi = f(hi)
    if not (f_lo > 0 > f_hi):
        raise ValueError(f"no noise multiplier reaches epsilon {target} in {rounds} rounds")
    side = 0
    for _ in range(60):
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f_mid = f(mid)
        if abs(f_mid) <= math.log1p(rel_tol):
            return math.exp(mid)
        if f_mid > 0:
            lo, f_lo = mid, f_mid
            if side == 1:
                f_hi /= 2
            side = 1
        else:
            hi, f_hi = mid, f_mid
            if side == -1:
                f_lo /= 2
            side = -1
    raise RuntimeError(f"the noise calibration for epsilon {target} did not converge")


# --------------------------------------------------------------------------- running


def settings_fields(protocol: Protocol, strategy: str, clip: float | None, z: float | None) -> dict:
    """The Settings fields of one run: DP when `z` is given (clip S, noise z), else the same clip
    S as a fixed server bound (`clip` None: no bound at all, the probe)."""
    fields: dict = dict(
        data=protocol.data,
        vocab_size=protocol.vocab_size,
        max_train_tokens=protocol.max_train_tokens,
        max_eval_sentences=protocol.max_eval_sentences,
        seed=protocol.seed,
        hidden_size=protocol.hidden_size,
        strategy=strategy,
        fraction=protocol.fraction,
        local_epochs=protocol.local_epochs,
        batch_size=protocol.batch_size,
        ksr_sentences=0,
        dp_delta=protocol.delta,
    )
    if z is not None:
        fields.update(dp_clip=clip, dp_noise_multiplier=z, dp_sampling="fixed")
    elif clip is not None:
        fields.update(bound="fixed", bound_norm=clip)
    else:
        fields.update(bound="off")
    return fields


def run_fields(fields: dict, rounds: int, protocol: Protocol, run_dir: Path) -> tuple[list, float]:
    """One in-process simulation; its metrics rows and wall seconds."""
    from dataclasses import replace

    from runners.simulate import SimulationConfig, simulate
    from server.settings import Settings

    settings = Settings(**fields, rounds=rounds)
    data = replace(settings.data_config(), clients=protocol.clients, partition="iid")
    start = time.perf_counter()
    rows = simulate(
        SimulationConfig(
            data,
            settings.federation_config(),
            settings.build_model_config,
            str(run_dir),
            protocol.workers,
            "cpu",
        )
    )
    return rows, time.perf_counter() - start


def _provenance() -> dict:
    from bench.perf import _git

    dirty = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/results"
    )
    return {"git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(dirty)}


def summarize(rows: list[dict], cell: Cell, clip: float, protocol: Protocol) -> dict:
    """One results.json object from a cell's metrics rows (round 0: the initial model)."""
    last = rows[-1]
    dp = (last.get("info") or {}).get("dp") or {}
    clipped = [(r.get("info") or {}).get("clip", {}).get("clipped") for r in rows[1:]]
    clipped = [c for c in clipped if c is not None]
    return {
        "id": cell.id,
        "strategy": cell.strategy,
        "target_epsilon": cell.epsilon,
        "epsilon": last.get("epsilon"),
        "noise_multiplier": cell.noise_multiplier,
        "clip": clip,
        "sensitivity": dp.get("sensitivity"),
        "noise_std": dp.get("noise_std"),
        "rounds": last["round"],
        "initial_test_ppl": rows[0]["test_ppl"],
        "final_test_ppl": last["test_ppl"],
        "best_round": last.get("best_round"),
        "best_val_ppl": last.get("best_val_ppl"),
        "best_test_ppl": last.get("best_test_ppl"),
        "clipped_per_round": statistics.mean(clipped) if clipped else None,
        # float32 parameters: the bytes one upload carries / 4
        "num_params": last["bytes_up"] // (4 * len(last["aggregated"]))
        if last.get("aggregated")
        else None,
        "test_ppl_curve": [r["test_ppl"] for r in rows],
    }


def cells(protocol: Protocol, zs: dict[float, float]) -> list[Cell]:
    """Every cell: each strategy without DP, then at each target epsilon (its calibrated z)."""
    targets: list[float | None] = [None, *protocol.epsilons]
    return [Cell(s, e, None if e is None else zs[e]) for s in STRATEGIES for e in targets]


def _config(fields: dict, rounds: int, protocol: Protocol) -> str:
    """What a result depends on, as the key a finished cell is found by."""
    return json.dumps({**fields, "rounds": rounds, "clients": protocol.clients}, sort_keys=True)


def _done(bench: Bench, cell_id: str, config: str) -> dict | None:
    return next((r for r in bench.read() if r["id"] == cell_id and r["config"] == config), None)


def measure_clip(
    bench: Bench, protocol: Protocol, runs_dir: Path, bench_command: str, runner=None
) -> float:
    """S: the median over the probe's rounds of each round's median update norm (no bound, no
    noise, FedAvg); the probe is kept in results.json and not run again."""
    if protocol.clip is not None:
        return protocol.clip
    fields = settings_fields(protocol, "fedavg", None, None)
    config = _config(fields, protocol.probe_rounds, protocol)
    done = _done(bench, PROBE_ID, config)
    if done is None:
        rows, wall = (runner or run_fields)(
            fields, protocol.probe_rounds, protocol, runs_dir / PROBE_ID
        )
        norms = [r["info"]["clip"]["median_norm"] for r in rows[1:]]
        done = {
            "id": PROBE_ID,
            "median_norms": norms,
            "clip": statistics.median(norms),
            "wall_seconds": round(wall, 1),
            "config": config,
            **_provenance(),
        }
        bench.add(done, bench_command)
    return float(done["clip"])


def select(all_cells: list[Cell], only: list[str] | None) -> list[Cell]:
    if not only:
        return all_cells
    todo = [c for c in all_cells if any(fnmatch.fnmatch(c.id, pat) for pat in only)]
    if not todo:
        ids = ", ".join(c.id for c in all_cells)
        raise ValueError(f"--only {' '.join(only)} matches no cell (the cells: {ids})")
    return todo


def run_privacy(
    out: Path,
    runs_dir: Path,
    protocol: Protocol,
    only: list[str] | None = None,
    bench_command: str = "",
    progress: bool = True,
    runner=run_fields,
) -> list[dict]:
    """Run every selected cell not yet in OUT/results.json (same settings), then the report.
    `runner(fields, rounds, protocol, run_dir) -> (rows, wall seconds)` runs one simulation."""
    from tqdm import tqdm

    from bench.privacy_report import write_report

    bench = Bench(out)
    clip = measure_clip(bench, protocol, runs_dir, bench_command, runner)
    zs = {
        e: calibrate_noise(e, protocol.rounds, protocol.clients, protocol.cohort, protocol.delta)
        for e in protocol.epsilons
    }
    todo = []
    for cell in select(cells(protocol, zs), only):
        fields = settings_fields(protocol, cell.strategy, clip, cell.noise_multiplier)
        config = _config(fields, protocol.rounds, protocol)
        if _done(bench, cell.id, config) is None:
            todo.append((cell, fields, config))
    bar = tqdm(total=len(todo), desc="bench privacy", unit="cell", disable=not progress)
    for cell, fields, config in todo:
        bar.set_postfix_str(cell.id)
        rows, wall = runner(fields, protocol.rounds, protocol, runs_dir / cell.id)
        result = {
            **summarize(rows, cell, clip, protocol),
            "wall_seconds": round(wall, 1),
            "config": config,
            **_provenance(),
        }
        bench.add(result, bench_command)
        bar.update()
        eps = result["epsilon"]
        bar.write(
            f"{cell.id}: test ppl {result['final_test_ppl']:.1f} (best-val "
            f"{result['best_test_ppl']:.1f}), epsilon {'-' if eps is None else f'{eps:.2f}'}, "
            f"{wall:.0f} s"
        )
    bar.close()
    runs = bench.read()
    write_report(runs, out, bench.commands(), asdict(protocol))
    return runs
