"""Bounded influence: the server clips every update before any strategy sees it, caps attention
and sample-count weights, so one well-formed hostile upload cannot take over the global model."""

import math
from dataclasses import replace

import pytest
import torch

import fedkey.federation.influence.bounding as influence
from fedkey.federation.config import InfluenceConfig, PrivacyConfig, dp_problem
from fedkey.federation.influence.bounding import (
    bound_round,
    layer_norms,
    make_bound,
    trim_count,
    whole_norm,
)
from fedkey.federation.strategies import ClientUpdate, get_strategy

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
    rnd = bound_round(InfluenceConfig(trim=0), GLOBAL, ups)
    assert rnd.bound.norm == pytest.approx(median)  # the default multiple: 1, the median
    assert bound_round(InfluenceConfig(trim=0, multiple=2), GLOBAL, ups).bound.norm == (
        pytest.approx(2 * median)
    )
    out = list(rnd)
    assert norm_of(out[-1]) == pytest.approx(median, rel=1e-6)  # the x100 phone
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


def delta(update, key):
    return update.state[key] - GLOBAL[key]


def test_the_trim_cuts_a_backdoor_coordinate_back_to_the_honest_range():
    """An unboosted attacker that pushes one coordinate (its trigger -> target) far past every
    honest phone passes the norm clip, but not the trim: clamped to the second-largest value."""
    ups = [honest(i, scale=0.1) for i in range(9)]
    bad = honest(9, scale=0.1)
    bad.state["bias"] = bad.state["bias"].clone()
    bad.state["bias"][3] += 0.6
    ups.append(bad)
    honest_max = max(float(delta(u, "bias")[3]) for u in ups[:9])
    fedavg = get_strategy("fedavg")

    untrimmed = bound_round(InfluenceConfig(trim=0, multiple=2), GLOBAL, ups)
    assert untrimmed.info["clipped"] == 0  # within 2x the median norm: the clip lets it through
    pushed, _ = fedavg.aggregate(GLOBAL, untrimmed, untrimmed.bound)

    rnd = bound_round(InfluenceConfig(multiple=2), GLOBAL, ups)  # trim 0.1: 1 value per end
    assert rnd.info["trimmed"] == 1
    out = list(rnd)
    second = sorted(float(delta(u, "bias")[3]) for u in ups)[-2]
    assert second == honest_max
    assert float(delta(out[-1], "bias")[3]) == pytest.approx(honest_max)
    new, _ = fedavg.aggregate(GLOBAL, rnd, rnd.bound)
    assert float(new["bias"][3]) <= honest_max
    assert float(pushed["bias"][3]) - float(new["bias"][3]) > 0.03  # most of its 0.6 / 10 is gone
    # Coordinates inside the range are the phone's own values, bit for bit.
    inside = [
        i
        for i in range(5)
        if sorted(float(delta(u, "bias")[i]) for u in ups)[1]
        < float(delta(bad, "bias")[i])
        < sorted(float(delta(u, "bias")[i]) for u in ups)[-2]
    ]
    assert inside
    assert all(out[-1].state["bias"][i] == bad.state["bias"][i] for i in inside)


def test_the_trim_range_is_the_order_statistics_whatever_the_chunking(monkeypatch):
    ups = [honest(i) for i in range(7)]
    monkeypatch.setattr(influence, "TRIM_CHUNK", 5)  # slices of 5 // 7 -> 1 element at a time
    ranges = influence.coordinate_range(GLOBAL, [u.state for u in ups], 2)
    d = torch.stack([delta(u, "emb").double() for u in ups]).sort(dim=0).values
    assert torch.equal(ranges["emb"][0], d[2]) and torch.equal(ranges["emb"][1], d[4])
    assert "steps" not in ranges  # integer buffers are not trimmed


@pytest.mark.parametrize(
    ("beta", "m", "k"),
    [(0.1, 10, 1), (0.1, 30, 3), (0.1, 31, 4), (0.1, 3, 1), (0.1, 2, 0), (0, 50, 0)],
)
def test_the_trim_clamps_ceil_beta_m_values_at_each_end_when_some_are_left(beta, m, k):
    assert trim_count(beta, m) == k


def test_dp_does_not_trim_by_default_and_refuses_an_explicit_trim():
    ups = [honest(i) for i in range(10)]
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups, clip_norm=1.0)
    assert rnd.info["trimmed"] == 0 and rnd.limits is None
    dp = PrivacyConfig(clip_norm=1.0)
    assert dp_problem("fedavg", dp, InfluenceConfig(), {}) is None
    assert "--trim 0" in dp_problem("fedavg", dp, InfluenceConfig(trim=0.1), {})
    assert bound_round(InfluenceConfig(mode="off"), GLOBAL, ups).info["trimmed"] == 0


