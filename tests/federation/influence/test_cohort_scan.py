"""The fused reads behind bound_round (fedkey.federation.influence.cohort_scan, fedkey.federation.updates.slices) give what the
unfused algebra gives: the same phones rejected, the same trim, the same norms (to rounding) and
the same bounded updates, for updates in memory and on disk, float32 and bfloat16."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import fedkey.federation.influence.bounding as influence
import fedkey.federation.influence.cohort_scan as cohort_scan
from fedkey.federation.config import InfluenceConfig
from fedkey.federation.influence.bounding import bound_round, layer_norms, trim_count
from fedkey.federation.influence.cohort_scan import (
    Cohort,
    clamp_state,
    floating_keys,
    norm_scan,
    trim_scan,
)
from fedkey.federation.strategies import ClientUpdate, get_strategy
from fedkey.federation.strategies.outliers import reject_outliers
from fedkey.federation.updates.slices import SliceReader
from fedkey.federation.updates.store import StoredState

GLOBAL = {
    "emb": torch.randn(9, 5, generator=torch.Generator().manual_seed(99)),
    "bias": torch.linspace(-1, 1, 7),
    "scale": torch.tensor(0.5),  # a floating scalar
    "steps": torch.tensor(3),  # an integer buffer: never bounded
}


def cohort(m, dtype, seed=0, planted=False):
    """m phones' states around GLOBAL in ``dtype``, a shared step plus noise of their own (honest
    phones agree); with ``planted``, the last one's embedding points away from the others."""
    g = torch.Generator().manual_seed(seed)
    shared = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in GLOBAL.items()}
    states = []
    for i in range(m):
        st = {
            k: (v + shared[k] + 0.05 * torch.randn(v.shape, generator=g)).to(dtype)
            for k, v in GLOBAL.items()
        }
        st["steps"] = torch.tensor(3)
        if planted and i == m - 1:
            st["emb"] = (GLOBAL["emb"] - 3 * shared["emb"]).to(dtype)
        states.append(st)
    return states


def store(states, tmp_path):
    """The states as the server keeps uploads: safetensors files read lazily."""
    out = []
    for i, st in enumerate(states):
        path = tmp_path / f"u{i}.safetensors"
        save_file({k: v.contiguous() for k, v in st.items()}, str(path))
        out.append(StoredState(path))
    return out


def reference(config, states):
    """The unfused algebra on whole float64 deltas: the pairwise cosine filter, the trim as
    order statistics of the deltas (a full sort), the trimmed states cast back, their norms."""
    keys = floating_keys(GLOBAL)
    m = len(states)
    kept = list(range(m))
    if config.outlier_z_for(dp=False) > 0 and m > 1:
        flat = torch.stack(
            [
                torch.cat([(s[k].double() - GLOBAL[k].double()).reshape(-1) for k in keys])
                for s in states
            ]
        )
        unit = flat / flat.norm(dim=1, keepdim=True)
        scores = ((unit @ unit.T).sum(dim=1) - 1) / (m - 1)
        out = set(reject_outliers(scores.numpy(), config.outlier_z_for(dp=False)))
        kept = [i for i in kept if i not in out]
    k = trim_count(config.trim_for(dp=False), len(kept))
    trimmed = [dict(states[i]) for i in kept]
    if k:
        for key in keys:
            g = GLOBAL[key].double()
            d = torch.stack([states[i][key].double() - g for i in kept])
            s = d.sort(dim=0).values
            for t, row in zip(trimmed, d, strict=True):
                t[key] = (g + torch.clamp(row, s[k], s[len(kept) - k - 1])).to(t[key].dtype)
    return kept, trimmed, [layer_norms(GLOBAL, t) for t in trimmed]


@pytest.mark.parametrize("where", ["memory", "stored"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "planted"), [(1, False), (2, False), (7, False), (12, True)])
def test_bound_round_equals_the_unfused_reference(where, dtype, m, planted, tmp_path, monkeypatch):
    monkeypatch.setattr(influence, "TRIM_CHUNK", 13)  # slices of a few elements, across layers
    states = cohort(m, dtype, seed=m, planted=planted)
    held = store(states, tmp_path) if where == "stored" else states
    ups = [ClientUpdate(s, 10 + i, 1.0, f"d{i:02d}") for i, s in enumerate(held)]
    config = InfluenceConfig()
    rnd = bound_round(config, GLOBAL, ups)
    kept, trimmed, norms = reference(config, states)
    assert [u.device_id for u in rnd.updates] == [f"d{i:02d}" for i in kept]
    if planted:
        assert f"d{m - 1:02d}" in rnd.info["outliers"]
    assert rnd.info["trimmed"] == trim_count(0.1, len(kept))
    whole = [math.sqrt(sum(v * v for v in n.values())) for n in norms]
    assert rnd.info["median_norm"] == pytest.approx(float(np.median(whole)), rel=1e-6)
    assert rnd.info["max_norm"] == pytest.approx(max(whole), rel=1e-6)
    for got, want, factors in zip(rnd, trimmed, rnd.factors, strict=True):
        expect = influence.scale_deltas(GLOBAL, want, factors, exact=False)  # the same trim
        for key in GLOBAL:
            assert torch.equal(got.state[key], expect[key]), key


