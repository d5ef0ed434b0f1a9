"""`fedkey simulate --dp-mechanism tree|blt` (DP-FTRL): every row reports a finite epsilon and rho
and the participation rule; what it cannot run is refused in one line."""

import json
import math

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.federation.privacy.blt import blt_rho, load_table, select_blt
from fedkey.federation.privacy.tree import tree_rho

runner = CliRunner(env={"FEDKEY_HIDDEN_SIZE": "16"})  # a tiny model (no flag: a Settings field)
TINY = [
    "--data", "demo", "--clients", "8", "--fraction", "0.25", "--rounds", "3",
    "--local-epochs", "1", "--max-train-tokens", "3000", "--max-eval-sentences", "40",
    "--vocab-size", "300", "--ksr-sentences", "0", "--workers", "0",
    "--dp-clip", "1", "--dp-noise-multiplier", "1",
]  # fmt: skip
#: rho after round t of each mechanism at z = 1, b = 4 (8 phones, cohorts of 2), 3 rounds
RHO = {
    "tree": lambda t: tree_rho(t, 1.0, 4),
    "blt": lambda t: blt_rho(t, 1.0, 4, select_blt(3, 4)),
}


def _tiny(mechanism: str) -> list[str]:
    return [*TINY, "--dp-mechanism", mechanism]


@pytest.mark.parametrize("mechanism", sorted(RHO))
@pytest.mark.parametrize("strategy", ["fedavg", "fedatt"])
def test_a_run_reports_epsilon_rho_and_the_rule_every_round(tmp_path, strategy, mechanism):
    out = tmp_path / "run"
    args = ["simulate", *_tiny(mechanism), "--strategy", strategy, "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (rows[0]["epsilon"], rows[0]["rho"]) == (0.0, 0.0)
    last: dict[str, int] = {}
    for row in rows:
        dp = row["info"]["dp"]
        assert dp["mechanism"] == mechanism and dp["min_separation"] == 4
        assert math.isfinite(row["epsilon"]) and math.isfinite(row["rho"])
        assert row["rho"] == RHO[mechanism](row["round"])
        for phone in row["selected"]:
            assert row["round"] - last.get(phone, -10) >= 4
            last[phone] = row["round"]
    assert rows[1]["epsilon"] > 0 and rows[2]["rho"] > rows[1]["rho"]
    assert rows[1]["info"]["dp"]["sensitivity"] > 0


@pytest.mark.parametrize("mechanism", sorted(RHO))
def test_a_separation_the_population_cannot_fill_is_one_line(tmp_path, mechanism):
    args = ["simulate", *_tiny(mechanism), "--dp-min-separation", "5", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "--dp-min-separation 5: 8 phones" in result.output
    assert "Traceback" not in result.output


def test_a_blt_run_longer_than_the_shipped_table_is_one_line(tmp_path):
    rounds = str(max(e.rounds for e in load_table()) + 1)
    args = ["simulate", *_tiny("blt"), "--rounds", rounds, "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert f"tools/blt_params.py --rounds {rounds}" in result.output
    assert "Traceback" not in result.output