def test_fedatt_scores_the_farthest_phone_as_the_second_farthest_under_the_trim():
    """FedAtt's softmax favours the farthest update: a persistent attacker, trimmed and clipped,
    still got 1.3x an honest phone's weight on the embedding (bench attacks). Under the trim its
    distance is winsorized like its coordinates: it counts as the round's (k+1)-th largest."""
    ups = [honest(i, scale=0.1 + 0.05 * i) for i in range(9)]  # phone 8 the farthest honest
    far = {}  # at an honest extreme on every coordinate, as a trimmed backdoor is: never trimmed
    for key in ("emb", "bias"):
        d = torch.stack([delta(u, key) for u in ups])
        hi, lo = d.max(dim=0).values, d.min(dim=0).values
        far[key] = GLOBAL[key] + torch.where(hi.abs() >= lo.abs(), hi, lo)
    ups.append(ClientUpdate({**ups[8].state, **far}, 100, 1.0, "d09"))
    rnd = bound_round(InfluenceConfig(multiple=3), GLOBAL, ups)  # the clip does not bite here
    bounded = [layer_norms(GLOBAL, u.state) for u in rnd]
    for key, cap in rnd.bound.distance_caps.items():  # the attacker farthest, phone 8 second
        order = sorted(range(10), key=lambda i, key=key: bounded[i][key])
        assert order[-2:] == [8, 9]
        assert cap == pytest.approx(bounded[8][key], rel=1e-6)
    fedatt = get_strategy("fedatt")
    new, info = fedatt.aggregate(GLOBAL, rnd, rnd.bound)
    assert info["winsorized_scores"] == 2  # the attacker's two layers
    weights = info["attention_mean"]
    assert weights["d09"] == pytest.approx(weights["d08"], rel=1e-6)
    # The same bounded round without the caps: the attacker outweighs every honest phone.
    _, raw = fedatt.aggregate(GLOBAL, rnd, replace(rnd.bound, distance_caps=None))
    assert raw["attention_mean"]["d09"] > 1.01 * raw["attention_mean"]["d08"]
    assert "winsorized_scores" not in raw


def test_no_distance_caps_without_the_trim_or_under_dp():
    """The caps make one phone's score depend on the others', which the DP analysis (replace one
    phone, the others' logits unchanged) does not cover: they come with the trim only."""
    ups = [honest(i) for i in range(10)]
    assert bound_round(InfluenceConfig(trim=0), GLOBAL, ups).bound.distance_caps is None
    assert bound_round(InfluenceConfig(), GLOBAL, ups, clip_norm=1.0).bound.distance_caps is None
    _, info = get_strategy("fedatt", norm="spectral").aggregate(
        GLOBAL, bound_round(InfluenceConfig(), GLOBAL, ups), None
    )
    assert "winsorized_scores" not in info


def test_the_default_clip_cuts_a_trimmed_backdoor_to_the_median_norm():
    """A trimmed backdoor sits at an honest extreme on every coordinate it pushes: no coordinate
    is out of range, but its norm is (bench attacks: 1.6x the median while honest phones were
    within 1.05x), so a clip at twice the median never bit. At the median (FLAME, Nguyen et al.
    2022) it is cut to an honest phone's norm."""
    ups = [honest(i, scale=0.1) for i in range(9)]
    far = {}
    for key in ("emb", "bias"):
        d = torch.stack([delta(u, key) for u in ups])
        hi, lo = d.max(dim=0).values, d.min(dim=0).values
        far[key] = GLOBAL[key] + torch.where(hi.abs() >= lo.abs(), hi, lo)
    ups.append(ClientUpdate({**ups[0].state, **far}, 100, 1.0, "d09"))
    trimmed = [norm_of(u) for u in bound_round(InfluenceConfig(mode="off"), GLOBAL, ups)]
    median = sorted(trimmed)[4] / 2 + sorted(trimmed)[5] / 2
    assert trimmed[9] > 1.3 * median  # farther than any honest phone, as in the bench
    assert bound_round(InfluenceConfig(multiple=2), GLOBAL, ups).info["clipped"] == 0
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
    assert norm_of(list(rnd)[9]) == pytest.approx(rnd.bound.norm, rel=1e-6)
    assert rnd.bound.norm < 1.05 * median  # the median of the trimmed norms