def test_the_trim_scan_norms_are_the_trimmed_states_norms_and_exact_under_dp(monkeypatch):
    states = cohort(11, torch.float32, seed=5)
    keys = floating_keys(GLOBAL)
    limits, sq = trim_scan(Cohort(GLOBAL, states), keys, 2, 17, exact=False)
    _, sq64 = trim_scan(Cohort(GLOBAL, states), keys, 2, 17, exact=True)
    want = np.array(
        [[layer_norms(GLOBAL, clamp_state(s, limits))[k] ** 2 for k in keys] for s in states]
    )
    assert sq == pytest.approx(want, rel=1e-5)
    assert sq64 == pytest.approx(want, rel=1e-12)
    raw = np.array([[layer_norms(GLOBAL, s)[k] ** 2 for k in keys] for s in states])
    assert norm_scan(Cohort(GLOBAL, states), keys, exact=True) == pytest.approx(raw, rel=1e-12)
    assert norm_scan(Cohort(GLOBAL, states), keys, exact=False) == pytest.approx(raw, rel=1e-5)


def test_a_float64_update_in_a_float32_model_is_trimmed_in_float64():
    states = cohort(5, torch.float32, seed=3)
    states[2] = {
        k: (v.double() + 1e-9 if v.is_floating_point() else v) for k, v in states[2].items()
    }
    limits, _ = trim_scan(Cohort(GLOBAL, states), floating_keys(GLOBAL), 1, 1 << 10, exact=False)
    assert all(lo.dtype == torch.float64 for lo, _ in limits.values())
    d = torch.stack([s["bias"].double() for s in states]).sort(dim=0).values
    assert torch.equal(limits["bias"][0], d[1]) and torch.equal(limits["bias"][1], d[3])


def test_a_layer_of_the_wrong_shape_is_refused_with_its_name():
    states = cohort(4, torch.float32)
    states[1]["bias"] = torch.zeros(6)
    with pytest.raises(ValueError, match="'bias'"):
        norm_scan(Cohort(GLOBAL, states), floating_keys(GLOBAL), exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_slice_reader_reads_what_stored_state_reads(dtype, tmp_path):
    state = {
        "w": torch.randn(6, 7).to(dtype),
        "v": torch.randn(11).to(dtype),
        "s": torch.tensor(2.5, dtype=dtype),
        "i": torch.arange(4),
    }
    save_file(state, str(tmp_path / "u.safetensors"))
    stored = StoredState(tmp_path / "u.safetensors")
    reader = SliceReader.open(stored.path)
    assert reader is not None
    out_dtype = np.float64 if dtype == torch.float64 else np.float32
    for key, a, b in [("w", 0, 42), ("w", 5, 19), ("v", 3, 11), ("s", 0, 1), ("w", 7, 7)]:
        out = np.empty(b - a, out_dtype)
        assert reader.read_into(key, a, b, out)
        assert np.array_equal(out, stored.flat_slice(key, a, b).to(torch.float64).numpy())
    assert not reader.read_into("i", 0, 4, np.empty(4, np.float32))  # not a float: the caller reads
    assert not reader.read_into("w", 40, 44, np.empty(4, np.float32))  # past the end
    if dtype == torch.float64:  # float64 never narrowed into a float32 buffer
        assert not reader.read_into("v", 0, 2, np.empty(2, np.float32))


def test_a_file_the_reader_does_not_understand_is_read_through_stored_state(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert SliceReader.open(str(bad)) is None
    states = cohort(3, torch.float32)
    stored = store(states, tmp_path)
    scan = Cohort(GLOBAL, stored)
    scan.readers[1] = None  # as for a file it could not parse: StoredState.flat_slice instead
    assert norm_scan(scan, floating_keys(GLOBAL), exact=True) == pytest.approx(
        norm_scan(Cohort(GLOBAL, states), floating_keys(GLOBAL), exact=True), rel=1e-12
    )


def test_float32_cosine_scores_agree_with_float64_on_a_million_parameters():
    """The filter's arithmetic is float32 (module docstring): on a model-sized cohort its scores
    are the float64 pairwise cosines to well under the spread that decides a rejection."""
    g = torch.Generator().manual_seed(7)
    glob = {"w": torch.randn(1000, 1000, generator=g)}
    shared = 0.01 * torch.randn(1000, 1000, generator=g)
    states = [
        {"w": glob["w"] + shared + 0.01 * torch.randn(1000, 1000, generator=g)} for _ in range(6)
    ]
    got = influence.cosine_scores(glob, states)
    flat = torch.stack([(s["w"].double() - glob["w"].double()).reshape(-1) for s in states])
    unit = flat / flat.norm(dim=1, keepdim=True)
    want = ((unit @ unit.T).sum(dim=1) - 1) / (len(states) - 1)
    assert got == pytest.approx(want.numpy(), abs=1e-6)
    assert float(want.max() - want.min()) > 5e-4  # the spread a cut is made in: 1e-3 here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_float32_clip_is_the_float64_clip_to_an_ulp(dtype):
    """Outside DP the clip scales in float32 (torch.lerp); the float64 one stays DP's."""
    states = cohort(3, dtype, seed=11)
    factors = dict.fromkeys(floating_keys(GLOBAL), 0.37)
    for st in states:
        fast = influence.scale_deltas(GLOBAL, st, factors, exact=False)
        slow = influence.scale_deltas(GLOBAL, st, factors)
        for key in factors:
            assert fast[key].dtype == st[key].dtype
            ulp = torch.finfo(dtype).eps * slow[key].float().abs().clamp(min=1.0)
            assert ((fast[key].float() - slow[key].float()).abs() <= 2 * ulp).all(), key
        assert torch.equal(fast["steps"], st["steps"])


def test_under_dp_the_round_clips_in_float64():
    ups = [ClientUpdate(s, 10, 1.0, f"d{i}") for i, s in enumerate(cohort(8, torch.float32))]
    assert bound_round(InfluenceConfig(), GLOBAL, ups, clip_norm=0.1).exact
    assert not bound_round(InfluenceConfig(), GLOBAL, ups).exact


@pytest.mark.parametrize(
    "header",
    [
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}',  # 2 floats in 4 bytes
        b'{"w": {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 8]}}',
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}',
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',  # past the file's end
        b"[1, 2]",
        b"not json",
    ],
)
def test_a_header_the_reader_does_not_understand_is_left_to_stored_state(header, tmp_path):
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    assert SliceReader.open(str(path)) is None


