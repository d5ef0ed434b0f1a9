"""fedkey_bench.common.runs: an interrupted simulate / train-central continues where it stopped when the bench
runs its command again, and the results record the command as the bench built it."""

import json
import os
import shlex

import pytest

from fedkey_bench.common.runs import Stopped, run_cpu_seconds, run_fedkey, run_seconds


def _interrupt(run_dir, last: int) -> None:
    """What a run stopped during epoch `last` leaves: checkpoints and rows up to last - 1."""
    (run_dir / "checkpoints" / f"round_{last:04d}.safetensors").unlink()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:last]))


@pytest.mark.slow
def test_an_interrupted_run_resumes_only_under_the_same_command(tmp_path):
    run_dir = tmp_path / "central"
    cmd = ["fedkey", "train-central", "--data", "demo", "--clients", "10"]
    cmd += ["--max-train-tokens", "5000", "--max-eval-sentences", "40", "--ksr-sentences", "0"]
    cmd += ["--epochs", "2", "--out", str(run_dir)]

    rows, first = run_fedkey("central", cmd, run_dir, resumable=True)
    assert [r["round"] for r in rows] == [0, 1, 2] and first["resumed"] is False

    _interrupt(run_dir, 2)
    rows, again = run_fedkey("central", cmd, run_dir, resumable=True)
    assert again["resumed"] is True
    assert "resumed after epoch 1 of 2" in (run_dir / "log.txt").read_text()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert again["command"] == first["command"] == shlex.join(cmd)  # no --resume in it

    _interrupt(run_dir, 2)
    other = [*cmd[:-4], "--epochs", "3", "--out", str(run_dir)]  # another run in the same folder
    rows, fresh = run_fedkey("central", other, run_dir, resumable=True)
    assert fresh["resumed"] is False and [r["round"] for r in rows] == [0, 1, 2, 3]

    _interrupt(run_dir, 3)
    rows, plain = run_fedkey("central", other, run_dir)  # a bench that does not resume
    assert plain["resumed"] is False and [r["round"] for r in rows] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_run_stopped_at_the_time_limit_goes_on_next_time_and_counts_every_attempt(tmp_path):
    """`fedkey-bench paper --hours`: a run still going at the limit is stopped (Stopped, no
    results); run again, it continues after its last checkpoint, and its results count the
    stopped attempts' time too."""
    run_dir = tmp_path / "central"
    cmd = ["fedkey", "train-central", "--data", "demo", "--clients", "10"]
    cmd += ["--max-train-tokens", "5000", "--max-eval-sentences", "40", "--ksr-sentences", "0"]
    cmd += ["--epochs", "2", "--out", str(run_dir)]
    run_fedkey("central", cmd, run_dir, resumable=True)
    _interrupt(run_dir, 2)  # an earlier attempt's epoch 1 ...
    (run_dir / "seconds.txt").write_text("100.0\n")  # ... took 100 s
    (run_dir / "cpu_seconds.txt").write_text("90.0\n")  # ... of which 90 s on a core

    with pytest.raises(Stopped) as stop:  # the limit has passed: stopped at once
        run_fedkey("central", cmd, run_dir, resumable=True, stop=lambda: True)
    assert stop.value.rounds == 1  # what it leaves to go on from
    spent = float((run_dir / "seconds.txt").read_text())
    assert spent > 100.0  # this attempt's time added
    cpu_spent = float((run_dir / "cpu_seconds.txt").read_text())
    assert cpu_spent >= 90.0  # and its CPU time (stopped at once: maybe none)

    rows, last = run_fedkey("central", cmd, run_dir, resumable=True, stop=lambda: False)
    assert last["resumed"] is True and [r["round"] for r in rows] == [0, 1, 2]
    assert "resumed after epoch 1 of 2" in (run_dir / "log.txt").read_text()
    assert last["earlier_seconds"] == pytest.approx(spent, abs=0.05)
    assert run_seconds(last) == pytest.approx(spent + last["wall_seconds"], abs=0.05)
    # the child's CPU time, from wait4: starting Python and torch and an epoch take some
    assert last["cpu_seconds"] > 0.5
    assert last["earlier_cpu_seconds"] == pytest.approx(cpu_spent, abs=0.05)
    assert run_cpu_seconds(last) == pytest.approx(cpu_spent + last["cpu_seconds"], abs=0.05)