def cohort(m: int, seed: int = 0, spread: float = 0.3) -> list[ClientUpdate]:
    """Phones that agree as an iid cohort does: one shared direction plus their own noise."""
    g = torch.Generator().manual_seed(seed)
    common = {k: torch.randn(v.shape, generator=g) for k, v in GLOBAL.items() if k != "steps"}
    ups = []
    for i in range(m):
        state = {k: c + spread * torch.randn(c.shape, generator=g) for k, c in common.items()}
        ups.append(ClientUpdate({**state, "steps": torch.tensor(3)}, 100, 1.0, f"d{i:02d}"))
    return ups


def test_the_cosine_filter_rejects_an_update_pointing_away_whatever_its_boost():
    """A persistent backdoor is cut to an honest norm by the clip and to the honest range by the
    trim, but its direction is its own: it is rejected before either, boosted or not."""
    for boost in (1.0, 10.0):
        ups = cohort(9)
        away = {k: v.clone() for k, v in ups[0].state.items()}
        away["emb"] = boost * (0.5 * away["emb"] + torch.linspace(-2, 2, 24).reshape(6, 4))
        ups.append(ClientUpdate(away, 100, 1.0, "d09"))
        rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
        z = rnd.info["outliers"]
        assert max(z, key=z.get) == "d09" and z["d09"] > 3.5
        assert len(z) <= 2  # an honest phone may be rejected in a round too (see below)
        assert [u.device_id for u in rnd] == [f"d{i:02d}" for i in range(9) if f"d{i:02d}" not in z]
        assert rnd.info["cosine_outliers"]["d09"] < rnd.info["cosine_kept"][0]
        kept = bound_round(InfluenceConfig(outlier_z=0), GLOBAL, ups)  # 0: the filter off
        assert kept.info["outliers"] == {} and len(kept) == 10 and "outlier_z" not in kept.info


def test_an_honest_cohort_keeps_nearly_every_phone():
    """Honest phones' scores have a spread of their own; at the cut 3.5 an iid cohort of ten
    loses about one phone in a hundred (tests/federation/strategies/test_outliers.py, on the scores alone); a cut of 2 would cost several times that."""
    rounds = [bound_round(InfluenceConfig(), GLOBAL, cohort(10, seed)) for seed in range(40)]
    rejected = sum(len(r.info["outliers"]) for r in rounds)
    assert rejected <= 0.03 * 400
    assert all(len(r) + len(r.info["outliers"]) == 10 for r in rounds)
    assert all(r.info["outlier_z"] == 3.5 for r in rounds)
    loose = InfluenceConfig(outlier_z=2.0)
    assert sum(
        len(bound_round(loose, GLOBAL, cohort(10, s)).info["outliers"]) for s in range(40)
    ) > (rejected)


def test_cosine_scores_are_the_mean_pairwise_cosine_of_the_raw_deltas(monkeypatch):
    ups = cohort(6, spread=1.0)
    ups[2] = ClientUpdate(
        {k: (v * 50 if k != "steps" else v) for k, v in ups[2].state.items()}, 100, 1.0, "x"
    )
    monkeypatch.setattr(influence, "TRIM_CHUNK", 7)  # slices across layer boundaries' inside
    got = influence.cosine_scores(GLOBAL, [u.state for u in ups])
    flat = torch.stack(
        [torch.cat([delta(u, k).reshape(-1) for k in ("emb", "bias")]) for u in ups]
    ).double()
    unit = flat / flat.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    want = (cos.sum(dim=1) - 1) / (len(ups) - 1)
    assert got == pytest.approx(want.numpy(), abs=1e-6)  # float32 arithmetic (cohort_scan)


def test_dp_does_not_filter_by_default_and_refuses_an_explicit_cut():
    """Which phones are kept depends on every phone's update: replacing one can drop another,
    which the replace-one sensitivity does not cover."""
    ups = cohort(9)
    ups.append(ClientUpdate({k: -v for k, v in ups[0].state.items()}, 100, 1.0, "d09"))
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups, clip_norm=1.0)
    assert len(rnd) == 10 and rnd.info["outliers"] == {}
    dp = PrivacyConfig(clip_norm=1.0)
    assert dp_problem("fedatt", dp, InfluenceConfig(), {}) is None
    assert "--outlier-z 0" in dp_problem("fedatt", dp, InfluenceConfig(outlier_z=3.5), {})
    assert dp_problem("fedatt", dp, InfluenceConfig(outlier_z=0), {}) is None
    # FedAttOpt's reach cap scales its step by the updates' norms: outside the sensitivity bound
    assert "drop --max-reach" in dp_problem("fedattopt", dp, InfluenceConfig(), {"max_reach": 1.0})
    assert InfluenceConfig(mode="off", outlier_z=3.5).outlier_z_for(dp=False) == 0.0
    with pytest.raises(ValueError, match="outlier filter"):
        InfluenceConfig(outlier_z=-1)
