"""`fedkey evaluate`: a checkpoint scored on held-out text gives the numbers its run recorded for
that round, so a figure in a results table can be checked from the model kept for it."""

import json

import pytest
from typer.testing import CliRunner

from fedkey.cli import app

runner = CliRunner()
HELD_OUT = ["--data", "demo", "--max-eval-sentences", "60", "--ksr-sentences", "5"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    args = ["simulate", *HELD_OUT, "--clients", "4", "--fraction", "0.5", "--rounds", "2",
            "--local-epochs", "1", "--max-train-tokens", "3000", "--workers", "0",
            "--out", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def _row(run_dir, r: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(row for row in rows if row["round"] == r)


def test_a_checkpoint_scores_what_its_run_recorded_for_that_round(run_dir):
    ckpt = run_dir / "checkpoints" / "round_0002.safetensors"
    result = runner.invoke(app, ["evaluate", str(ckpt), *HELD_OUT, "--json"])
    assert result.exit_code == 0, result.output
    scores, row = json.loads(result.output), _row(run_dir, 2)
    for key in ("val_ppl", "test_ppl", "top1", "top3", "ksr"):
        assert scores[key] == pytest.approx(row[key], rel=1e-6), key
    assert scores["agrees"] is True and scores["recorded"]["test_ppl"] == row["test_ppl"]
    table = runner.invoke(app, ["evaluate", str(ckpt), *HELD_OUT])
    assert table.exit_code == 0, table.output
    assert "the same as the run recorded at round 2" in table.output


def test_other_held_out_text_is_scored_and_said_to_differ(run_dir):
    """All of the demo's test sentences, not the run's first 60: other numbers, and the line
    says which flags make a run's held-out text."""
    ckpt = run_dir / "checkpoints" / "round_0002.safetensors"
    result = runner.invoke(app, ["evaluate", str(ckpt), "--data", "demo", "--ksr-sentences", "5"])
    assert result.exit_code == 0, result.output
    assert "not what the run recorded at round 2: score the run's own held-out text" in (
        " ".join(result.output.split())
    )


def test_a_file_that_is_no_checkpoint_and_a_corpus_that_is_not_there_are_one_line(
    run_dir, tmp_path
):
    bogus = tmp_path / "model.safetensors"
    bogus.write_text("not a checkpoint")
    result = runner.invoke(app, ["evaluate", str(bogus), "--data", "demo"])
    assert result.exit_code == 1 and f"error: {bogus} is not a .safetensors checkpoint" in (
        result.output
    )
    ckpt = run_dir / "checkpoints" / "round_0002.safetensors"
    result = runner.invoke(app, ["evaluate", str(ckpt), "--data", str(tmp_path / "nowhere")])
    assert result.exit_code == 1 and "error: corpus" in result.output
    assert "Traceback" not in result.output
