"""`fedkey simulate --dp-mechanism tree` (DP-FTRL): every row reports a finite epsilon and rho and
the participation rule; what it cannot run is refused in one line."""

import json
import math

import pytest
from typer.testing import CliRunner

from cli import app
from server.dp_ftrl import tree_rho

runner = CliRunner(env={"FEDKEY_HIDDEN_SIZE": "16"})  # a tiny model (no flag: a Settings field)
TINY = [
    "--data", "demo", "--clients", "8", "--fraction", "0.25", "--rounds", "3",
    "--local-epochs", "1", "--max-train-tokens", "3000", "--max-eval-sentences", "40",
    "--vocab-size", "300", "--ksr-sentences", "0", "--workers", "0",
    "--dp-clip", "1", "--dp-noise-multiplier", "1", "--dp-mechanism", "tree",
]  # fmt: skip


@pytest.mark.parametrize("strategy", ["fedavg", "fedatt"])
def test_a_tree_run_reports_epsilon_rho_and_the_rule_every_round(tmp_path, strategy):
    out = tmp_path / "run"
    result = runner.invoke(app, ["simulate", *TINY, "--strategy", strategy, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (rows[0]["epsilon"], rows[0]["rho"]) == (0.0, 0.0)
    last: dict[str, int] = {}
    for row in rows:
        dp = row["info"]["dp"]
        assert dp["mechanism"] == "tree" and dp["min_separation"] == 4  # 8 phones, cohorts of 2
        assert math.isfinite(row["epsilon"]) and math.isfinite(row["rho"])
        assert row["rho"] == tree_rho(row["round"], 1.0, 4)
        for phone in row["selected"]:
            assert row["round"] - last.get(phone, -10) >= 4
            last[phone] = row["round"]
    assert rows[1]["epsilon"] > 0 and rows[2]["rho"] > rows[1]["rho"]
    assert rows[1]["info"]["dp"]["sensitivity"] > 0


def test_a_separation_the_population_cannot_fill_is_one_line(tmp_path):
    args = ["simulate", *TINY, "--dp-min-separation", "5", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "--dp-min-separation 5: 8 phones" in result.output
    assert "Traceback" not in result.output
