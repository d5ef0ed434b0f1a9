"""`fedkey-bench dpfinetune`: the privacy-utility table of private fine-tuning from the public base
(issue 66). Does DP-FTRL fine-tuning of the shipped base on the phones keep most of what the
non-private fine-tune gains, and beat the base alone?

Per population (fedkey_bench.dpfinetune.cells: the cells and their commands), each cell is one
resumable `fedkey simulate` in OUT/runs/<population>/<cell> (fedkey_bench.common.runs): the
non-private fine-tunes first (FedAvg's gives the DP cells their first clip S0, its first round's
median update norm, unless --clip says it), then each strategy at each epsilon. A cell recorded
in OUT/results.json with the same command is not run again; an interrupted one resumes after its
last checkpoint; one that fedkey refuses (its `error:` line) is recorded as such and the others
go on. The page: OUT/results.md (fedkey_bench.dpfinetune.report).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedkey_bench.common.runs import read_rows, rounds_done, run_fedkey, what_it_computes
from fedkey_bench.dpfinetune.cells import (
    REFERENCE,
    Cell,
    Population,
    Protocol,
    argv,
    cells,
    clip_text,
    selected,
)
from fedkey_bench.dpfinetune.report import load, save
from fedkey_bench.dpfinetune.summary import base, first_median_norm, summarize


def run_dir(out: Path, pop: Population, cell: Cell) -> Path:
    return out / "runs" / pop.name / cell.id


def command_line(
    pop: Population, p: Protocol, cell: Cell, clip: str | None, out: Path
) -> list[str]:
    return [*argv(pop, p, cell, clip), "--out", str(run_dir(out, pop, cell))]


def is_done(cmd: list[str], folder: Path, recorded: dict[str, Any] | None) -> bool:
    """Whether the cell is recorded as finished with the same command (where it ran aside:
    what_it_computes) and its folder still holds its rows."""
    if not recorded or "command" not in recorded or recorded.get("error"):
        return False
    same = what_it_computes(recorded["command"]) == what_it_computes(shlex.join(cmd))
    return same and rounds_done(folder) >= int(recorded.get("rounds_done") or 0)


def refusal(message: str) -> str:
    """The reason a failed run gives: fedkey's last `error:` line, else the failure's first line."""
    errors = [line.removeprefix("error:").strip() for line in message.splitlines()
              if line.startswith("error:")]  # fmt: skip
    return errors[-1] if errors else (message.splitlines() or ["failed"])[0]


def first_clip(pop: Population, p: Protocol, out: Path) -> tuple[str, str]:
    """S0 as the commands give it, and where it came from: --clip, else the non-private FedAvg
    run's first round's median update norm (ValueError: that round is not on disk yet)."""
    if p.clip is not None:
        return clip_text(p.clip), "--clip"
    norm = first_median_norm(read_rows(run_dir(out, pop, Cell("fedavg", None))))
    if norm is None:
        raise ValueError(
            f"{pop.name}: the DP cells' first clip S0 is the median update norm of {REFERENCE}'s "
            f"first round, which has not run: run it first (--only {REFERENCE}) or give --clip S"
        )
    return clip_text(norm), f"the median update norm of {REFERENCE}'s first round"


def _progress(name: str, rounds: int):
    seen = [0]

    def on_round(done: int) -> None:
        if done > seen[0]:
            seen[0] = done
            print(f"    {name}: round {done} of {rounds}", flush=True)

    return on_round


def run_cell(pop: Population, p: Protocol, cell: Cell, clip: str | None, out: Path) -> str | None:
    """Run one cell unless it is done, and record it; -> why fedkey refused it (None: it ran)."""
    name, folder = f"{pop.name}/{cell.id}", run_dir(out, pop, cell)
    cmd = command_line(pop, p, cell, clip, out)
    entry = load(out)["populations"].get(pop.name) or {}
    if is_done(cmd, folder, (entry.get("cells") or {}).get(cell.id)):
        print(f"  {name}: done", flush=True)
        return None
    print(f"  {name}: running ({p.rounds} rounds): {shlex.join(cmd)}", flush=True)
    try:
        rows, provenance = run_fedkey(
            name, cmd, folder, on_round=_progress(name, p.rounds), resumable=True
        )
        record, error = {**summarize(rows, cell, p.rounds), **provenance}, None
    except RuntimeError as e:
        error = refusal(str(e))
        record = {"id": cell.id, "label": cell.label, "strategy": cell.strategy,
                  "target_epsilon": cell.epsilon, "error": error, "command": shlex.join(cmd)}  # fmt: skip
        rows = read_rows(folder)
    results = load(out)  # again: the run took a while
    pop_entry = results["populations"].setdefault(pop.name, {})
    pop_entry.setdefault("cells", {})[cell.id] = record
    if base(rows) is not None:
        pop_entry["base"] = base(rows)
    save(out, results)
    print(f"  {name}: " + (f"refused: {error}" if error else _line(record)), flush=True)
    return error


def _line(r: dict[str, Any]) -> str:
    eps = "" if r.get("epsilon") is None else f", epsilon {r['epsilon']:.3g}"
    return (f"best round {r.get('best_round')}: test ppl {r.get('test_ppl'):.2f}, top-1 "
            f"{r.get('all_top1'):.4f}{eps} ({r.get('wall_seconds')} s)")  # fmt: skip


def plan(pop: Population, p: Protocol, out: Path, bench_command: str) -> None:
    """Record the population's protocol and every planned cell (the page lists those not run)."""
    from fedkey_bench.common.provenance import git, machine_line

    results = load(out)
    entry = results["populations"].setdefault(pop.name, {})
    entry.update({
        "label": pop.label, "data": pop.data, "clients": p.clients_of(pop),
        "fraction": p.fraction_of(pop), "settings": asdict(p),
        "planned": [{"id": c.id, "label": c.label} for c in cells(p)],
        "command": bench_command, "machine": machine_line(),
        "git_commit": git("rev-parse", "HEAD"),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    })  # fmt: skip
    save(out, results)


