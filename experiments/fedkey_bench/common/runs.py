"""One benchmark run: a `fedkey` command line in a child process, and what a results.json object
records of it besides its numbers (how long, the command, the code, the machine). The benches
(paper, attacks) each summarize the rows their own way; running is shared."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from fedkey.common.files import atomic_write
from fedkey_bench.common.checkout import ROOT


class Stopped(Exception):
    """A run stopped before its end (`run_fedkey(stop=...)`: the bench's time limit, or the bench
    interrupted). A resumable run's folder keeps its checkpoints, so running its command again
    continues it."""

    def __init__(self, run_id: str, rounds: int):
        super().__init__(f"{run_id}: stopped after {rounds} rounds")
        self.run_id, self.rounds = run_id, rounds


#: Seconds that the earlier, stopped attempts at a run's command took (bench provenance).
SPENT = "seconds.txt"
#: CPU seconds of those attempts (their processes and the trainer processes they waited for);
#: absent while an attempt runs, so a bench killed during one leaves the total unknown.
CPU_SPENT = "cpu_seconds.txt"


def read_rows(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl rows so far (none before its first row)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def best_so_far(run_dir: Path) -> list[float]:
    """[the best validation perplexity, its round] of the rounds RUN_DIR has recorded after the
    initial model's; [] before the first (or where none is finite)."""
    rows = [r for r in read_rows(run_dir) if r.get("round", 0) > 0
            and isinstance(r.get("val_ppl"), float | int) and math.isfinite(r["val_ppl"])]  # fmt: skip
    best = min(rows, key=lambda r: r["val_ppl"], default=None)
    return [] if best is None else [best["val_ppl"], best["round"]]


def can_resume(run_dir: Path, line: str) -> bool:
    """Whether RUN_DIR holds an interrupted run of the command `line` (its command.txt, where it
    ran aside: :func:`what_it_computes`) with a checkpoint to continue after: a run begun with
    trainer processes may go on as one stacked model."""
    marker = run_dir / "command.txt"
    return (
        marker.is_file()
        and what_it_computes(marker.read_text().strip()) == what_it_computes(line)
        and any((run_dir / "checkpoints").glob("round_*.safetensors"))
    )


def run_seconds(result: Mapping) -> float:
    """A run's wall time over all its attempts: the stopped ones (`earlier_seconds`; one from
    before the bench timed them counts 0) and the one that finished it. A run recorded from
    another (`same_run_as`: :func:`twins`) cost nothing."""
    if result.get("same_run_as"):
        return 0.0
    return float(result["wall_seconds"]) + float(result.get("earlier_seconds") or 0.0)


def run_cpu_seconds(result: Mapping) -> float | None:
    """A run's CPU seconds over all its attempts (None: not known, for a run from before the
    bench recorded them, or one an attempt of which was cut short without a figure). Unlike its
    wall time, it does not grow when other processes share the cores: fedkey_bench.paper.budget judges
    the runs to be by it."""
    if result.get("same_run_as"):
        return 0.0
    if result.get("cpu_seconds") is None:
        return None
    earlier = result.get("earlier_cpu_seconds", 0.0) if result.get("resumed") else 0.0
    return None if earlier is None else float(result["cpu_seconds"]) + float(earlier)


#: Options that say where or how a run ran, not what it computes (each takes one value): its
#: folder, its trainer processes or backend, its device, how many checkpoints it keeps. The
#: backends give the same weights (bit for bit, or to float rounding on the stacked one:
#: tests/device_sim/training/test_stacked.py), so a run done one way is done for a bench that would now
#: run it another.
PLACE_FLAGS = ("--out", "--workers", "--backend", "--device", "--eval-device", "--keep-checkpoints")


def without_options(line: str, options: Mapping[str, int]) -> list[str]:
    """The words of a command line without the `options` (name -> how many values follow it;
    none follow a `--name=value`)."""
    kept: list[str] = []
    skip = 0
    for word in shlex.split(line):
        name = word.split("=", 1)[0]
        if skip:
            skip -= 1
        elif name in options:
            skip = options[name] if "=" not in word else 0
        else:
            kept.append(word)
    return kept


def what_it_computes(line: str) -> tuple[str, ...]:
    """A run's command line without the options of PLACE_FLAGS."""
    return tuple(without_options(line, dict.fromkeys(PLACE_FLAGS, 1)))


def twins(runs: Iterable[Mapping]) -> dict[tuple[str, ...], Mapping]:
    """The done runs by what their command lines compute (:func:`what_it_computes`; the first of
    several): a run to be whose command is one of these has the same seed, data, flags and code
    path, so the same weights round for round. On the gpu preset the sweep's whole 50-round runs
    at C 0.1 are the ranking's runs at the values it chose."""
    index: dict[tuple[str, ...], Mapping] = {}
    for r in runs:
        index.setdefault(what_it_computes(r.get("command", "")), r)
    return index


def rounds_done(run_dir: Path) -> int:
    """Rounds (or epochs) recorded in RUN_DIR/metrics.jsonl so far: its last row's (0: none, or
    only the initial model's row)."""
    rows = read_rows(run_dir)
    return int(rows[-1].get("round", 0)) if rows else 0


