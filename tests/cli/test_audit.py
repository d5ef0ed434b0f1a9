"""`fedkey simulate --canary` and `fedkey audit canary`: the planted secret's exposure is in every
metrics row, the audit's arms are the runs the report describes, and a canary the vocabulary
cannot hold is refused in one line."""

import json
import math

import pytest
from typer.testing import CliRunner

from cli import app
from cli.options import canary_probes
from models.canary import CanaryFormat
from server.settings import Settings

runner = CliRunner()
TINY = ["--data", "demo", "--clients", "3", "--max-train-tokens", "1500",
        "--max-eval-sentences", "20", "--ksr-sentences", "0", "--local-epochs", "1",
        "--workers", "0"]  # fmt: skip


def test_the_audit_runs_fedavg_and_fedatt_without_and_with_dp(tmp_path):
    result = runner.invoke(
        app,
        ["audit", "canary", "--dry-run", "--repeats", "30", "--dp-clip", "0.7",
         "--dp-noise-multiplier", "1", "--dp-noise-multiplier", "0.2",
         "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    commands = result.stdout.strip().splitlines()
    assert len(commands) == 10
    assert all(c.startswith("fedkey simulate ") and "--canary" in c for c in commands)
    plain = [c for c in commands if "--dp-clip" not in c]
    assert all("--bound off" in c for c in plain)  # no bound on any update: the undefended arm
    for z in ("1", "0.2"):
        dp = [c for c in commands if f"--dp-clip 0.7 --dp-noise-multiplier {z} " in c]
        planted = [c for c in dp if "--canary-repeats 30" in c]
        controls = [c for c in dp if "--canary-repeats 0" in c]  # the same runs, nothing planted
        for arm in (plain, planted, controls):
            assert {c.split("--strategy ")[1].split()[0] for c in arm} == {"fedavg", "fedatt"}
            assert len(arm) == 2
    assert not (tmp_path / "runs").exists()  # a dry run runs nothing


def test_simulate_with_a_canary_reports_its_exposure_every_round(tmp_path):
    out = tmp_path / "run"
    args = ["simulate", *TINY, "--rounds", "1", "--canary", "--canary-repeats", "5"]
    env = {"COLUMNS": "200", "FEDKEY_CANARY_FORMAT": "my secret is _ _"}  # 100 candidates
    result = runner.invoke(app, [*args, "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 < r["canary_exposure"] <= math.log2(100)
        assert 1 <= r["canary_rank"] <= 100
    assert "exposure" in result.stdout  # the table's column


def test_the_probe_and_the_planted_secret_come_with_canary_only():
    assert canary_probes(Settings()) == [] and Settings().data_config().canary is None
    settings = Settings(canary=True, seed=7)
    (probe,) = canary_probes(settings)
    assert probe.secret == settings.data_config().canary == CanaryFormat().draw(seed=7)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"FEDKEY_CANARY_FORMAT": "my pin is _ _"}, "outside the model's vocabulary (pin)"),
        ({"FEDKEY_CANARY_ALPHABET": "one two zero"}, "outside the model's vocabulary (zero)"),
        ({"FEDKEY_CANARY_FORMAT": "my secret"}, "has no slot"),
    ],
)
def test_a_canary_that_cannot_work_is_one_error_line(tmp_path, env, message):
    args = ["simulate", *TINY, "--rounds", "1", "--canary", "--out", str(tmp_path)]
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
