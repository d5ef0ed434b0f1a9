"""`fedkey-bench cohorts` (fedkey_bench.cohorts.runner) on a tiny workload (the demo corpus, one phone per
owner, an 8-unit model): every row trains the whole cohort in a child process of its own,
results.json and results.md hold one row per (model, cohort, backend), a row measured again
replaces its old one, and a row that fails is kept with its error."""

from __future__ import annotations

import json

import pytest

from fedkey_bench.cohorts import runner as cohorts
from fedkey_bench.cohorts.runner import Workload, run_cohorts


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(cohorts.MODELS, "h8", 8)
    return Workload(name="demo-user", data="demo", vocab_size=200)


def test_each_row_trains_its_whole_cohort_and_is_written(tiny, tmp_path):
    rows = run_cohorts(tiny, [6], ["local", "stacked"], ["h8"], tmp_path, "fedkey-bench cohorts")
    assert [(r["backend"], r["phones"]) for r in rows] == [("local", 6), ("stacked", 6)]
    for r in rows:
        assert "error" not in r, r
        assert r["phones_trained"] == 6 and r["population"] > 6
        assert r["updates_per_s"] == pytest.approx(6 / r["seconds"], rel=0.05)
        assert r["peak_rss_mib"] >= r["rss_after_load_mib"] > 0
    assert rows[0]["batches"] == rows[1]["batches"]  # the same cohort on both backends
    assert rows[1]["stack_phones"] == 6  # a tiny model: the whole cohort in one stack
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["backend"] for r in saved] == ["local", "stacked"]
    table = (tmp_path / "results.md").read_text()
    assert table.count("| demo-user | h8 (h8) | 6 |") == 2
    assert "    fedkey-bench cohorts" in table
    run_cohorts(tiny, [6], ["stacked"], ["h8"], tmp_path, "again")  # replaces its old row
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["backend"], r["command"]) for r in saved] == [("local", "fedkey-bench cohorts"),
                                                             ("stacked", "again")]  # fmt: skip


def test_a_failing_row_is_recorded_with_its_error(tiny, tmp_path):
    broken = Workload(name="nowhere", data=str(tmp_path / "no-such-corpus"), vocab_size=200)
    [row] = run_cohorts(broken, [3], ["local"], ["h8"], tmp_path, "fedkey-bench cohorts")
    assert row["error"]
    assert "error:" in (tmp_path / "results.md").read_text()
