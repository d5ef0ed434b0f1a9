"""Bounded influence: the server clips every update before any strategy sees it, caps attention
and sample-count weights, so one well-formed hostile upload cannot take over the global model."""

import math

import pytest
import torch

from server.config import InfluenceConfig
from server.influence import bound_round, layer_norms, make_bound, whole_norm
from server.strategies import ClientUpdate, get_strategy

GLOBAL = {"emb": torch.zeros(6, 4), "bias": torch.zeros(5), "steps": torch.tensor(3)}


def honest(i, scale=1.0, n=100):
    g = torch.Generator().manual_seed(i)
    state = {
        k: v + scale * torch.randn(v.shape, generator=g) for k, v in GLOBAL.items() if k != "steps"
    }
    return ClientUpdate({**state, "steps": torch.tensor(3)}, n, 1.0, f"d{i:02d}")


def norm_of(update):
    return whole_norm(layer_norms(GLOBAL, update.state))


def test_adaptive_bound_is_a_multiple_of_the_median_and_cuts_a_boosted_update_back():
    ups = [honest(i) for i in range(9)] + [honest(9, scale=100.0)]
    norms = sorted(norm_of(u) for u in ups)
    median = (norms[4] + norms[5]) / 2
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
    assert rnd.bound.norm == pytest.approx(2.0 * median)
    out = list(rnd)
    assert norm_of(out[-1]) == pytest.approx(2.0 * median, rel=1e-6)  # the x100 phone
    # The honest updates within the bound are passed as they are (the same tensors).
    for before, after in zip(ups[:-1], out[:-1], strict=True):
        if norm_of(before) <= rnd.bound.norm:
            assert after.state["emb"] is before.state["emb"]
    assert rnd.info["clipped"] >= 1 and rnd.info["mode"] == "adaptive"
    assert out[-1].state["steps"] is ups[-1].state["steps"]  # integer buffers untouched


def test_layer_scope_bounds_each_layer_and_the_whole():
    cfg = InfluenceConfig(mode="fixed", norm=2.0, scope="layer")
    bound = make_bound(cfg, GLOBAL, [])
    assert math.sqrt(sum(s * s for s in bound.layers.values())) == pytest.approx(2.0)
    assert bound.layers["emb"] > bound.layers["bias"]  # S_l grows with the layer's size
    out = list(bound_round(cfg, GLOBAL, [honest(i, scale=5.0) for i in range(3)]))
    for u in out:
        norms = layer_norms(GLOBAL, u.state)
        assert all(norms[k] <= bound.layers[k] * (1 + 1e-6) for k in norms)
        assert norm_of(u) <= 2.0 * (1 + 1e-6)


def test_the_dp_clip_overrides_the_mode_with_a_fixed_bound():
    rnd = bound_round(InfluenceConfig(), GLOBAL, [honest(i) for i in range(4)], clip_norm=0.5)
    assert rnd.bound.norm == 0.5 and rnd.info["mode"] == "dp"
    assert all(norm_of(u) <= 0.5 * (1 + 1e-6) for u in rnd)


def test_off_leaves_everything_as_published():
    ups = [honest(0), honest(1, scale=100.0, n=2**62)]
    rnd = bound_round(InfluenceConfig(mode="off"), GLOBAL, ups)
    assert rnd.bound is None
    out = list(rnd)
    assert out[1].state["emb"] is ups[1].state["emb"] and out[1].num_samples == 2**62


def test_a_phone_claiming_2_to_the_62_samples_does_not_own_fedavg():
    ups = [honest(i, n=100 + i) for i in range(9)] + [honest(9, n=2**62)]
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
    new, info = get_strategy("fedavg").aggregate(GLOBAL, rnd, rnd.bound)
    cap = int(4 * 104.5)  # 4 x the median declared count
    assert rnd.info["weight_cap"] == cap and rnd.info["capped_weights"] == 1
    assert info["weights"]["d09"] == pytest.approx(cap / (sum(range(100, 109)) + cap))
    # Under DP every weight is 1: the declared counts are private data.
    assert {u.num_samples for u in bound_round(InfluenceConfig(), GLOBAL, ups, 1.0, True)} == {1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_fedatt_gives_a_boosted_phone_no_more_than_the_cap(temperature):
    """Unbounded, FedAtt's softmax of distances gives the farthest model nearly all the weight."""
    ups = [honest(i) for i in range(9)] + [honest(9, scale=100.0)]
    fedatt = get_strategy("fedatt")
    _, raw = fedatt.aggregate(GLOBAL, ups)
    assert raw["attention_max"] > 0.99
    rnd = bound_round(InfluenceConfig(temperature=temperature), GLOBAL, ups)
    new, info = fedatt.aggregate(GLOBAL, rnd, rnd.bound)
    rho = math.exp(1 / temperature)
    assert info["attention_cap"] == pytest.approx(rho / (rho + 9))
    assert info["attention_max"] <= info["attention_cap"] + 1e-12
    step = {k: new[k] - GLOBAL[k] for k in ("emb", "bias")}
    assert whole_norm({k: float(v.norm()) for k, v in step.items()}) <= 1.2 * rnd.bound.norm


def test_a_zero_round_does_not_divide_by_zero():
    same = [ClientUpdate(dict(GLOBAL), 1, 1.0, f"d{i}") for i in range(3)]
    rnd = bound_round(InfluenceConfig(), GLOBAL, same)
    new, _ = get_strategy("fedatt").aggregate(GLOBAL, rnd, rnd.bound)
    assert torch.equal(new["emb"], GLOBAL["emb"])


def test_a_fixed_bound_needs_its_norm():
    with pytest.raises(ValueError, match="--bound-norm"):
        InfluenceConfig(mode="fixed")
