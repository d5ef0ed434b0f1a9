"""`fedkey-bench privacy`: the privacy-utility table of DP-FedAvg and DP-FedAtt (issues 15, 52).

Two workloads (:data:`WORKLOADS`). ``ptb``, every cell the same but for the strategy
and the noise: PTB cut to its first
``max_train_tokens`` training words, split IID over 1,000 phones, fixed-size cohorts of C = 0.1
(100 phones a round), one local epoch in steps of ``batch_size`` sentences, a GRU of
``hidden_size`` units, the same DP clip S and the same number of rounds R. S is the median
update norm of a short no-DP FedAvg run (the probe: its rows' ``info["clip"]["median_norm"]``)
unless given.

For each target epsilon (2, 8, 32 at delta 1e-5) :func:`calibrate_noise` finds the noise
multiplier z for which the server's own accountant (fedkey.federation.privacy.gaussian: R rounds of
``SampledWithoutReplacementDpEvent(1000, 100, Gaussian(z))`` under replace-one adjacency) spends
exactly that epsilon. Both strategies get the same z, hence the same guarantee; the noise they get
differs through their sensitivity (fedkey.federation.strategies.sensitivity): the uniform mean's ``2 S / m``
(McMahan et al. 2018) against FedAtt's ``epsilon_step * a S (2 + sqrt(rho (m-1) / (rho+m-2)))``
with ``a = rho / (rho + m - 1)``, ``rho = e^(1/T)`` (the attention cap): 5.8x more at m = 100,
T = 1 and step 1.2. The no-DP cells use the same clip (``--bound fixed --bound-norm S``) without
noise.

``irc``: the real Ubuntu IRC population, one phone per sender (the K with the most
training messages), delta the server's 1 / N^1.1, and three strategies: FedAvg, FedAtt with the
fixed normalizer (DP-FedAvg's sensitivity) and the paper's softmax FedAtt. Each DP cell runs
under one mechanism, gaussian (DP-FedAvg's sampled Gaussian), tree or blt (DP-FTRL at the default
separation b = floor(N / m)), with z calibrated on that mechanism's accounting (:func:`epsilon_of`).
Rows with a simulated cohort M (pfl-research's noise_cohort_size) train our cohort m with
``z = z' m / M``, z' the noise multiplier a deployment of cohort M and population N M / m needs
for the target (:func:`calibrate_cell`); their epsilon is that deployment's. Its results.json also
keeps a "plan" record (the protocol and every cell), from which its page
(fedkey_bench.privacy.grid_report) lists the cells not run yet.

Results: OUT/results.json (a cell already there with the same settings is not run again, so an
interrupted bench resumes), OUT/results.md and OUT/privacy.png. Each cell runs in-process
(fedkey.runners.simulate.simulate) with its run folder (metrics.jsonl, checkpoints) under RUNS_DIR.
"""

from __future__ import annotations

import fnmatch
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from fedkey.common.config import Scheme
from fedkey.federation.privacy.gaussian import population_delta
from fedkey.federation.strategies.selection import cohort_size
from fedkey_bench.common.runs import ROOT
from fedkey_bench.paper.results import Bench
from fedkey_bench.privacy.noise import MECHANISMS, deployment_population, epsilon_of, z_for

STRATEGIES = ("fedavg", "fedatt")
#: A cell's strategy: the server's strategy and FedAtt's normalizer (None: the default, softmax).
VARIANTS: dict[str, tuple[str, str | None]] = {
    "fedavg": ("fedavg", None),
    "fedatt": ("fedatt", None),
    "fedatt-fixed": ("fedatt", "fixed"),
}
EPSILONS = (2.0, 8.0, 32.0)
PROBE_ID = "probe-fedavg-nodp"
PLAN_ID = "plan"


