"""fedkey_bench.canary.report: the canary audit's results page (experiments/results/canary) rebuilt from its
results.json by the product's report (fedkey.runners.canary_audit), which reads the recorded file."""

import shutil
from pathlib import Path

from fedkey_bench.canary.report import rebuild

RESULTS = Path(__file__).resolve().parents[2] / "results" / "canary"


def test_the_recorded_audit_rebuilds_its_page(tmp_path):
    shutil.copy(RESULTS / "results.json", tmp_path / "results.json")
    md = rebuild(tmp_path).read_text()
    assert md.startswith("# Canary audit: memorization of one phone's secret")
    assert "| FedAvg |" in md and "| DP-FedAtt z 1, not planted |" in md
    assert (tmp_path / "exposure.png").stat().st_size > 10_000


def test_the_recorded_irc_audit_rebuilds_its_page(tmp_path):
    """experiments/results/canary-irc: each planted arm beside its not-planted control, the
    workload's notes, the rounds the planted phone's update was aggregated (or rejected)."""
    from fedkey_bench.canary.irc import rebuild as rebuild_irc

    folder = RESULTS.parent / "canary-irc"
    shutil.copy(folder / "results.json", tmp_path / "results.json")
    md = rebuild_irc(tmp_path).read_text()
    assert md.startswith("# Canary exposure on the IRC population at the privacy table's epsilons")
    assert "my password is _ _ _ _" in md and "fedkey_bench.privacy.runner.calibrate_cell" in md
    assert "| FedAvg | no DP (same clip) |" in md
    assert "none (rejected by the outlier filter: 1)" in md  # the no-DP arm's filter
    assert "| DP-FedAvg eps 8 (z 0.589) | gaussian | 8 | 8.00 | 0.589 |" in md
    assert (tmp_path / "exposure.png").stat().st_size > 10_000
