"""FedAttOpt's reach per round against FedAvg's, and the updates' size it depends on
(fedkey_bench.paper.attopt_step): read from the metrics rows, summarized per run, reported beside the runs at
the same client lr."""

import pytest

from fedkey_bench.paper.attopt_step import step_scales, step_section, update_norms
from fedkey_bench.paper.runner import summarize
from fedkey_bench.paper.spec import RunSpec


def test_the_reach_is_read_from_the_info_or_computed_for_older_rows():
    older = {"mode": "fedattopt", "epsilon": 50.0, "distance": {"a": 10.0, "b": 5.0}}
    rows = [
        {"round": 0, "info": {}},
        {"round": 1, "info": {**older, "step_scale": 0.75, "capped_from": 3.0}},  # cut to 0.75
        {"round": 2, "info": older},  # written before the strategy recorded it: from d_k
        {"round": 3, "info": {"mode": "fedavg", "weights": {"a": 1.0}}},
    ]
    reach = pytest.approx(50 * (1 / 100 + 1 / 25))
    assert step_scales(rows) == [[1, 0.75, 3.0], [2, reach, reach]]


def test_update_norms_come_from_each_rounds_clip_info_and_reach_the_summary():
    info = {
        "mode": "fedattopt",
        "epsilon": 8.0,
        "distance": {"a": 2.0},
        "clip": {"median_norm": 2.0},
    }
    rows = [
        {"round": 0, "val_ppl": 100.0, "test_ppl": 100.0, "info": {}},
        {"round": 1, "val_ppl": 90.0, "test_ppl": 91.0, "aggregated": ["a"], "info": info},
    ]
    assert update_norms(rows) == [[1, 2.0]]
    summary = summarize(rows, RunSpec("rank", "ptb", "FedAttOpt", 0.1))
    assert summary["update_norms"] == [[1, 2.0]] and summary["step_scale"] == [[1, 2.0, 2.0]]


def _run(rid, lr, **extra):
    return {"id": rid, "suite": "rank", "dataset": "wikitext-2", "kind": "federated",
            "fraction": 0.1, "best_val_ppl": 80.0, "best_round": 1, "updates": 500, "rounds": 50,
            "command": f"fedkey simulate --clients 100 --lr {lr} --fraction 0.1", **extra}  # fmt: skip


def test_the_section_counts_far_rounds_and_gives_the_epsilon_for_fedavgs_reach():
    scales = [[1, 0.5, 0.5], [2, 3.0, 3.0], [3, 1.0, 7.0]]  # round 3 cut from 7 to 1
    attopt = _run("rank-wikitext-2-fedattopt-c0.1", 3, step_scale=scales,
                  curve=[[0, 100.0, 100.0], [1, 80.0, 81.0], [2, 1e9, 1e9], [3, 90.0, 91.0]])  # fmt: skip
    attopt["command"] += " --epsilon 1000"
    same_lr = _run("rank-wikitext-2-fedatt-c0.1", 3, update_norms=[[1, 100.0], [50, 20.0]])
    other_lr = _run("rank-wikitext-2-fedavgm-c0.1", 1, update_norms=[[1, 7.0], [50, 9.0]])
    text = "\n".join(step_section([attopt, same_lr, other_lr]))
    # reach 0.5 / median 1.0 / largest 3.0; one round past 2x, after it 1e9, after the others 85
    assert (
        "| `rank-wikitext-2-fedattopt-c0.1` | 1000 | 3 | 0.50 | 1.00 | 3.00 | 1 | 1e+09 | 85 | "
        "80.00 (1) | 3.00 | 7.00 |" in text
    )
    # d^2 / m with m = 10 phones a round: 100^2 / 10 at round 1, 20^2 / 10 at the last
    assert "| `rank-wikitext-2-fedatt-c0.1` | 3 | 100.0 | 20.0 | 1000 | 40 |" in text
    # a second FedAttOpt run of the same suite, dataset and lr: the runs beside them listed once
    capped = {**attopt, "id": "rank-wikitext-2-fedattopt-capped-c0.1"}
    assert "\n".join(step_section([attopt, capped, same_lr])).count("fedatt-c0.1` | 3 |") == 1
    assert "fedavgm" not in text  # another client lr: not the same updates
    assert step_section([same_lr, other_lr]) == []  # no FedAttOpt run with its reach: no section