@dataclass(frozen=True)
class Protocol:
    """What every cell shares (the defaults: the PTB workload)."""

    data: str = str(ROOT.parent / "shared" / "data" / "ptb")
    clients: int = 1000
    fraction: float = 0.1
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 1  # sentences per local step: a phone's ~5 sentences give ~5 steps
    max_train_tokens: int | None = 100_000
    max_eval_sentences: int = 400
    vocab_size: int = 10_000
    hidden_size: int = 64
    seed: int = 0
    delta: float | None = 1e-5  # None: the server's default, 1 / N^1.1 for N phones
    epsilons: tuple[float, ...] = EPSILONS
    clip: float | None = None  # the DP clip S; None: the probe's median update norm
    probe_rounds: int = 2
    workers: int | None = None  # training processes (None: one per core)
    partition: Scheme = "iid"  # user: one phone per sender (the K with the most training text)
    lr: float | None = None  # the phones' SGD learning rate (None: Settings' default)
    strategies: tuple[str, ...] = STRATEGIES  # keys of VARIANTS
    mechanisms: tuple[str, ...] = ("gaussian",)
    noise_cohorts: tuple[int, ...] = ()  # M: rows with the noise of a deployment's cohort of M

    @property
    def cohort(self) -> int:
        return cohort_size(self.fraction, self.clients)

    def delta_for(self, population: int) -> float:
        """The delta of a population of N phones: the protocol's, or the server's 1 / N^1.1."""
        return population_delta(population) if self.delta is None else self.delta


@dataclass(frozen=True)
class Cell:
    """One run of the table: a strategy at a target epsilon under a mechanism (epsilon None: no
    DP, same clip); with `noise_cohort` M, our cohort trained with the noise of a deployment
    whose cohorts are M phones (simulated: pfl-research's noise_cohort_size)."""

    strategy: str
    epsilon: float | None
    noise_multiplier: float | None = field(default=None, compare=False)
    mechanism: str = "gaussian"
    noise_cohort: int | None = None
    deployment_z: float | None = field(default=None, compare=False)  # z' of the deployment

    @property
    def id(self) -> str:
        if self.epsilon is None:
            return f"{self.strategy}-nodp"
        mech = "" if self.mechanism == "gaussian" else f"-{self.mechanism}"
        sim = "" if self.noise_cohort is None else f"-M{self.noise_cohort}"
        return f"{self.strategy}{mech}-eps{self.epsilon:g}{sim}"


#: The workloads `fedkey-bench privacy --workload` runs: PTB and the real IRC
#: population (one phone per sender, the mechanisms, simulated deployment cohorts).
WORKLOADS = {
    "ptb": Protocol(),
    "irc": Protocol(
        data=str(ROOT.parent / "shared" / "data" / "ubuntu-irc"),
        clients=2000,
        fraction=0.05,
        rounds=12,
        batch_size=10,
        max_train_tokens=None,
        max_eval_sentences=500,
        vocab_size=2000,
        delta=None,
        epsilons=(1.0, 2.0, 4.0, 8.0),
        partition="user",
        lr=3.0,
        strategies=("fedavg", "fedatt-fixed", "fedatt"),
        mechanisms=MECHANISMS,
        noise_cohorts=(5000,),
    ),
}


def usable_mechanisms(protocol: Protocol) -> tuple[tuple[str, ...], dict[str, str]]:
    """The protocol's mechanisms the server can run for its rounds and cohort, and why each
    other one cannot (blt: no shipped factorization for these rounds at this separation)."""
    ok, why = [], {}
    for mech in protocol.mechanisms:
        try:
            epsilon_of(mech, protocol.rounds, protocol.clients, protocol.cohort, 1e-5)
        except ValueError as e:
            why[mech] = str(e)
        else:
            ok.append(mech)
    return tuple(ok), why


# --------------------------------------------------------------------------- calibration


def calibrate_cell(protocol: Protocol, cell: Cell) -> Cell:
    """`cell` with its noise: z for its target epsilon on our population; for a simulated cohort
    of M, the deployment's z' (population N M / m: the same sampling rate, the same separation,
    its own delta) and the run's ``z' m / M``, whose noise on our cohort's average,
    ``z' m / M x 2S / m``, is the deployment's on its own, ``z' x 2S / M``."""
    if cell.epsilon is None:
        return cell
    n, m, mech, rounds = protocol.clients, protocol.cohort, cell.mechanism, protocol.rounds
    if cell.noise_cohort is None:
        z = z_for(cell.epsilon, mech, rounds, n, m, protocol.delta_for(n))
        return replace(cell, noise_multiplier=z)
    big_n = deployment_population(n, m, cell.noise_cohort)
    z_dep = z_for(cell.epsilon, mech, rounds, big_n, cell.noise_cohort, protocol.delta_for(big_n))
    return replace(cell, deployment_z=z_dep, noise_multiplier=z_dep * m / cell.noise_cohort)


