"""fedkey_bench.peers.report: the lead table, the per-workload tables, the agreement check, and
a page without this machine's paths."""

from dataclasses import asdict

import pytest

from fedkey_bench.peers.report import (
    agreement,
    final_swing,
    lead_table,
    page,
    speed_ratio,
    table,
)
from fedkey_bench.peers.runner import combine, error_row
from tests.peers.helpers import W, row


def _meta(name: str, **more: object) -> dict:
    return {**asdict(W), "name": name, "vocab_size": 10_000, "train_sentences": 4500,
            "train_words": 99_443, "bench_command": "fedkey-bench peers --preset ptb",
            "repeats": 3, "device": "cpu: test", "fedkey_tree": ".", "git_commit": "abc",
            "date": "2026-01-01", "cohort_seed": 0, "cohort_size": 10, **more}  # fmt: skip


def _rows(workload: str, fedkey: list[list[float]], pfl: list[list[float]],
          flower: list[list[float]] | None = None) -> list[dict]:  # fmt: skip
    out = []
    for name, series in (("fedkey", fedkey), ("pfl", pfl), ("flower", flower)):
        if series is None:
            out.append({**error_row(name, W, "cpu", "c", "pip install failed"),
                        "workload": workload})  # fmt: skip
            continue
        repeats = [row(name, ends, 1000.0, cpu=2 * (ends[-1] - ends[1]) / 2) for ends in series]
        out.append({**combine(repeats), "workload": workload})
    return out


def test_the_lead_table_gives_each_workload_medians_spreads_cpu_and_the_ratio_to_pfl():
    data = {
        "workloads": {"ptb": _meta("ptb"), "irc": _meta("irc")},
        "rows": _rows("ptb", [[0, 10, 14, 18], [0, 10, 15, 20], [0, 10, 14.5, 19]],
                      [[0, 5, 8, 11], [0, 5, 8.5, 12], [0, 5, 8, 11]],
                      [[0, 30, 36, 42]] * 3)
        + _rows("irc", [[0, 10, 12, 14]] * 3, [[0, 5, 9, 13]] * 3, None),
    }  # fmt: skip
    lines = lead_table(data).splitlines()
    assert lines[0] == ("| workload | repeats | s/round: fedkey | pfl | flower "
                        "| CPU s/round: fedkey | pfl | flower | fedkey's speed / pfl's |")  # fmt: skip
    # the latest workload first; fedkey 2 s/round, pfl 4: fedkey twice as fast
    assert lines[2] == "| irc | 3 | 2.00 | 4.00 | failed | 4.00 | 8.00 | failed | 2.00x |"
    # fedkey's median 4.5 (4.0-5.0), pfl 3.0 (3.0-3.5): fedkey slower, 0.67x
    assert lines[3] == ("| ptb | 3 | 4.50 (4.00-5.00) | 3.00 (3.00-3.50) | 6.00 | 9.00 (8.00-10.00) "
                        "| 6.00 (6.00-7.00) | 12.00 | 0.67x |")  # fmt: skip
    md = page(data)
    assert md.index(lines[0]) < md.index("## irc") < md.index("## ptb") < md.index("## How")
    assert md.splitlines()[2] == lines[0]  # the page leads with it, after its title
    assert "[results.json](results.json)" in md


def test_the_ratio_says_tie_and_void():
    a = {"seconds_per_round": 4.0, "seconds_per_round_spread": [3.5, 4.5], "final_test_ppl": 1000}
    b = {"seconds_per_round": 4.2, "seconds_per_round_spread": [4.1, 5.0], "final_test_ppl": 1010}
    assert speed_ratio(a, b) == "1.05x (tie: the spreads overlap)"
    c = {"seconds_per_round": 8.0, "seconds_per_round_spread": [8.0, 8.0], "final_test_ppl": 1100}
    assert speed_ratio(a, c) == "2.00x (void: perplexity disagrees)"
    assert speed_ratio(a, None) == "-" and speed_ratio(None, b) == "-"


def test_a_perplexity_past_the_tolerance_voids_the_row():
    rows = [row("fedkey", [0, 10, 14, 18], 1000.0), row("flower", [0, 30, 36, 42], 1040.0),
            row("pfl", [0, 5, 8, 11], 1100.0), error_row("x", W, "cpu", "c", "no pip")]  # fmt: skip
    assert agreement(rows) == {"fedkey": "reference", "flower": "agrees", "pfl": "void",
                               "x": "no result"}  # fmt: skip
    assert agreement(rows, tolerance=0.2)["pfl"] == "agrees"


def test_the_workload_table_leads_with_fedkey_and_gives_the_ratios():
    rows = [combine([row("pfl", [0, 5, 8, 11], 1100.0, cpu=5.0)] * 2),
            combine([row("fedkey", [0, 10, 14, 18], 1000.0, cpu=7.25)]),
            error_row("flower", W, "cpu", "c", "pip install failed")]  # fmt: skip
    lines = table(rows).splitlines()
    assert lines[0].startswith(
        "| framework | version | precision | s/round (spread) | CPU s/round |"
    )
    assert lines[2] == "| fedkey | 1.0 | fp32 | 4.00 | 7.25 | 1.00x | 1000.00 | 1024 MB |"
    assert "| flower | - | fp32 | not run: pip install failed |" in lines[3]
    assert lines[4] == ("| pfl | 1.0 | fp32 | 3.00 | 5.00 | 0.75x (void: perplexity disagrees) "
                        "| 1100.00 (+10.0%) | 1024 MB |")  # fmt: skip


def test_the_page_shows_no_machine_paths_and_says_which_rows_are_void():
    meta = _meta(W.name, data="/work/shared/data/ptb", fedkey_tree="/work/wt-peers",
                 bench_command="fedkey-bench peers --work /work/tmp/peers --out /work/x/results")  # fmt: skip
    rows = [combine([row("fedkey", [0, 10, 14, 18], 1000.0)]),
            combine([{**row("pfl", [0, 5, 8, 11], 1100.0),
                      "command": ".venv-peers/pfl/bin/torchrun /work/main/runs/x.npz"}])]  # fmt: skip
    md = page({"workloads": {W.name: meta}, "rows": rows})
    assert "/work/" not in md, md
    assert md.index("| fedkey | 1.0 | fp32 | 4.00 |") < md.index("**Void:** pfl")
    assert md.index("**Void:** pfl") < md.index("## How it was run")
    assert "on cpu: test" in md and "same 10 phones each round" in md


def test_a_page_of_rows_recorded_before_the_repeats_still_builds():
    old = {**row("fedkey", [0, 10, 14, 18], 1000.0), "seconds_per_round_all": [4.0]}
    del old["cpu_seconds_per_round"], old["precision"]
    meta = _meta(W.name)
    del meta["cohort_seed"]
    md = page({"workloads": {W.name: meta}, "rows": [old]})
    assert f"| {W.name} | 3 | 4.00 | - | - | - | - | - | - |" in md
    assert "Each framework drew its own cohorts" in md


def test_a_curve_still_swinging_at_its_end_is_flagged():
    lr1 = [9957.1, 8023.8, 2939.8, 2080.6, 1508.2, 1351.9, 1516.4, 1164.3, 1555.0, 1075.5, 1003.1]
    assert final_swing(lr1) == pytest.approx(1555.0 / 1164.3 - 1)
    assert final_swing([9957.1, 9090.3, 4997.7, 1938.6, 1511.3, 1289.1, 1218.5]) == 0.0
    assert final_swing([9957.0]) == 0.0
