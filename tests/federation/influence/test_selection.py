"""The trim's order statistics by selection (fedkey.federation.influence.selection) are the sort's
(fedkey.federation.influence.cohort_scan._order_statistics, the reference): its documented error
is none, so every test here asks for equal values, and for the same round aggregated."""

import numpy as np
import pytest
import torch

import fedkey.federation.influence.bounding as influence
import fedkey.federation.influence.cohort_scan as cohort_scan
from fedkey.federation.config import InfluenceConfig
from fedkey.federation.influence.bounding import bound_round, trim_count
from fedkey.federation.influence.cohort_scan import Cohort, floating_keys, trim_scan
from fedkey.federation.influence.selection import from_keys, ordered_keys, select_limits
from fedkey.federation.strategies import ClientUpdate, get_strategy
from tests.federation.influence.test_cohort_scan import GLOBAL, cohort, store


def sorted_limits(cols, k):
    """The reference: each row's (k+1)-th smallest and largest value from one np.sort."""
    s = np.sort(cols, axis=1)
    return s[:, k], s[:, cols.shape[1] - k - 1]


def selected(cols, k):
    lo, hi = np.empty(cols.shape[0], cols.dtype), np.empty(cols.shape[0], cols.dtype)
    before = cols.copy()
    assert select_limits(cols, k, lo, hi)
    assert np.array_equal(cols, before)  # the block is left as it is
    return lo, hi


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_keys_are_in_the_floats_order_and_give_them_back_bit_for_bit(dtype):
    finfo = np.finfo(dtype)
    values = np.array(
        [-np.inf, -finfo.max, -1.5, -finfo.tiny, -finfo.smallest_subnormal, -0.0, 0.0,
         finfo.smallest_subnormal, finfo.tiny, 1e-30, 1.0, 1.5, finfo.max, np.inf],
        dtype,
    )  # fmt: skip
    keys = ordered_keys(values)
    assert np.all(np.diff(keys) > 0)  # -0.0 just below +0.0
    back = from_keys(keys, values.dtype)
    assert back.tobytes() == values.tobytes()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(dtype)
    order = np.argsort(x, kind="stable")
    assert np.all(np.diff(ordered_keys(x[order])) >= 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("m", "k"), [(1, 0), (3, 1), (9, 4), (10, 0), (300, 30), (1000, 100)])
def test_the_selected_limits_are_the_sorts(dtype, m, k):
    rng = np.random.default_rng(m)
    cols = rng.standard_normal((40, m)).astype(dtype)
    cols[::4] = np.round(cols[::4], 1)  # ties: every fourth coordinate on a grid of 0.1
    cols[1, : m // 2] = 0.5  # half the cohort on one value
    cols[2, ::2] = -0.0
    cols[2, 1::2] = 0.0  # signed zeros only
    cols[3, : m // 3] = np.inf  # infinities at both ends
    cols[3, m // 3 : m // 2] = -np.inf
    cols[5] *= 1e6 * (np.arange(m) % 7 == 0) + 1  # a few boosted phones
    lo, hi = selected(cols, k)
    want_lo, want_hi = sorted_limits(cols, k)
    np.testing.assert_array_equal(lo, want_lo)  # -0.0 and +0.0 equal, as the clamp reads them
    np.testing.assert_array_equal(hi, want_hi)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_block_with_a_nan_is_left_to_the_sort(sign):
    """A NaN (negative NaN's bits order below every number, where np.sort puts NaN last) is
    found among the k+1 smallest or largest keys: nothing is written and the caller sorts."""
    cols = np.random.default_rng(1).standard_normal((6, 11)).astype(np.float32)
    cols[4, 7] = np.copysign(np.nan, sign)
    lo, hi = np.zeros(6, np.float32), np.zeros(6, np.float32)
    assert not select_limits(cols, 2, lo, hi)
    assert not lo.any() and not hi.any()


def test_a_trim_scan_with_a_nan_gives_the_sorts_limits(monkeypatch):
    monkeypatch.setattr(cohort_scan, "SELECT_FROM", 1)
    states = cohort(9, torch.float32, seed=5)
    states[3]["bias"] = states[3]["bias"].clone()
    states[3]["bias"][2] = -float("nan")
    keys = floating_keys(GLOBAL)
    limits, _ = trim_scan(Cohort(GLOBAL, states), keys, 2, 9 * 4, exact=False)
    d = torch.stack([s["bias"] for s in states]).numpy()
    want_lo, want_hi = sorted_limits(d.T, 2)
    np.testing.assert_array_equal(limits["bias"][0].numpy(), want_lo)
    np.testing.assert_array_equal(limits["bias"][1].numpy(), want_hi)


@pytest.mark.parametrize("m", [9, 24])
def test_the_trim_scan_selects_what_it_sorted(m, monkeypatch):
    """Every block selected (SELECT_FROM 1) or every block sorted: the same limits and the same
    trimmed norms, bit for bit, over blocks and slices of uneven widths."""
    monkeypatch.setattr(cohort_scan, "ORDER_BLOCK", 3 * m)  # blocks of 3 columns
    states = cohort(m, torch.float32, seed=m)
    for st in states[::3]:
        st["emb"] = states[0]["emb"].clone()  # ties
    keys = floating_keys(GLOBAL)
    k = trim_count(0.1, m)
    runs = []
    for select_from in (1, 10**9):
        monkeypatch.setattr(cohort_scan, "SELECT_FROM", select_from)
        runs.append(trim_scan(Cohort(GLOBAL, states), keys, k, 7 * m, exact=False))
    (selected_limits, selected_sq), (sorted_lims, sorted_sq) = runs
    for key in keys:
        assert torch.equal(selected_limits[key][0], sorted_lims[key][0])
        assert torch.equal(selected_limits[key][1], sorted_lims[key][1])
    assert np.array_equal(selected_sq, sorted_sq)


@pytest.mark.parametrize("strategy", ["fedavg", "fedatt"])
def test_the_round_aggregated_with_the_selection_is_the_sorts(strategy, tmp_path, monkeypatch):
    """The aggregate does not move: bound_round then the strategy, over stored uploads, with the
    trim's order statistics selected and with them sorted."""
    monkeypatch.setattr(cohort_scan, "BLOCK", 16)
    monkeypatch.setattr(influence, "TRIM_CHUNK", 40)
    states = cohort(24, torch.float32, seed=8, planted=True)
    held = store(states, tmp_path)
    ups = [ClientUpdate(s, 10 + i, 1.0, f"d{i:02d}") for i, s in enumerate(held)]
    out = []
    for select_from in (1, 10**9):
        monkeypatch.setattr(cohort_scan, "SELECT_FROM", select_from)
        rnd = bound_round(InfluenceConfig(), GLOBAL, ups)
        assert rnd.info["trimmed"] > 0
        out.append(get_strategy(strategy).aggregate(GLOBAL, rnd, rnd.bound)[0])
    for key in GLOBAL:
        assert torch.equal(out[0][key], out[1][key])