def run_population(pop: Population, p: Protocol, out: Path, only: list[str] | None,
                   bench_command: str) -> dict[str, str]:  # fmt: skip
    """Every selected cell of `pop` not done yet; -> the refused cells and why."""
    todo = selected(cells(p), only)
    if not todo:
        raise ValueError(
            f"--only {' '.join(only or [])}: no cell of {', '.join(c.id for c in cells(p))}"
        )
    plan(pop, p, out, bench_command)
    refused: dict[str, str] = {}
    clip: str | None = None
    for cell in todo:
        if cell.private and clip is None:
            clip = record_clip(pop, p, out, refused.get(f"{pop.name}/{REFERENCE}"))
        error = run_cell(pop, p, cell, clip, out)
        if error:
            refused[f"{pop.name}/{cell.id}"] = error
    return refused


def record_clip(pop: Population, p: Protocol, out: Path, reference_error: str | None) -> str:
    """S0 (:func:`first_clip`), kept in results.json; ValueError naming why the reference run
    failed when S0 was to come from it."""
    try:
        clip, source = first_clip(pop, p, out)
    except ValueError:
        if reference_error:
            raise ValueError(f"{pop.name}/{REFERENCE}: {reference_error}") from None
        raise
    results = load(out)
    results["populations"][pop.name]["first_clip"] = {"value": float(clip), "source": source}
    save(out, results)
    return clip


def dry_run(pop: Population, p: Protocol, out: Path, only: list[str] | None) -> None:
    """Print each selected cell's command (S0 as known so far, else `S0`); run nothing."""
    try:
        clip = first_clip(pop, p, out)[0]
    except ValueError:
        clip = "S0"
    for cell in selected(cells(p), only):
        print(shlex.join(command_line(pop, p, cell, clip, out)))