@pytest.mark.parametrize("threads", [2, 3, 50])
def test_the_sort_split_among_threads_gives_the_same_trim(threads):
    states = cohort(9, torch.float32, seed=4)
    keys = floating_keys(GLOBAL)
    one = trim_scan(Cohort(GLOBAL, states), keys, 2, 9 * 20, exact=False)
    many = trim_scan(Cohort(GLOBAL, states), keys, 2, 9 * 20, exact=False, threads=threads)
    for key in keys:
        assert torch.equal(one[0][key][0], many[0][key][0])
        assert torch.equal(one[0][key][1], many[0][key][1])
    assert np.array_equal(one[1], many[1])


@pytest.mark.parametrize("strategy", ["fedavg", "fedatt"])
def test_the_rounds_aggregate_is_the_unfused_algebras_on_a_cohort_with_outliers(
    strategy, tmp_path, monkeypatch
):
    """bound_round then the strategy over stored uploads (the scans a few elements at a time,
    each upload read once whole for the strategy, trimmed and clipped in place) give the
    aggregate of the unfused float64 algebra: the same phones rejected and the same trim; the
    norms, so the clip, to float32 rounding (1e-6 relative)."""
    monkeypatch.setattr(cohort_scan, "BLOCK", 16)  # several blocks a layer
    monkeypatch.setattr(influence, "TRIM_CHUNK", 40)
    states = cohort(24, torch.float32, seed=3)
    for i in (5, 17):  # boosted, against the others
        states[i] = {
            k: GLOBAL[k] - 4 * (v - GLOBAL[k]) if v.is_floating_point() else v
            for k, v in states[i].items()
        }
    held = store(states, tmp_path)
    ups = [ClientUpdate(s, 10 + 3 * i, 1.0, f"d{i:02d}") for i, s in enumerate(held)]
    config = InfluenceConfig()
    rnd = bound_round(config, GLOBAL, ups)
    kept, trimmed, norms = reference(config, states)
    assert sorted(rnd.info["outliers"]) == ["d05", "d17"]
    assert [u.device_id for u in rnd.updates] == [f"d{i:02d}" for i in kept]
    bound = influence.make_bound(config, GLOBAL, norms)
    assert bound is not None
    factors = [influence.clip_factors(n, bound) for n in norms]
    k = trim_count(0.1, len(kept))
    bound = replace(bound, distance_caps=influence.distance_caps(norms, factors, k))
    cap = influence.weight_cap([ups[i].num_samples for i in kept], config.weight_cap)
    want_updates = [
        replace(ups[i], state=influence.scale_deltas(GLOBAL, t, f, exact=False),
                num_samples=min(ups[i].num_samples, cap))
        for i, t, f in zip(kept, trimmed, factors, strict=True)
    ]  # fmt: skip
    got, _ = get_strategy(strategy).aggregate(GLOBAL, rnd, rnd.bound)
    want, _ = get_strategy(strategy).aggregate(GLOBAL, want_updates, bound)
    for key in GLOBAL:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("m", "k"), [(13, 2), (9, 4), (20, 0)])
