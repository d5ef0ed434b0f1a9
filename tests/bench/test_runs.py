"""bench.runs: an interrupted simulate / train-central continues where it stopped when the bench
runs its command again, and the results record the command as the bench built it."""

import shlex
import time

import pytest

from bench.runs import Stopped, run_fedkey, run_seconds


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
    """`fedkey bench paper --hours`: a run still going at the limit is stopped (Stopped, no
    results); run again, it continues after its last checkpoint, and its results count the
    stopped attempts' time too."""
    run_dir = tmp_path / "central"
    cmd = ["fedkey", "train-central", "--data", "demo", "--clients", "10"]
    cmd += ["--max-train-tokens", "5000", "--max-eval-sentences", "40", "--ksr-sentences", "0"]
    cmd += ["--epochs", "2", "--out", str(run_dir)]
    run_fedkey("central", cmd, run_dir, resumable=True)
    _interrupt(run_dir, 2)  # an earlier attempt's epoch 1 ...
    (run_dir / "seconds.txt").write_text("100.0\n")  # ... took 100 s

    with pytest.raises(Stopped) as stop:  # the limit has passed: stopped at once
        run_fedkey("central", cmd, run_dir, resumable=True, stop_at=time.monotonic())
    assert stop.value.rounds == 1  # what it leaves to go on from
    spent = float((run_dir / "seconds.txt").read_text())
    assert spent > 100.0  # this attempt's time added

    rows, last = run_fedkey(
        "central", cmd, run_dir, resumable=True, stop_at=time.monotonic() + 3600
    )
    assert last["resumed"] is True and [r["round"] for r in rows] == [0, 1, 2]
    assert "resumed after epoch 1 of 2" in (run_dir / "log.txt").read_text()
    assert last["earlier_seconds"] == pytest.approx(spent, abs=0.05)
    assert run_seconds(last) == pytest.approx(spent + last["wall_seconds"], abs=0.05)
