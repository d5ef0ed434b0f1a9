"""bench.canary: the canary audit's results page (experiments/results/canary) rebuilt from its
results.json by the product's report (runners.canary_audit), which reads the recorded file."""

import shutil
from pathlib import Path

from bench.canary import rebuild

RESULTS = Path(__file__).resolve().parents[1] / "results" / "canary"


def test_the_recorded_audit_rebuilds_its_page(tmp_path):
    shutil.copy(RESULTS / "results.json", tmp_path / "results.json")
    md = rebuild(tmp_path).read_text()
    assert md.startswith("# Canary audit: memorization of one phone's secret")
    assert "| FedAvg |" in md and "| DP-FedAtt z 1, not planted |" in md
    assert (tmp_path / "exposure.png").stat().st_size > 10_000