def _seconds(path: Path) -> float | None:
    """The seconds a file of SPENT holds (None: no such file, or not a number)."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def device_label() -> str:
    """Where the runs train: the GPU's name, or the CPU's model and core count."""
    from fedkey_bench.common.provenance import machine

    info = machine()
    if info["device"] != "cpu":
        return info["device"]
    return f"cpu ({info['cpu_model']}, {info['cpus']} cores)"


def run_fedkey(
    run_id: str,
    cmd: list[str],
    run_dir: Path,
    env: Mapping[str, str] | None = None,
    on_round: Callable[[int], None] | None = None,
    resumable: bool = False,
    stop: Callable[[], bool] | None = None,
) -> tuple[list[dict], dict]:
    """Run `cmd` (["fedkey", verb, ...]) with this interpreter, its output in RUN_DIR/log.txt;
    -> (its metrics rows, the provenance fields of its results.json object). `on_round(rounds
    recorded so far)` follows metrics.jsonl while it runs. An interrupted run stops the child (and
    its training pool); a failed one raises RuntimeError with the end of its log.

    `resumable` (a verb with --resume: simulate, train-central): a run directory that an
    interrupted run of the same command left behind (RUN_DIR/command.txt says which) continues
    after its last checkpoint instead of starting again. --resume is how the run is executed,
    not what it is: the recorded command leaves it out, so the bench still finds the run done.

    `stop` (asked every 2 s: the bench's time limit is reached, or the bench is interrupted):
    once it says True the run is stopped and Stopped is raised; a resumable one continues from
    its last checkpoint the next time. RUN_DIR/seconds.txt keeps the time of the attempts so
    far, so that a run done over several benches reports all of it (`earlier_seconds`); CPU_SPENT
    keeps their CPU seconds (`cpu_seconds`, `earlier_cpu_seconds`: the child's and those of the
    trainer processes it waited for, from wait4)."""
    from fedkey_bench.common.provenance import git

    run_dir.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "HEAD")  # the code the run starts from
    # Uncommitted changes to the code; results.json, which the bench itself rewrites, aside.
    dirty = bool(
        git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/results")
    )
    argv = [sys.executable, "-m", "fedkey", *cmd[1:]]
    marker, line = run_dir / "command.txt", shlex.join(cmd)
    resume = resumable and can_resume(run_dir, line)
    if resume:
        argv.append("--resume")
    marker.write_text(line + "\n")
    spent = run_dir / SPENT
    earlier = _seconds(spent) if resume else 0.0
    cpu_spent = run_dir / CPU_SPENT
    earlier_cpu = _seconds(cpu_spent) if resume else 0.0
    cpu_spent.unlink(missing_ok=True)  # unknown until this attempt's child is reaped
    cpu = 0.0
    start = time.perf_counter()
    with (run_dir / "log.txt").open("a" if resume else "w") as log:
        child = subprocess.Popen(
            argv, cwd=ROOT, env=None if env is None else dict(env), stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        noted = start

        def note() -> None:  # the time so far, should the bench itself be killed
            nonlocal noted
            noted = time.perf_counter()
            if earlier is not None:
                # exact (repr): an attempt stopped at once may take under 1 ms
                atomic_write(spent, f"{earlier + noted - start!r}\n")

        def reaped(block: bool) -> bool:
            """Whether the child has ended; once it has, its exit code and CPU seconds (wait4's,
            which Popen.wait does not give) are kept."""
            nonlocal cpu
            if child.returncode is not None:
                return True
            pid, status, usage = os.wait4(child.pid, 0 if block else os.WNOHANG)
            if pid == 0:
                return False
            child.returncode = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
            return True

        try:
            while not reaped(block=False) and not (stop is not None and stop()):
                for _ in range(40):  # 2 s, or less once the child ends (as Popen.wait polls)
                    if reaped(block=False):
                        break
                    time.sleep(0.05)
                if on_round is not None:
                    on_round(rounds_done(run_dir))
                if time.perf_counter() - noted > 30.0:
                    note()
        finally:
            if child.returncode is None:  # interrupted or out of time: stop it and its pool
                child.terminate()
                reaped(block=True)
            note()
            if earlier_cpu is not None:
                atomic_write(cpu_spent, f"{earlier_cpu + cpu!r}\n")
    if stop is not None and child.returncode < 0 and stop():
        raise Stopped(run_id, rounds_done(run_dir))
    wall = time.perf_counter() - start
    if child.returncode != 0:
        tail = (run_dir / "log.txt").read_text()[-2000:]
        raise RuntimeError(f"{run_id}: `{shlex.join(cmd)}` exited {child.returncode}\n{tail}")
    provenance = {
        "wall_seconds": round(wall, 1),  # of this process: a resumed run's earlier part left out
        "resumed": resume,
        # the attempts before this one (None: not timed, from before the bench recorded it)
        **({"earlier_seconds": earlier and round(earlier, 1)} if resume else {}),
        "cpu_seconds": round(cpu, 1),  # this attempt's, as wall_seconds
        **({"earlier_cpu_seconds": earlier_cpu and round(earlier_cpu, 1)} if resume else {}),
        "command": line,
        "git_commit": commit,
        "git_dirty": dirty,
        "device": device_label(),
    }
    return read_rows(run_dir), provenance