# --------------------------------------------------------------------------- running


def settings_fields(
    protocol: Protocol,
    strategy: str,
    clip: float | None,
    z: float | None,
    mechanism: str = "gaussian",
) -> dict:
    """The Settings fields of one run: DP when `z` is given (clip S, noise z, `mechanism`), else
    the same clip S as a fixed server bound (`clip` None: no bound at all, the probe)."""
    name, normalizer = VARIANTS[strategy]
    fields: dict = dict(
        data=protocol.data,
        vocab_size=protocol.vocab_size,
        max_train_tokens=protocol.max_train_tokens,
        max_eval_sentences=protocol.max_eval_sentences,
        seed=protocol.seed,
        hidden_size=protocol.hidden_size,
        strategy=name,
        fraction=protocol.fraction,
        local_epochs=protocol.local_epochs,
        batch_size=protocol.batch_size,
        ksr_sentences=0,
        dp_delta=protocol.delta,
    )
    if normalizer is not None:
        fields["fedatt_normalizer"] = normalizer
    if protocol.lr is not None:
        fields["lr"] = protocol.lr
    if z is not None:
        fields.update(dp_clip=clip, dp_noise_multiplier=z, dp_sampling="fixed")
        if mechanism != "gaussian":
            fields["dp_mechanism"] = mechanism
    elif clip is not None:
        fields.update(bound="fixed", bound_norm=clip)
    else:
        fields.update(bound="off")
    return fields


def run_fields(fields: dict, rounds: int, protocol: Protocol, run_dir: Path) -> tuple[list, float]:
    """One in-process simulation; its metrics rows and wall seconds."""
    from fedkey.runners.simulate import SimulationConfig, simulate
    from fedkey.server.settings import Settings

    settings = Settings(**fields, rounds=rounds)
    data = replace(settings.data_config(), clients=protocol.clients, partition=protocol.partition)
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
    from fedkey_bench.common.provenance import git

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/results")
    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(dirty)}


def summarize(rows: list[dict], cell: Cell, clip: float, protocol: Protocol) -> dict:
    """One results.json object from a cell's metrics rows (round 0: the initial model). A
    simulated cohort's ``epsilon`` is the deployment's; ``server_epsilon`` is what the server
    accounted for our own population at the run's z."""
    last = rows[-1]
    uploaded = last.get("uploaded", last.get("aggregated"))  # rows of runs before "uploaded"
    dp = (last.get("info") or {}).get("dp") or {}
    clipped = [(r.get("info") or {}).get("clip", {}).get("clipped") for r in rows[1:]]
    clipped = [c for c in clipped if c is not None]
    best = last.get("best_round")
    result = {
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
        "best_round": best,
        "best_val_ppl": last.get("best_val_ppl"),
        "best_test_ppl": last.get("best_test_ppl"),
        "clipped_per_round": statistics.mean(clipped) if clipped else None,
        # float32 parameters: the bytes one upload carries / 4
        "num_params": last["bytes_up"] // (4 * len(uploaded)) if uploaded else None,
        "test_ppl_curve": [r["test_ppl"] for r in rows],
    }
    if cell.mechanism != "gaussian" or protocol.partition != "iid":  # the IRC workload's fields
        result.update(
            mechanism=cell.mechanism,
            final_top1=last.get("top1"),
            best_top1=rows[best].get("top1") if best is not None and best < len(rows) else None,
            final_bar_top1=last.get("bar_top1"),  # as a suggestion bar ranks: no </s>, <unk>
            best_bar_top1=(
                rows[best].get("bar_top1") if best is not None and best < len(rows) else None
            ),
            min_separation=dp.get("min_separation"),
            release_noise_std=dp.get("release_noise_std"),
            **deployment(protocol, cell),
        )
        if cell.noise_cohort is not None:
            result["server_epsilon"] = result["epsilon"]
            result["epsilon"] = result["deployment_epsilon"]
    return result


