"""A round summed where its phones trained (fedkey.federation.updates.summed): FedAvg's step from
the sum is the per-phone path's to float rounding, with and without DP (the same noise, the same
epsilon, the same next adaptive clip), the weights it was summed with are the only ones it
accepts, a refused phone is left out, and only a round nothing reads per phone sums."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fedkey.federation.config import FederationConfig, InfluenceConfig, PrivacyConfig
from fedkey.federation.strategies import ClientUpdate, get_strategy
from fedkey.federation.updates.summed import PartialSum, SummedRound, SumRule, can_sum

GLOBAL = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}


def phone(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in GLOBAL.items()}


PHONES = {f"p{i}": (phone(i), 10 * (i + 1)) for i in range(5)}


def summed(weighted: bool, split: int = 2) -> SummedRound:
    """The phones summed as two workers would: the first `split`, then the rest."""
    parts = [PartialSum.empty(GLOBAL, SumRule(weighted)) for _ in range(2)]
    for i, (d, (state, n)) in enumerate(PHONES.items()):
        parts[i >= split].add(d, state, n, 1.0, GLOBAL)
    return SummedRound.of(parts)


@pytest.mark.parametrize("weighted", [True, False])
def test_fedavg_of_the_sum_is_fedavg_of_the_phones(weighted):
    strategy = get_strategy("fedavg", weighted=weighted)
    updates = [ClientUpdate(s, n, 1.0, d) for d, (s, n) in PHONES.items()]
    want, want_info = strategy.aggregate(GLOBAL, updates)
    got, info = strategy.aggregate(GLOBAL, summed(weighted))
    for k in GLOBAL:
        torch.testing.assert_close(got[k], want[k], rtol=2e-7, atol=0)
    assert info["weights"] == pytest.approx(want_info["weights"])
    assert info["num_updates"] == 5


def test_the_workers_split_changes_the_sum_only_by_rounding():
    one, other = summed(True, split=1), summed(True, split=4)
    for k in GLOBAL:
        torch.testing.assert_close(one.partial.sums[k], other.partial.sums[k], rtol=1e-12, atol=0)


def test_other_coefficients_than_the_summed_weights_are_refused():
    round_ = summed(True)
    uniform = [dict.fromkeys(GLOBAL, 1 / 5) for _ in range(5)]
    with pytest.raises(ValueError, match="no per-phone updates"):
        round_.weighted_sum(uniform)
    with pytest.raises(ValueError, match="no per-phone updates"):
        list(round_)


def test_a_non_finite_phone_is_refused_and_left_out_of_the_sum():
    partial = PartialSum.empty(GLOBAL, SumRule(True))
    partial.add("good", phone(1), 10, 1.0, GLOBAL)
    bad = phone(2)
    bad["w"][0] = math.nan
    partial.add("bad", bad, 10, 1.0, GLOBAL)
    assert [p.device_id for p in partial.phones] == ["good"]
    assert partial.rejected["bad"].startswith("422")
    assert all(torch.isfinite(s).all() for s in partial.sums.values())


def test_the_records_carry_each_phones_layer_norms_and_the_rows_clip_info():
    round_ = summed(True)
    state, _ = PHONES["p3"]
    norms = round_.distances()[round_.device_ids.index("p3")]
    assert norms["w"] == pytest.approx(float(torch.linalg.vector_norm(state["w"] - GLOBAL["w"])))
    info = round_.info(weight_cap=4.0)
    assert (
        info["mode"] == "off" and info["trimmed"] == 0 and info["max_norm"] >= info["median_norm"]
    )


def test_only_a_round_nothing_reads_per_phone_is_summed():
    off = InfluenceConfig(mode="off")

    def summable(strategy: Any = "fedavg", **kw: Any) -> bool:
        config = FederationConfig(strategy=strategy, influence=kw.pop("influence", off), **kw)
        return can_sum(config, get_strategy(strategy, **config.strategy_params))

    assert summable()
    assert summable("fedsgd")
    assert not summable(influence=InfluenceConfig())  # the default bound: clip at the median
    assert not summable("fedatt")
    dp = PrivacyConfig(noise_multiplier=1.0, clip_norm=1.0)
    assert summable(privacy=dp)  # DP's clip alone: clipped where the phones train
    assert summable(privacy=dp, influence=InfluenceConfig())  # the trim and filter are off
    assert not summable(privacy=dp, influence=InfluenceConfig(trim=0.1))
    assert not summable("fedatt", privacy=dp)  # the softmax reads the whole cohort
    fixed = {"normalizer": "fixed"}
    assert summable("fedatt", privacy=dp, strategy_params=fixed)  # each phone's weight its own
    assert not summable("fedatt", strategy_params=fixed)  # without DP's public bound
    assert not summable("fedatt", privacy=dp, strategy_params={**fixed, "norm": "spectral"})
    config = FederationConfig(influence=off)
    assert not can_sum(config, get_strategy("fedavg", selector="adafl"))  # reads the updates
