"""`fedkey simulate --dp-clip-quantile` (adaptive clipping) under both mechanisms: every row
records its clip, the noised unclipped fraction, rho and the default delta 1/N^1.1; what cannot
run is refused in one line."""

import json

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.federation.privacy.adaptive_clip import update_noise_multiplier
from fedkey.federation.privacy.tree import count_rho, tree_rho

runner = CliRunner(env={"FEDKEY_HIDDEN_SIZE": "16"})  # a tiny model (no flag: a Settings field)
TINY = [
    "--data", "demo", "--clients", "8", "--fraction", "0.25", "--rounds", "3",
    "--local-epochs", "1", "--max-train-tokens", "3000", "--max-eval-sentences", "40",
    "--vocab-size", "300", "--ksr-sentences", "0", "--workers", "0",
    "--dp-clip", "1", "--dp-noise-multiplier", "1", "--dp-clip-quantile", "0.5",
]  # fmt: skip


@pytest.mark.parametrize("mechanism", ["gaussian", "tree"])
def test_every_row_records_the_clip_rho_and_delta(tmp_path, mechanism):
    out = tmp_path / "run"
    args = ["simulate", *TINY, "--dp-mechanism", mechanism, "--dp-clip-count-stddev", "2"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    z_u = update_noise_multiplier(1.0, 2.0, 1.0)
    assert rows[0]["info"]["dp"]["clip"] == 1.0
    for t, row in enumerate(rows[1:], start=1):
        dp = row["info"]["dp"]
        assert row["delta"] == pytest.approx(8**-1.1) and dp["mechanism"] == mechanism
        assert dp["clip"] == rows[t - 1]["info"]["dp"].get("next_clip", 1.0)
        assert row["info"]["clip"]["norm"] == pytest.approx(dp["clip"])
        assert dp["count_stddev"] == 2.0 and dp["update_noise_multiplier"] == pytest.approx(z_u)
        if mechanism == "tree":
            b = dp["min_separation"]
            assert row["rho"] == pytest.approx(tree_rho(t, z_u, b) + count_rho(t, 2.0, b))
        else:
            assert row["rho"] == pytest.approx(t / 2)  # the gaussian's at z = 1: unchanged
    assert rows[2]["info"]["dp"]["clip"] != 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            [],
            "the default --dp-clip-count-stddev (the expected cohort 2 / 20 = 0.1) is too small",
        ),  # the default: 2 a round / 20, too small for z = 1
        (["--dp-clip-quantile", "1.5"], "--dp-clip-quantile 1.5: input should be less than 1"),
        (["--dp-clip-lr", "0"], "--dp-clip-lr 0.0: input should be greater than 0"),
    ],
)
def test_what_cannot_run_is_one_line(tmp_path, extra, message):
    result = runner.invoke(app, ["simulate", *TINY, *extra, "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output


def test_count_noise_without_a_quantile_is_refused(tmp_path):
    args = [a for a in TINY if a not in ("--dp-clip-quantile", "0.5")]
    result = runner.invoke(
        app, ["simulate", *args, "--dp-clip-count-stddev", "2", "--out", str(tmp_path)]
    )
    assert result.exit_code != 0
    assert "add --dp-clip-quantile q" in result.output and "Traceback" not in result.output
