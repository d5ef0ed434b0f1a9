"""The spread of the server's per-phone weights per round (fedkey_bench.paper.spread): max, min, entropy and
evenness from the metrics rows' strategy info."""

import math

import pytest

from fedkey_bench.paper.runner import summarize
from fedkey_bench.paper.spec import RunSpec
from fedkey_bench.paper.spread import round_spreads, spread


def test_equal_weights_are_perfectly_even():
    s = spread({f"d{k}": 0.1 for k in range(10)})
    assert s["m"] == 10 and s["max"] == pytest.approx(0.1) and s["min"] == pytest.approx(0.1)
    assert s["entropy"] == pytest.approx(math.log(10)) and s["evenness"] == pytest.approx(1.0)


def test_weight_gathered_on_one_phone_is_uneven_and_normalized_first():
    s = spread({"a": 7.0, "b": 1.0, "c": 1.0, "d": 1.0})  # sums to 10: 0.7, 0.1, 0.1, 0.1
    assert s["max"] == pytest.approx(0.7) and s["min"] == pytest.approx(0.1)
    h = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1))
    assert s["entropy"] == pytest.approx(h) and s["evenness"] == pytest.approx(h / math.log(4))
    assert spread({"a": 1.0})["evenness"] == 1.0
    with pytest.raises(ValueError, match="no positive weights"):
        spread({})


def test_rounds_take_the_attention_over_fedavgs_weights_and_skip_rounds_without():
    rows = [
        {"round": 0, "info": {}},
        {"round": 1, "info": {"attention_mean": {"a": 0.5, "b": 0.5}, "weights": {"a": 0.9}}},
        {"round": 2, "info": {"mode": "fedavg"}},  # FedMed's plain-average round: no weights
        {"round": 3, "info": {"attention": {"a": 0.9, "b": 0.1}}},  # FedAttOpt's key
        {"round": 4, "info": {"weights": {"a": 0.25, "b": 0.75}}},
    ]
    out = round_spreads(rows)
    assert [(s["round"], s["source"]) for s in out] == [
        (1, "attention_mean"), (3, "attention"), (4, "weights")]  # fmt: skip
    assert out[0]["evenness"] == pytest.approx(1.0) and out[1]["max"] == pytest.approx(0.9)


def test_federated_summaries_carry_the_spread_and_others_none():
    rows = [{"round": 0, "val_ppl": 100, "test_ppl": 100, "info": {}},
            {"round": 1, "val_ppl": 90, "test_ppl": 91, "aggregated": ["a", "b"],
             "info": {"attention_mean": {"a": 0.8, "b": 0.2}}}]  # fmt: skip
    fed = summarize(rows, RunSpec("noniid", "demo", "FedAtt", 0.1, partition="user"))
    assert fed["partition"] == "user" and fed["weight_spread"][0]["max"] == pytest.approx(0.8)
    ngram = summarize(rows[:1], RunSpec("rank", "ptb", "Kneser-Ney 3-gram", None, kind="ngram"))
    assert ngram["weight_spread"] == []


def test_a_diverged_round_is_never_the_best():
    rows = [{"round": 0, "val_ppl": 1000.0, "test_ppl": 1000.0},
            {"round": 1, "val_ppl": float("nan"), "test_ppl": float("nan")},
            {"round": 2, "val_ppl": 900.0, "test_ppl": 910.0},
            {"round": 3, "val_ppl": None, "test_ppl": None}]  # fmt: skip
    summary = summarize(rows, RunSpec("sweep", "ptb", "FedAvg, client lr 3", 0.1))
    assert (summary["best_round"], summary["test_ppl"]) == (2, 910.0)