@pytest.mark.slow
def test_a_run_resumed_after_an_attempt_of_unknown_cpu_time_has_none(tmp_path):
    """A bench killed outright during an attempt leaves no CPU figure for it (cpu_seconds.txt is
    removed while an attempt runs): the run's CPU total is unknown, not too small, and
    fedkey_bench.paper.budget judges by its wall time instead."""
    run_dir = tmp_path / "central"
    cmd = ["fedkey", "train-central", "--data", "demo", "--clients", "10"]
    cmd += ["--max-train-tokens", "5000", "--max-eval-sentences", "40", "--ksr-sentences", "0"]
    cmd += ["--epochs", "2", "--out", str(run_dir)]
    _, first = run_fedkey("central", cmd, run_dir, resumable=True)
    assert run_cpu_seconds(first) == first["cpu_seconds"] > 0.5
    _interrupt(run_dir, 2)
    (run_dir / "cpu_seconds.txt").unlink()  # what a killed bench's attempt leaves
    _, last = run_fedkey("central", cmd, run_dir, resumable=True)
    assert last["resumed"] is True and last["earlier_cpu_seconds"] is None
    assert run_cpu_seconds(last) is None
    assert not (run_dir / "cpu_seconds.txt").exists()  # still unknown for a later attempt


def _processes_in(run_dir) -> list[int]:
    """The processes whose command line names RUN_DIR (Linux /proc)."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if str(run_dir).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_a_killed_bench_stops_its_runs_with_it(tmp_path):
    """`kill <bench>` (SIGTERM) reaches only the bench's own process: it stops its runs' child
    processes before it ends, instead of leaving them to write their folders unseen."""
    import signal
    import subprocess
    import sys
    import time

    runs = tmp_path / "runs"
    run_dir = runs / "smoke" / "sweep-demo-fedavg-client-lr-0-5-c0.1"
    bench = subprocess.Popen(
        [sys.executable, "-m", "fedkey_bench.cli", "paper", "--preset", "smoke", "--suite", "sweep",
         "--only", run_dir.name, "--out", str(tmp_path / "out"), "--runs-dir", str(runs)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for _ in range(600):  # until its run's child is going: 60 s at most
            if _processes_in(run_dir) or bench.poll() is not None:
                break
            time.sleep(0.1)
        assert _processes_in(run_dir), "the bench never started its run"
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=60)
        assert _processes_in(run_dir) == []
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in _processes_in(run_dir):
            os.kill(pid, signal.SIGKILL)


def test_best_so_far_is_the_best_finite_validation_after_the_initial_model(tmp_path):
    """What a run stopped at a time limit has reached: the initial model's round 0 and a
    diverged round never count; nothing recorded yet is []."""
    from fedkey_bench.common.runs import best_so_far

    assert best_so_far(tmp_path) == []
    rows = [{"round": 0, "val_ppl": 10.0}, {"round": 1, "val_ppl": 300.0},
            {"round": 2, "val_ppl": float("nan")}, {"round": 3, "val_ppl": 250.5},
            {"round": 4, "val_ppl": 260.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert best_so_far(tmp_path) == [250.5, 3]


def test_where_a_run_ran_is_not_what_it_computes(tmp_path):
    """A run begun with trainer processes (`--workers 4`) continues as one stacked model on
    another device: its folder, processes, backend, device and kept checkpoints aside, the
    command is the same; any other flag makes it another run."""
    from fedkey_bench.common.runs import can_resume, what_it_computes

    base = "fedkey simulate --data d --rounds 50 --lr 1"
    begun = f"{base} --workers 4 --out runs/a --keep-checkpoints 2"
    now = f"{base} --backend stacked --device=cuda --out=runs/b --eval-device cpu"
    assert what_it_computes(begun) == what_it_computes(now) == tuple(base.split())
    assert what_it_computes(f"{base} --seed 1") != what_it_computes(base)

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "command.txt").write_text(begun + "\n")
    assert not can_resume(tmp_path, now)  # no checkpoint to continue after yet
    (tmp_path / "checkpoints" / "round_0007.safetensors").write_bytes(b"")
    assert can_resume(tmp_path, now)
    assert not can_resume(tmp_path, now.replace("--lr 1", "--lr 3"))
