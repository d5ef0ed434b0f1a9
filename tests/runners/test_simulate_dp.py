"""`fedkey simulate` under DP with every strategy that has a sensitivity analysis: every metrics row
reports a finite epsilon, and what cannot be covered is refused with its reason."""

import json
import math

import pytest
from typer.testing import CliRunner

from fedkey.cli import app

runner = CliRunner(env={"FEDKEY_HIDDEN_SIZE": "16"})  # a tiny model (no flag: a Settings field)
TINY = [
    "--data", "demo", "--clients", "8", "--fraction", "0.5", "--rounds", "2",
    "--local-epochs", "1", "--max-train-tokens", "3000", "--max-eval-sentences", "40",
    "--vocab-size", "300", "--ksr-sentences", "0", "--workers", "0",
    "--dp-clip", "1", "--dp-noise-multiplier", "1",
]  # fmt: skip


@pytest.mark.parametrize(
    "strategy", [["fedavg"], ["fedatt"], ["fedattopt"], ["fedmed", "--epsilon-med", "0"]]
)
def test_dp_run_reports_finite_epsilon_every_round(tmp_path, strategy):
    out = tmp_path / "run"
    result = runner.invoke(app, ["simulate", *TINY, "--strategy", *strategy, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["epsilon"] == 0.0
    eps = [r["epsilon"] for r in rows[1:]]
    assert all(math.isfinite(e) and e > 0 for e in eps) and eps[1] > eps[0]
    for row in rows[1:]:
        dp, clip = row["info"]["dp"], row["info"]["clip"]
        assert clip["mode"] == "dp" and clip["norm"] == 1.0
        assert (
            dp["noise_std"] == pytest.approx(dp["sensitivity"] * (1 + 1e-4))
            and dp["sensitivity"] > 0
        )


def test_dp_refuses_what_it_cannot_cover_with_the_reason(tmp_path):
    args = ["simulate", *TINY, "--strategy", "fedmed", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "--epsilon-med 0" in result.output and "Traceback" not in result.output


def test_poisson_cohorts_use_the_fixed_denominator_and_its_noise(tmp_path):
    """--dp-sampling poisson: each phone with probability C, McMahan et al.'s sum / (q N), and
    noise z S / (q N) (add/remove-one): 8 phones at C = 0.5 expect 4."""
    out = tmp_path / "run"
    args = ["simulate", *TINY, "--strategy", "fedavg", "--dp-sampling", "poisson"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        dp = row["info"]["dp"]
        assert dp["sampling"] == "poisson" and dp["sensitivity"] == pytest.approx(1.0 / 4)
        assert math.isfinite(row["epsilon"]) and row["epsilon"] > 0
    assert rows[2]["epsilon"] > rows[1]["epsilon"]
