"""fedkey_bench.aggregation.runner on a tiny model: the uploads it writes are what the server's round bounds
(the cosine filter rejects the planted phones), and a run gives every row, its ratio to the read,
a page, and removes its uploads."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from fedkey_bench.aggregation.runner import WHAT, run_aggregation, write_cohort


def test_the_written_round_is_one_the_server_bounds_and_filters(tmp_path):
    from safetensors.torch import load_file

    from fedkey.federation.config import InfluenceConfig
    from fedkey.federation.influence.bounding import bound_round
    from fedkey.federation.strategies import ClientUpdate
    from fedkey.federation.updates.store import StoredState

    c = write_cohort(tmp_path, 60, vocab_size=50, hidden_size=8)
    glob = load_file(c.global_path)
    ups = [
        ClientUpdate(StoredState(p), n, 1.0, f"d{i:02d}")
        for i, (p, n) in enumerate(zip(c.paths, c.samples, strict=True))
    ]
    rnd = bound_round(InfluenceConfig(), glob, ups)
    assert len(rnd.info["outliers"]) == 1  # 2% of 60, rounded
    assert rnd.info["trimmed"] == 6 and rnd.info["clipped"] > 0
    assert c.parameters == sum(v.numel() for v in glob.values() if torch.is_floating_point(v))


def _ratio_bounds(a: float, b: float, half: float = 5e-5) -> tuple[float, float]:
    """The range of x / y for the x, y that round (to 4 decimals) to a and b."""
    return (a - half) / (b + half), (a + half) / max(b - half, 1e-12)


def test_a_run_measures_every_row_against_the_read_and_cleans_up(tmp_path):
    out = tmp_path / "out"
    record = run_aggregation(6, 1, tmp_path / "work", out, vocab_size=50, hidden_size=8, echo=str)
    rows = {(r["server"], r["what"]): r for r in record["rows"]}
    assert set(rows) == {("this checkout", w) for w in WHAT}
    read = rows[("this checkout", "read")]
    for r in rows.values():
        assert r["seconds"] > 0 and r["cpu_seconds"] > 0 and r["peak_rss_mb"] > 0
        # the ratios of the unrounded times: within what rounding each to 4 decimals allows
        for ratio, key in (("per_read", "seconds"), ("cpu_per_read", "cpu_seconds")):
            low, high = _ratio_bounds(r[key], read[key])
            assert low - 0.005 <= r[ratio] <= high + 0.005, (ratio, r, read)
    assert json.loads((out / "results.json").read_text())["runs"] == [record]
    assert "| this checkout | fedatt |" in (out / "results.md").read_text()
    assert not list((tmp_path / "work").rglob("*.safetensors"))


def test_the_baseline_is_imported_from_its_own_checkout(tmp_path):
    """``--baseline``'s measurement imports the server's modules from the baseline's folder,
    although the bench's own imports loaded the ``fedkey`` package from this checkout."""
    tree = tmp_path / "baseline"
    package = tree / "fedkey" / "federation" / "influence"
    package.mkdir(parents=True)
    for folder in (tree / "fedkey", tree / "fedkey" / "federation", package):
        (folder / "__init__.py").write_text("")
    (package / "bounding.py").write_text("WHERE = 'baseline'\n")
    code = (
        "import sys, fedkey_bench.aggregation.runner as a\n"
        "assert 'fedkey' in sys.modules\n"
        f"a._import_from({str(tree)!r})\n"
        "import fedkey.federation.influence.bounding\n"
        "print(fedkey.federation.influence.bounding.WHERE)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "baseline"
