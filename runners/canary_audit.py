"""`fedkey audit canary`: does the federation memorize one phone's secret, and does DP stop it?

The audit of Carlini et al. 2019 ("The Secret Sharer"), run through fedkey's own commands: one
`fedkey simulate --canary` per arm plants `repeats` copies of a random secret of the format
'my secret is _ _ _ _' (10^4 candidates, fedkey.models.canary) in the first phone's shard and records the
secret's exposure (fedkey.models.exposure: log2 |R| - log2 rank, 13.3 bits at most, ~1.4 at chance)
beside perplexity after every round. The arms:

    FedAvg, FedAtt            no DP and no bound on any update (--bound off: the seed papers')
    DP-FedAvg, DP-FedAtt      --dp-clip S --dp-noise-multiplier z, for each z asked (the server
                              clips each update to S and adds noise z x the aggregate's
                              sensitivity; the accountant reports epsilon every round)
    ..., not planted          each DP arm again with --canary-repeats 0: the same run (same
                              cohorts, same seeded noise) where no phone holds the secret, so
                              its exposure is what chance gives that noise; the planted arm's
                              excess over it is what the phone's data added

Every run is a child process (`python -m fedkey simulate ...`) with its own folder; its summary goes
into OUT/results.json with the command, the git commit and the machine, and a run whose command is
already there is not run again, so an interrupted audit resumes. results.md and exposure.png are
written from results.json alone (write_report).

This module runs the arms; fedkey.runners.canary_arms defines them, fedkey.runners.canary_report records and
reports them (the names below are re-exported for `fedkey audit` and the research harness).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from fedkey.runners.canary_arms import (
    Arm,
    AuditConfig,
    arms,
    canary_phone,
    command,
    select,
    summarize,
)
from fedkey.runners.canary_report import Results, per_round_table, write_report
from fedkey.runners.source import git

__all__ = [
    "AuditConfig",
    "Arm",
    "Results",
    "arms",
    "canary_phone",
    "command",
    "per_round_table",
    "run_audit",
    "summarize",
    "write_report",
]


def _device() -> str:
    """Where the arms train: the GPU's name, or the CPU's model and core count."""
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"cpu ({model}, {os.cpu_count()} cores)"


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _split_env(cmd: list[str]) -> tuple[dict[str, str], list[str]]:
    """`env NAME=value ... fedkey ...` -> ({NAME: value}, ["fedkey", ...])."""
    if not cmd or cmd[0] != "env":
        return {}, cmd
    at = cmd.index("fedkey")
    return dict(item.split("=", 1) for item in cmd[1:at]), cmd[at:]


def run_fedkey(
    run_id: str,
    cmd: list[str],
    run_dir: Path,
    env: dict[str, str],
    on_round: Callable[[int], None] = lambda n: None,
    results: Path | None = None,
) -> tuple[list[dict], dict]:
    """Run `cmd` (["fedkey", verb, ...], maybe after ["env", "NAME=value", ...]) with this
    interpreter, its output in RUN_DIR/log.txt;
    -> (its metrics rows, the provenance fields of its results.json object). `on_round(rounds
    recorded so far)` follows metrics.jsonl. Ctrl-C stops the child; a failed run raises
    RuntimeError with the end of its log. `results`: the folder the audit writes into, which is
    not a change to the code (git_dirty)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "HEAD")
    aside = []
    top = git("rev-parse", "--show-toplevel")
    if results is not None and top is not None and results.resolve().is_relative_to(top):
        aside = [f":!{results.resolve().relative_to(top)}"]
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", top or ".", *aside))
    line = shlex.join(cmd)
    (run_dir / "command.txt").write_text(line + "\n")
    assigned, argv = _split_env(cmd)
    start = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "fedkey", *argv[1:]],
            env={**env, **assigned},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while child.poll() is None:
                time.sleep(1.0)
                rows = _rows(run_dir)
                on_round(int(rows[-1].get("round", 0)) if rows else 0)
        finally:
            if child.poll() is None:  # interrupted: stop it and its training processes
                child.terminate()
                child.wait()
    if child.returncode != 0:
        tail = (run_dir / "log.txt").read_text()[-2000:]
        raise RuntimeError(f"{run_id}: `{line}` exited {child.returncode}\n{tail}")
    provenance = {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": line,
        "git_commit": commit,
        "git_dirty": dirty,
        "device": _device(),
    }
    return _rows(run_dir), provenance


def run_arm(
    arm: Arm,
    cfg: AuditConfig,
    runs_dir: Path,
    on_round: Callable[[int], None] = lambda n: None,
    results: Path | None = None,
) -> dict:
    """Run one arm as a child process (its log in its folder); its summary, with the command
    and the machine. `on_round(rounds recorded so far)` follows its metrics.jsonl."""
    run_dir = runs_dir / arm.id
    # The default format (the report's): no FEDKEY_CANARY_FORMAT / _ALPHABET from the shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDKEY_CANARY")}
    rows, provenance = run_fedkey(
        arm.id, command(arm, cfg, run_dir), run_dir, env, on_round, results
    )
    return {**summarize(rows, arm, cfg.clients), **provenance, "config": asdict(cfg)}


def run_audit(
    cfg: AuditConfig,
    out: Path,
    runs_dir: Path,
    only: list[str] | None = None,
    dry_run: bool = False,
    audit_command: str = "",
) -> list[dict]:
    """Run every arm not yet in OUT/results.json with the same command, then write the report;
    -> the results of every arm in results.json."""
    from tqdm import tqdm

    store = Results(out)
    todo = store.pending(
        select(arms(cfg), only), lambda a: (a.id, command(a, cfg, runs_dir / a.id)), dry_run
    )
    if dry_run:
        return store.read()
    bar = tqdm(total=len(todo) * cfg.rounds, desc="audit canary", unit="round")
    for i, arm in enumerate(todo):
        bar.set_postfix_str(arm.label)

        def follow(done: int, base: int = i * cfg.rounds) -> None:
            bar.update(base + min(done, cfg.rounds) - bar.n)

        result = run_arm(arm, cfg, runs_dir, on_round=follow, results=out)
        follow(cfg.rounds)
        store.add(result, audit_command)
        if arm.planted and not result["canary_rounds"]:
            bar.write(
                f"{arm.label}: {result['canary_phone']}, the phone holding the secret, was in no "
                "round's aggregate, so this arm measures nothing: run more rounds, a larger "
                "--fraction or another --seed"
            )
        bar.write(
            f"{arm.label}: exposure {result['exposure']:.2f} bits (max "
            f"{result['max_exposure']:.2f}), test ppl {result['test_ppl']:.1f}, "
            f"{result['wall_seconds']:.0f} s"
        )
    bar.close()
    runs = store.read()
    write_report(runs, out, store.commands())
    return runs
