"""`fedkey-bench cohorts` (fedkey_bench.cohorts.runner) on a tiny workload (the demo corpus, one phone per
owner, an 8-unit model): every row trains the whole cohort in a child process of its own,
results.json and results.md hold one row per (model, cohort, backend, processes), a row measured
again replaces its old one, a row that fails is kept with its error; a cohort split between two
processes trains every phone once, in parts balanced by words."""

from __future__ import annotations

import json

import pytest

from fedkey_bench.cohorts import runner as cohorts
from fedkey_bench.cohorts.report import markdown
from fedkey_bench.cohorts.runner import Workload, merge, run_cohorts, split_by_words, upgrade


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
        assert r["phone_updates_per_s"] == pytest.approx(6 / r["seconds"], rel=0.05)
        assert r["peak_rss_mib"] >= r["rss_after_load_mib"] > 0
        assert r["processes"] == 1 and r["precision"] in ("fp32", "bf16")
        assert [n for n, _ in r["rss_mib_by_phones"]] == [6]  # fewer than RSS_EVERY: the end
        assert "started" not in r
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


def test_a_cohort_split_between_two_processes_trains_every_phone_once(tiny, tmp_path):
    [one] = run_cohorts(tiny, [6], ["stacked"], ["h8"], tmp_path, "c")
    [two] = run_cohorts(tiny, [6], ["stacked"], ["h8"], tmp_path, "c", processes=[2])
    assert "error" not in two, two
    assert two["processes"] == 2 and len(two["parts"]) == 2
    assert two["phones_trained"] == 6 == sum(p["phones_trained"] for p in two["parts"])
    assert (two["words"], two["batches"]) == (one["words"], one["batches"])
    assert two["peak_rss_mib"] == sum(p["peak_rss_mib"] for p in two["parts"])
    assert two["cpu_seconds"] == pytest.approx(sum(p["cpu_seconds"] for p in two["parts"]))
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["processes"] for r in saved] == [1, 2]  # its own row beside the single process's
    assert "| stacked x2 processes |" in (tmp_path / "results.md").read_text()


def test_split_by_words_balances_and_keeps_every_phone_once():
    words = [100, 1, 1, 50, 49, 3, 2]
    parts = split_by_words(words, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(words)))
    assert [sum(words[i] for i in p) for p in parts] == [103, 103]
    assert all(p == sorted(p) for p in parts)
    assert split_by_words([5], 2) == [[0], []]


def test_merge_sums_the_parts_over_one_wall_clock():
    part = {"workload": "w", "model": "h8", "hidden_size": 8, "backend": "stacked",
            "stack_phones": 3, "precision": "fp32", "population": 9, "phones": 6,
            "batches": 4, "cpu_seconds": 2.0, "rss_after_load_mib": 100,
            "rss_mib_by_phones": [[3, 150]]}  # fmt: skip
    got = merge([{**part, "phones_trained": 3, "words": 30, "peak_rss_mib": 200,
                  "seconds": 2.0, "started": 10.0, "ended": 12.0},
                 {**part, "phones_trained": 3, "words": 31, "peak_rss_mib": 210,
                  "seconds": 2.5, "started": 10.5, "ended": 13.0}])  # fmt: skip
    assert got["seconds"] == 3.0 and got["phone_updates_per_s"] == 2.0
    assert got["cpu_seconds"] == 4.0 and got["phone_updates_per_cpu_s"] == 1.5
    assert (got["peak_rss_mib"], got["words"], got["batches"]) == (410, 61, 8)


def test_rows_written_before_keep_their_figures_under_the_new_names():
    old = {"workload": "w", "model": "h8", "hidden_size": 8, "phones": 6, "backend": "local",
           "stack_phones": None, "updates_per_s": 3.0, "updates_per_cpu_s": 4.0,
           "seconds": 2.0, "cpu_seconds": 1.5, "batches": 4, "peak_rss_mib": 500,
           "rss_after_load_mib": 300, "command": "c", "load_at_start": 0.1, "date": "d"}  # fmt: skip
    new = upgrade(old)
    assert (new["phone_updates_per_s"], new["phone_updates_per_cpu_s"]) == (3.0, 4.0)
    assert new["processes"] == 1 and "updates_per_s" not in new
    page = markdown([old], ["A note."])
    assert "| w | h8 (h8) | 6 | local |  |  | 3.0 | 4.0 |" in page
    assert "\n\nA note.\n\n" in page