def deployment(protocol: Protocol, cell: Cell) -> dict:
    """A simulated cohort's deployment: its cohort M, population N' = N M / m, delta, z' and
    the epsilon its accountant gives z' (empty for a cell of our own population)."""
    if cell.noise_cohort is None or cell.epsilon is None or cell.deployment_z is None:
        return {"noise_cohort": None}
    big_n = deployment_population(protocol.clients, protocol.cohort, cell.noise_cohort)
    delta = protocol.delta_for(big_n)
    fn = epsilon_of(cell.mechanism, protocol.rounds, big_n, cell.noise_cohort, delta)
    return {
        "noise_cohort": cell.noise_cohort,
        "deployment_population": big_n,
        "deployment_delta": delta,
        "deployment_z": cell.deployment_z,
        "deployment_epsilon": fn(cell.deployment_z),
    }


def cells(protocol: Protocol) -> list[Cell]:
    """Every cell, uncalibrated: each strategy without DP, then under each mechanism at each
    target epsilon, first for our cohort, then with each simulated cohort's noise."""
    out = []
    mechanisms, _ = usable_mechanisms(protocol)
    for s in protocol.strategies:
        out.append(Cell(s, None))
        for mech in mechanisms:
            for m_big in (None, *protocol.noise_cohorts):
                out += [Cell(s, e, mechanism=mech, noise_cohort=m_big) for e in protocol.epsilons]
    return out


def _config(fields: dict, rounds: int, protocol: Protocol) -> str:
    """What a result depends on, as the key a finished cell is found by."""
    where: dict[str, object] = {"clients": protocol.clients}
    if protocol.partition != "iid":
        where["partition"] = protocol.partition
    return json.dumps({**fields, "rounds": rounds, **where}, sort_keys=True)


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
    """The cells whose id matches one of the `only` globs (all of them without)."""
    if not only:
        return all_cells
    todo = [c for c in all_cells if any(fnmatch.fnmatch(c.id, pat) for pat in only)]
    if not todo:
        ids = ", ".join(c.id for c in all_cells)
        raise ValueError(f"--only {' '.join(only)} matches no cell (the cells: {ids})")
    return todo


def plan_record(protocol: Protocol, planned: list[Cell]) -> dict:
    """What an issue-52 page needs beyond its cells: the protocol and every planned cell with
    its z, so that the page lists the cells not run yet (kept in results.json as id "plan")."""
    return {
        "id": PLAN_ID,
        "protocol": asdict(protocol),
        "cohort": protocol.cohort,
        "delta": protocol.delta_for(protocol.clients),
        "left_out": usable_mechanisms(protocol)[1],
        "cells": [
            {
                "id": c.id,
                "strategy": c.strategy,
                "mechanism": c.mechanism,
                "target_epsilon": c.epsilon,
                "noise_multiplier": c.noise_multiplier,
                "noise_cohort": c.noise_cohort,
            }
            for c in planned
        ],  # fmt: skip
    }


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
    `runner(fields, rounds, protocol, run_dir) -> (rows, wall seconds)` runs one simulation.
    The PTB workload (gaussian only, IID) writes the PTB page; any other also records the
    plan (every cell, run or not) and writes the grid's page (fedkey_bench.privacy.grid_report)."""
    from tqdm import tqdm

    from fedkey_bench.privacy.report import write_report

    bench = Bench(out)
    clip = measure_clip(bench, protocol, runs_dir, bench_command, runner)
    planned = [calibrate_cell(protocol, c) for c in cells(protocol)]
    grid = protocol.mechanisms != ("gaussian",) or protocol.partition != "iid"
    if grid:
        bench.add(plan_record(protocol, planned), bench_command)
    todo = []
    for cell in select(planned, only):
        fields = settings_fields(
            protocol, cell.strategy, clip, cell.noise_multiplier, cell.mechanism
        )
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
