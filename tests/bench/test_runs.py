"""bench.runs: an interrupted simulate / train-central continues where it stopped when the bench
runs its command again, and the results record the command as the bench built it."""

import shlex

import pytest

from bench.runs import run_fedkey


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