def test_the_trim_sorted_in_groups_is_the_whole_cohorts_order_statistics(m, k, monkeypatch):
    """Phones sorted a few at a time (their groups' k+1 extremes merged) give each coordinate's
    (k+1)-th smallest and largest value of the whole cohort, ties included, and the same trimmed
    norms as one sort of everyone, whatever the blocks' widths."""
    states = cohort(m, torch.float32, seed=m)
    for st in states[::3]:  # ties: a third of the phones share one value of each coordinate
        st["emb"] = states[0]["emb"].clone()
    keys = floating_keys(GLOBAL)
    monkeypatch.setattr(cohort_scan, "ORDER_BLOCK", 3 * m)  # blocks of 3 columns
    monkeypatch.setattr(cohort_scan, "SORT_GROUP", 4)
    limits, sq = trim_scan(Cohort(GLOBAL, states), keys, k, 7 * m, exact=False)
    for key in keys:
        d = torch.stack([s[key] for s in states]).sort(dim=0).values
        assert torch.equal(limits[key][0], d[k]) and torch.equal(limits[key][1], d[m - k - 1])
    monkeypatch.setattr(cohort_scan, "SORT_GROUP", 512)
    whole = trim_scan(Cohort(GLOBAL, states), keys, k, 7 * m, exact=False)[1]
    assert sq == pytest.approx(whole, rel=1e-6)


@pytest.mark.parametrize("where", ["memory", "stored"])
@pytest.mark.parametrize(
    ("strategy", "options"),
    [("fedavg", {}), ("fedavg", {"weighted": False}), ("fedatt", {}),
     ("fedatt", {"normalizer": "fixed"})],
)  # fmt: skip
def test_the_summed_round_is_the_iterated_round(where, strategy, options, tmp_path, monkeypatch):
    """FedAvg and FedAtt sum a bounded round in one read (BoundedRound.weighted_sum); iterating
    the same round update by update (each trimmed and clipped, then summed in float64) gives the
    same model to float32 rounding of the clipped weights, and the same info (FedAtt's
    attention from the bound's norms, to float32 rounding)."""
    monkeypatch.setattr(cohort_scan, "BLOCK", 16)
    monkeypatch.setattr(cohort_scan, "PHONE_GROUP", 3)  # groups of phones, one a short one
    states = cohort(11, torch.float32, seed=8)
    held = store(states, tmp_path) if where == "stored" else states
    ups = [ClientUpdate(s, 10 + 7 * i, 1.0, f"d{i:02d}") for i, s in enumerate(held)]
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
    assert rnd.distances() is not None and rnd.info["clipped"] > 0
    summed, info = get_strategy(strategy, **options).aggregate(GLOBAL, rnd, rnd.bound)
    iterated, want = get_strategy(strategy, **options).aggregate(GLOBAL, list(rnd), rnd.bound)
    for key in GLOBAL:
        torch.testing.assert_close(summed[key], iterated[key], rtol=1e-6, atol=1e-7)
        assert not torch.equal(summed[key], GLOBAL[key]) or key == "steps"
    assert info.keys() == want.keys()
    if strategy == "fedavg":  # the same weights
        assert info == want
    else:  # the attention from the bound's norms (float32 sums) or from each clipped delta's
        for name in ("attention_mean", "attention_max", "attention_scale"):
            if name in want:
                assert info[name] == pytest.approx(want[name], rel=1e-5)
        assert info["winsorized_scores"] == want["winsorized_scores"]


def test_a_round_with_bfloat16_updates_is_iterated():
    """The iterated clip rounds a bfloat16 update's clipped values to bfloat16; the summed one
    would not, so such a round is not summed (distances() is None) and FedAvg iterates it."""
    states = cohort(6, torch.bfloat16, seed=2)
    ups = [ClientUpdate(s, 10, 1.0, f"d{i}") for i, s in enumerate(states)]
    rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
    assert rnd.distances() is None
    got, _ = get_strategy("fedavg").aggregate(GLOBAL, rnd, rnd.bound)
    want, _ = get_strategy("fedavg").aggregate(GLOBAL, list(rnd), rnd.bound)
    for key in GLOBAL:
        assert torch.equal(got[key], want[key])
