"""One benchmark run: a `fedkey` command line in a child process, and what a results.json object
records of it besides its numbers (how long, the command, the code, the machine). The benches
(paper, attacks, canary) each summarize the rows their own way; running is shared."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_rows(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl rows so far (none before its first row)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def can_resume(run_dir: Path, line: str) -> bool:
    """Whether RUN_DIR holds an interrupted run of the command `line` (its command.txt) with a
    checkpoint to continue after."""
    marker = run_dir / "command.txt"
    return (
        marker.is_file()
        and marker.read_text().strip() == line
        and any((run_dir / "checkpoints").glob("round_*.safetensors"))
    )


def device_label() -> str:
    """Where the runs train: the GPU's name, or the CPU's model and core count."""
    from bench.perf import machine  # imports torch: only once a run is made

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
) -> tuple[list[dict], dict]:
    """Run `cmd` (["fedkey", verb, ...]) with this interpreter, its output in RUN_DIR/log.txt;
    -> (its metrics rows, the provenance fields of its results.json object). `on_round(rounds
    recorded so far)` follows metrics.jsonl while it runs. An interrupted run stops the child (and
    its training pool); a failed one raises RuntimeError with the end of its log.

    `resumable` (a verb with --resume: simulate, train-central): a run directory that an
    interrupted run of the same command left behind (RUN_DIR/command.txt says which) continues
    after its last checkpoint instead of starting again. --resume is how the run is executed,
    not what it is: the recorded command leaves it out, so the bench still finds the run done."""
    from bench.perf import _git

    run_dir.mkdir(parents=True, exist_ok=True)
    commit = _git("rev-parse", "HEAD")  # the code the run starts from
    # Uncommitted changes to the code; results.json, which the bench itself rewrites, aside.
    dirty = bool(
        _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    )
    argv = [sys.executable, "-c", "from cli import main; main()", *cmd[1:]]
    marker, line = run_dir / "command.txt", shlex.join(cmd)
    resume = resumable and can_resume(run_dir, line)
    if resume:
        argv.append("--resume")
    marker.write_text(line + "\n")
    start = time.perf_counter()
    with (run_dir / "log.txt").open("a" if resume else "w") as log:
        child = subprocess.Popen(
            argv, cwd=ROOT, env=None if env is None else dict(env), stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            if on_round is None:
                child.wait()
            else:
                while child.poll() is None:
                    time.sleep(2.0)
                    on_round(max(0, len(read_rows(run_dir)) - 1))
        finally:
            if child.poll() is None:  # interrupted: stop the child and its training pool
                child.terminate()
                child.wait()
    wall = time.perf_counter() - start
    if child.returncode != 0:
        tail = (run_dir / "log.txt").read_text()[-2000:]
        raise RuntimeError(f"{run_id}: `{shlex.join(cmd)}` exited {child.returncode}\n{tail}")
    provenance = {
        "wall_seconds": round(wall, 1),  # of this process: a resumed run's earlier part left out
        "resumed": resume,
        "command": line,
        "git_commit": commit,
        "git_dirty": dirty,
        "device": device_label(),
    }
    return read_rows(run_dir), provenance
