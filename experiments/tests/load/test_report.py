"""fedkey_bench.load.report: the load bench's page leads with the answer and stays short on the
committed results (every cell of experiments/results/load), the rounds and the errors going to
CSV files beside it."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

from fedkey_bench.load.report import headline, rebuild

RESULTS = Path(__file__).resolve().parents[2] / "results" / "load"
MAX_PAGE = 30 * 1024


def test_the_committed_cells_rebuild_a_short_page_that_leads_with_the_answer(tmp_path):
    shutil.copy(RESULTS / "results.json", tmp_path / "results.json")
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(runs) > 50  # the big fixture: every cell the bench has run
    md = rebuild(tmp_path).read_text()
    assert len(md.encode()) <= MAX_PAGE
    head = md.split("\n## Every cell\n")[0]
    assert head.startswith("# fedkey-bench load") and "How many phones" in head
    assert "## The answer" in head and "| phones | database |" in head
    for r in headline(runs):  # the answer: the newest cell of each fleet, database, share
        assert f"| {r['id']} |" in head
    for r in runs:  # every cell is a row of the page
        assert f"| {r['label']}" in md and r["git_commit"][:10] in md
    assert "[`rounds.csv`](rounds.csv)" in md and "[`errors.csv`](errors.csv)" in md

    with (tmp_path / "rounds.csv").open() as f:
        rounds = list(csv.DictReader(f))
    assert len(rounds) == sum(len(r["per_round"]) for r in runs)
    assert {row["id"] for row in rounds} == {r["id"] for r in runs}
    with (tmp_path / "errors.csv").open() as f:
        errors = list(csv.DictReader(f))
    for r in runs:
        mine = {(e["what"], e["name"]): int(e["count"]) for e in errors
                if e["id"] == r["id"] and e["what"] in ("error", "status")}  # fmt: skip
        assert mine == {**{("error", k): v for k, v in r["errors"].items()},
                        **{("status", k): v for k, v in r["statuses"].items()}}  # fmt: skip


def test_the_headline_is_the_newest_cell_of_each_fleet_database_and_share():
    def cell(i: str, phones: int, database: str = "sqlite", fraction: float = 0.1) -> dict:
        return {"id": i, "phones": phones, "database": database, "fraction": fraction}

    runs = [cell("old", 100), cell("pg", 100, "postgresql"), cell("new", 100),
            cell("small", 100, fraction=0.01), cell("big", 1000)]  # fmt: skip
    assert [r["id"] for r in headline(runs)] == ["big", "pg", "new", "small"]
