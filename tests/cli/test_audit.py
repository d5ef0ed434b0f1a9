"""`fedkey simulate --canary` and `fedkey audit canary`: the planted secret's exposure is in every
metrics row, the audit's arms are the runs the report describes, and a canary the vocabulary
cannot hold is refused in one line."""

import json
import math

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.cli.options import canary_probes
from fedkey.models.canary import CanaryFormat
from fedkey.server.settings import Settings

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


def test_the_audit_takes_a_mechanism_a_bound_a_format_and_simulate_options(tmp_path):
    result = runner.invoke(
        app,
        ["audit", "canary", "--dry-run", "--dp-mechanism", "blt", "--dp-noise-multiplier",
         "0.7613421253862405", "--bound-norm", "5.5", "--canary-format", "my secret is _ _",
         "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs"),
         "--", "--vocab-size", "500", "--lr", "3"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    commands = result.stdout.strip().splitlines()
    assert len(commands) == 6
    env = "env 'FEDKEY_CANARY_FORMAT=my secret is _ _' fedkey simulate "
    assert all(c.startswith(env) and "--vocab-size 500 --lr 3 " in c for c in commands)
    plain = [c for c in commands if "--dp-clip" not in c]
    assert len(plain) == 2 and all("--bound fixed --bound-norm 5.5 " in c for c in plain)
    dp = [c for c in commands if "--dp-clip" in c]
    # the noise multiplier as given, every digit (a calibrated z), under the mechanism asked
    assert all("--dp-noise-multiplier 0.7613421253862405 --dp-mechanism blt " in c for c in dp)


def test_the_audit_runs_a_dp_ftrl_arm_whose_planted_phone_trains_once(tmp_path):
    """20 phones, cohorts of 10, 2 rounds under blt: the minimum separation b = 2 lets every
    phone train exactly once, the one holding the secret (the largest owner's) included; the
    format of 100 candidates reaches the child."""
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["audit", "canary", "--rounds", "2", "--local-epochs", "1", "--repeats", "5",
         "--dp-mechanism", "blt", "--dp-noise-multiplier", "0.5", "--only", "fedavg-blt-z0.5",
         "--canary-format", "my secret is _ _", "--workers", "0", "--out", str(out),
         "--runs-dir", str(tmp_path / "runs"), "--", "--max-train-tokens", "3000",
         "--max-eval-sentences", "20"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert (run["mechanism"], run["noise_multiplier"], run["canary_phone"]) == (
        "blt",
        0.5,
        "device-00",
    )
    rows = [json.loads(x) for x in (tmp_path / "runs" / run["id"] / "metrics.jsonl").open()]
    trained = [r["round"] for r in rows if "device-00" in r["aggregated"]]
    assert len(trained) == 1 and run["canary_rounds"] == trained
    assert rows[-1]["info"]["dp"]["min_separation"] == 2
    # |R| = 100: exposure log2(100) - log2(rank) lies in [0, log2(100)]; the noise is secret (drawn
    # from the operating system), so the canary may rank last (exposure 0) by chance.
    assert all(0 <= p["exposure"] <= math.log2(100) for p in run["curve"])
    md = (out / "results.md").read_text()
    assert f"| {trained[0]} |" in md.split("rounds with device-00")[1].split("\n")[2]
