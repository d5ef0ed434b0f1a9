"""The strategy interface: construction, selection, topK, AdaFL, FedMed's mediator, persistence."""

import json
import math

import numpy as np
import pytest
import torch

from fedkey.federation.strategies import STRATEGIES, ClientUpdate, Strategy, get_strategy
from fedkey.federation.strategies.aggregate import (
    fedatt,
    fedattopt,
    fedmed_adaptive,
    model_distance,
)
from fedkey.federation.strategies.selection import AdaFLSelector, cohort_size, top_k_lowest


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def updates_from(clients, sizes=None, losses=None):
    sizes = sizes or [10] * len(clients)
    losses = losses or [3.0] * len(clients)
    return [
        ClientUpdate(state=c, num_samples=n, train_loss=loss, device_id=f"d{i}")
        for i, (c, n, loss) in enumerate(zip(clients, sizes, losses, strict=True))
    ]


# --------------------------------------------------------------------------- construction


def test_registry_and_errors():
    assert {"fedsgd", "fedavg", "fedatt", "fedattopt", "fedmed"} <= set(STRATEGIES)
    with pytest.raises(ValueError, match="fedatt.*fedavg"):
        get_strategy("fedprox")
    with pytest.raises(TypeError, match="unknown option.*epsilonn.*accepts: epsilon"):
        get_strategy("fedatt", epsilonn=1.0)
    with pytest.raises(TypeError, match="unknown option"):
        get_strategy("fedsgd", selector="adafl")
    assert get_strategy("fedsgd", fraction=0.1).fraction == 1.0  # C = 1 by definition
    with pytest.raises(ValueError, match="norm"):
        get_strategy("fedatt", norm="l1")
    with pytest.raises(ValueError, match="selector"):
        get_strategy("fedavg", selector="random")
    with pytest.raises(ValueError, match="beta"):
        get_strategy("fedmed", beta=0.0)


def test_defaults():
    s = get_strategy("fedatt")
    assert (s.epsilon, s.norm, s.fraction) == (1.2, "l2", 0.1)
    m = get_strategy("fedmed")
    assert (m.eta, m.epsilon_med, m.beta) == (1.0, 0.1, 1.0)
    assert get_strategy("fedattopt").epsilon == 1.2
    assert get_strategy("fedavg").weighted is True
    assert get_strategy("fedsgd").local_epochs_override == 1
    assert get_strategy("fedavg").local_epochs_override is None
    assert get_strategy("FedAvg").name == "fedavg"


def test_strategy_is_abstract():
    """A strategy must say how it aggregates: the base class and a subclass without
    ``_aggregate`` cannot be built."""

    class NoAggregate(Strategy):
        name = "none"

    for cls in (Strategy, NoAggregate):
        with pytest.raises(TypeError, match="abstract"):
            cls()


# --------------------------------------------------------------------------- selection


def test_cohort_size_rounding():
    assert cohort_size(0.1, 100) == 10
    assert cohort_size(0.1, 4) == 1  # at least one
    assert cohort_size(0.5, 5) == 3  # 2.5 rounds half up
    assert cohort_size(0.1, 25) == 3
    assert cohort_size(1.0, 7) == 7
    assert cohort_size(0.3, 0) == 0


def test_uniform_selection_deterministic_and_sorted():
    ids = [f"dev{i:02d}" for i in range(40)]
    s = get_strategy("fedavg", fraction=0.25)
    a = s.select(0, ids, np.random.default_rng(123))
    b = s.select(0, list(reversed(ids)), np.random.default_rng(123))
    assert a == b == sorted(a)
    assert len(a) == 10 and len(set(a)) == 10 and set(a) <= set(ids)
    c = s.select(0, ids, np.random.default_rng(124))
    assert c != a
    assert s.select(0, [], np.random.default_rng(0)) == []


def test_fedsgd_selects_everyone():
    s = get_strategy("fedsgd")
    assert s.select(3, ["c", "a", "b"], np.random.default_rng(0)) == ["a", "b", "c"]


def test_select_uploaders_identity_for_non_fedmed():
    losses = {"b": 2.0, "a": 9.0}
    for name in ("fedsgd", "fedavg", "fedatt", "fedattopt", "fedmed"):
        assert get_strategy(name).select_uploaders(0, losses) == ["a", "b"]


def test_topk_keeps_exactly_k_lowest():
    losses = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 1.0, "e": 5.0}
    assert top_k_lowest(losses, 0.6) == ["b", "c", "d"]  # K = 3
    assert top_k_lowest(losses, 0.2) == ["b"]  # K = 1, tie b/d broken by id
    assert top_k_lowest(losses, 0.4) == ["b", "d"]
    assert top_k_lowest(losses, 0.01) == ["b"]  # at least one
    assert top_k_lowest({"x": float("nan"), "y": 9.0}, 0.5) == ["y"]  # NaN ranks last
    s = get_strategy("fedmed", beta=0.8)
    rng = np.random.default_rng(5)
    many = {f"d{i:02d}": float(v) for i, v in enumerate(rng.permutation(20))}
    up = s.select_uploaders(0, many)
    assert len(up) == 16
    assert max(many[d] for d in up) < min(many[d] for d in many if d not in up)


# --------------------------------------------------------------------------- AdaFL


def test_adafl_gamma_schedule():
    sel = AdaFLSelector(gamma_start=0.1, gamma_end=0.5, gamma_steps=5)
    sel.setup({"a": 1}, total_rounds=50)
    got = [sel.gamma(r) for r in (0, 9, 10, 19, 20, 39, 40, 49, 60)]
    assert got == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5])
    const = AdaFLSelector(gamma_start=0.1, gamma_end=0.1)
    const.setup({"a": 1}, 10)
    assert const.gamma(9) == pytest.approx(0.1)


def test_adafl_score_update_by_hand():
    s = get_strategy("fedavg", selector="adafl", alpha=0.9)
    s.setup({"a": 1, "b": 1, "c": 2}, total_rounds=10)
    assert s.selector.scores == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.5})
    new_state = {"w": t(0, 0)}
    ups = [
        ClientUpdate({"w": t(3, 4)}, 1, 1.0, "a"),  # d_a = 5
        ClientUpdate({"w": t(0, 1)}, 2, 1.0, "c"),  # d_c = 1
    ]
    s.after_round(0, new_state, iter(ups))
    total_a = 0.25 + 0.5
    assert s.selector.scores["a"] == pytest.approx(0.9 * 0.25 + 0.1 * (5 / 6) * total_a)
    assert s.selector.scores["c"] == pytest.approx(0.9 * 0.5 + 0.1 * (1 / 6) * total_a)
    assert s.selector.scores["b"] == 0.25
    assert sum(s.selector.scores.values()) == pytest.approx(1.0)


def test_adafl_preserves_score_sum_and_uses_only_available(make_states):
    glob, clients = make_states(12, seed=2)
    ids = [f"d{i}" for i in range(12)]
    sizes = {d: 5 + 3 * i for i, d in enumerate(ids)}
    s = get_strategy("fedatt", selector="adafl", gamma_start=0.2, gamma_end=0.5, gamma_steps=3)
    s.setup(sizes, total_rounds=6)
    rng = np.random.default_rng(0)
    state = glob
    by_id = dict(zip(ids, clients, strict=True))
    for r in range(6):
        available = ids[: 6 + r]
        cohort = s.select(r, available, rng)
        assert set(cohort) <= set(available) and cohort == sorted(cohort)
        assert len(cohort) == cohort_size(s.selector.gamma(r), len(available))
        ups = [ClientUpdate(by_id[d], sizes[d], 2.0, d) for d in cohort]
        state, _ = s.aggregate(state, iter(ups))
        s.after_round(r, state, iter(ups))
        assert sum(s.selector.scores.values()) == pytest.approx(1.0, abs=1e-12)


def test_adafl_late_enrollment_keeps_distribution():
    sel = AdaFLSelector()
    sel.setup({"a": 1, "b": 3}, 10)
    sel.setup({"a": 1, "b": 3, "c": 4}, 10)
    assert sel.scores == pytest.approx({"a": 1 / 8, "b": 3 / 8, "c": 4 / 8})


def test_adafl_state_dict_round_trip_resumes_selection(make_states):
    glob, clients = make_states(6, seed=4)
    ids = [f"d{i}" for i in range(6)]
    s = get_strategy("adafl", gamma_start=0.5, gamma_end=0.5)
    s.setup(dict.fromkeys(ids, 10), 4)
    cohort = s.select(0, ids, np.random.default_rng(1))
    ups = [ClientUpdate(clients[ids.index(d)], 10, 1.0, d) for d in cohort]
    new, _ = s.aggregate(glob, ups)
    s.after_round(0, new, ups)
    saved = json.loads(json.dumps(s.state_dict()))
    s2 = get_strategy("adafl", gamma_start=0.5, gamma_end=0.5)
    s2.load_state_dict(saved)
    assert s2.selector.scores == s.selector.scores
    assert s2.select(1, ids, np.random.default_rng(9)) == s.select(1, ids, np.random.default_rng(9))
    with pytest.raises(ValueError, match="strategy"):
        get_strategy("fedatt").load_state_dict(saved)


# --------------------------------------------------------------------------- FedMed mediator


def test_fedmed_mediation_modes_by_hand():
    glob = {"w": t(0, 0)}
    a = {"w": t(1, 0)}
    b = {"w": t(0, 3)}
    s = get_strategy("fedmed", epsilon_med=0.125)

    def run(losses):
        ups = [ClientUpdate(a, 1, losses[0], "a"), ClientUpdate(b, 3, losses[1], "b")]
        return s.aggregate(glob, (u for u in ups))

    out, info = run([5.0, 5.0])  # first round: adaptive
    assert info["mode"] == "adaptive" and info["delta"] is None
    torch.testing.assert_close(out["w"], fedmed_adaptive(glob, [a, b])["w"], rtol=0, atol=1e-7)
    out, info = run([5.0, 5.125])  # L = 5.0625, Delta = 0.0625 < 0.125: FedAvg weighted by n_k
    assert info["mode"] == "fedavg" and info["delta"] == 0.0625
    torch.testing.assert_close(out["w"], t((1 * 1 + 3 * 0) / 4, (1 * 0 + 3 * 3) / 4))
    out, info = run([3.75, 4.25])  # L = 4.0, Delta = 1.0625: adaptive
    assert info["mode"] == "adaptive" and info["train_loss"] == 4.0
    out, info = run(
        [4.0, 4.25]
    )  # L = 4.125, Delta = 0.125 exactly: adaptive (Se(x) = 1 for x >= eps)
    assert info["mode"] == "adaptive" and info["delta"] == 0.125


def test_fedmed_state_dict_round_trip():
    glob = {"w": t(0, 0)}
    ups = [ClientUpdate({"w": t(1, 0)}, 1, 2.0, "a"), ClientUpdate({"w": t(0, 1)}, 1, 2.0, "b")]
    s = get_strategy("fedmed")
    s.aggregate(glob, ups)
    saved = json.loads(json.dumps(s.state_dict()))
    assert saved["prev_loss"] == 2.0
    s2 = get_strategy("fedmed")
    s2.load_state_dict(saved)
    _, info = s2.aggregate(glob, ups)  # same loss again: Delta = 0 -> FedAvg
    assert info["mode"] == "fedavg"


# --------------------------------------------------------------------------- all strategies


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_runs_on_a_generator(name, make_states):
    glob, clients = make_states(3, seed=1)
    s = get_strategy(name)
    ids = [f"d{i}" for i in range(3)]
    s.setup(dict.fromkeys(ids, 10), total_rounds=5)
    consumed = []

    def gen():
        for u in updates_from(clients):
            consumed.append(u.device_id)
            yield u

    new, info = s.aggregate(glob, gen())
    assert consumed == ids  # iterated exactly once
    assert set(new) == set(glob) and new["steps"].item() == 4
    assert all(new[k].dtype == glob[k].dtype for k in glob)
    s.after_round(0, new, iter(updates_from(clients)))
    json.dumps(info, allow_nan=False)
    json.dumps(s.state_dict(), allow_nan=False)
    s2 = get_strategy(name)
    s2.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert s2.state_dict() == s.state_dict()
    empty, info = s.aggregate(glob, iter([]))
    assert info["num_updates"] == 0
    torch.testing.assert_close(empty["emb.weight"], glob["emb.weight"])


def test_fedattopt_max_reach_steps_no_further_than_asked(make_states):
    """--max-reach: a round whose reach (epsilon * sum_k 1/d_k^2, FedAvg's = 1) would pass the cap
    takes the paper's step scaled down to it; a round below the cap is the paper's step."""
    glob, clients = make_states(3, seed=6)
    ups = updates_from(clients)
    eps = 4.0 / sum(1 / model_distance(glob, c) ** 2 for c in clients)  # reach 4
    out, info = get_strategy("fedattopt", epsilon=eps, max_reach=1.0).aggregate(glob, ups)
    for k, v in fedattopt(glob, clients, epsilon=eps / 4).items():
        torch.testing.assert_close(out[k], v)
    assert info["step_scale"] == pytest.approx(1.0) and info["capped_from"] == pytest.approx(4.0)
    out, info = get_strategy("fedattopt", epsilon=eps, max_reach=5.0).aggregate(glob, ups)
    for k, v in fedattopt(glob, clients, epsilon=eps).items():
        torch.testing.assert_close(out[k], v)
    assert info["step_scale"] == pytest.approx(4.0) and "capped_from" not in info
    with pytest.raises(ValueError, match="max_reach"):
        get_strategy("fedattopt", max_reach=0.0)


def test_strategy_results_match_pure_functions(make_states):
    glob, clients = make_states(3, seed=6)
    ups = updates_from(clients, sizes=[1, 2, 3])
    out, _ = get_strategy("fedatt", epsilon=0.8, norm="spectral").aggregate(glob, ups)
    torch.testing.assert_close(
        out["rnn.weight"], fedatt(glob, clients, 0.8, "spectral")["rnn.weight"]
    )
    s = get_strategy("fedatt")
    _, info = s.aggregate(glob, ups)
    assert sum(info["attention_mean"].values()) == pytest.approx(1.0)
    avg, _ = get_strategy("fedavg", weighted=False).aggregate(glob, ups)
    mean = sum(c["rnn.bias"] for c in clients) / 3
    torch.testing.assert_close(avg["rnn.bias"], mean, rtol=0, atol=1e-6)
    w, _ = get_strategy("fedsgd").aggregate(glob, ups)
    wmean = sum(n * c["rnn.bias"] for n, c in zip([1, 2, 3], clients, strict=True)) / 6
    torch.testing.assert_close(w["rnn.bias"], wmean, rtol=0, atol=1e-6)
    opt = get_strategy("fedattopt", epsilon=0.01)
    _, info = opt.aggregate(glob, ups)
    assert info["distance"]["d0"] == pytest.approx(model_distance(glob, clients[0]))
    assert sum(info["attention"].values()) == pytest.approx(1.0)
    assert math.isfinite(info["loss"])
    # the step's reach against FedAvg's 1: epsilon * sum_k 1 / d_k^2 of this round's distances
    d = [model_distance(glob, c) for c in clients]
    assert info["step_scale"] == pytest.approx(0.01 * sum(1 / x**2 for x in d))


# --------------------------------------------------------------------------- FedAtt's fixed normalizer


def _bound(glob, clip: float, temperature: float):
    from fedkey.federation.strategies import Bound

    layers = {k: clip for k, v in glob.items() if torch.is_floating_point(v)}
    return Bound(norm=clip, layers=layers, scope="model", temperature=temperature)


def test_fixed_normalizer_with_a_large_temperature_is_fedavgs_mean(make_states):
    """T large: every weight exp(logit - 1/T) is near 1, so the step is epsilon times the plain
    mean of the deltas (uniform FedAvg's at epsilon 1), to within the weights' spread 1/T."""
    glob, clients = make_states(4, seed=3)
    ups = updates_from(clients, sizes=[1, 5, 20, 7])
    mean, _ = get_strategy("fedavg", weighted=False).aggregate(glob, ups)
    for eps in (1.0, 1.2):
        fix = get_strategy("fedatt", normalizer="fixed", epsilon=eps)
        out, info = fix.aggregate(glob, ups, _bound(glob, 10.0, 1e6))
        for k in ("emb.weight", "rnn.weight", "rnn.bias", "out.bias"):
            torch.testing.assert_close(
                out[k] - glob[k], eps * (mean[k] - glob[k]), rtol=1e-5, atol=1e-6
            )
        assert all(s == pytest.approx(1.0, abs=1e-6) for s in info["attention_scale"].values())
        assert info["attention_cap"] == 0.25 and info["attention_max"] == pytest.approx(0.25)
        assert out["steps"].item() == 4


@pytest.mark.parametrize("temperature", (0.1, 1.0))
def test_fixed_normalizer_is_fedatts_step_times_the_mean_weight(make_states, temperature):
    """At any T, the fixed normalizer keeps FedAtt's relative weights (the softmax's ratios) and
    scales layer l's step by the mean weight (1/m) sum_k w_k^l, in [e^(-1/T), 1]; the strategy
    is the pure function aggregate.fedatt_fixed."""
    from fedkey.federation.strategies.aggregate import LayerwiseAttention, fedatt_fixed

    def f64(state):  # no float32 rounding of the tiny steps at T = 0.1
        return {k: v.double() if v.is_floating_point() else v for k, v in state.items()}

    glob, clients = make_states(5, seed=8)
    glob, clients = f64(glob), [f64(c) for c in clients]
    ups = updates_from(clients)
    bound = _bound(glob, 2.0, temperature)
    soft, soft_info = get_strategy("fedatt").aggregate(glob, ups, bound)
    fix, info = get_strategy("fedatt", normalizer="fixed").aggregate(glob, ups, bound)
    for k, scale in info["attention_scale"].items():
        assert math.exp(-1 / temperature) <= scale <= 1.0
        torch.testing.assert_close(
            fix[k] - glob[k], scale * (soft[k] - glob[k]), rtol=1e-9, atol=1e-12
        )
    pure = fedatt_fixed(glob, clients, 1.2, "l2", bound.layers, temperature)
    for k in glob:
        torch.testing.assert_close(fix[k], pure[k])
    # per layer, the weights are the softmax's times a common factor: its ratios are FedAtt's
    att = LayerwiseAttention(
        glob, LayerwiseAttention.fedatt_scorer(), {k: 0.5 / temperature for k in bound.layers}
    )
    for c in clients:
        att.add(c)
    ceiling = dict.fromkeys(bound.layers, 1.0 / temperature)
    for (_, w), (_, alpha) in zip(att.fixed_weights(ceiling), att.weights(), strict=True):
        for k in w:
            assert w[k] / alpha[k] == pytest.approx(5 * att.fixed_scale(ceiling)[k], rel=1e-12)


def test_fixed_normalizer_without_a_bound_weighs_the_farthest_phone_one_mth(make_states):
    """No bound (no public ceiling for the logits): the ceiling is the cohort's largest logit, so
    the farthest phone of a layer weighs 1/m and the others FedAtt's ratio of it."""
    glob, clients = make_states(3, seed=2)
    out, info = get_strategy("fedatt", normalizer="fixed", epsilon=1.0).aggregate(
        glob, updates_from(clients)
    )
    k = "rnn.bias"
    d = [float(torch.linalg.vector_norm(c[k] - glob[k])) for c in clients]
    w = [math.exp(x - max(d)) for x in d]
    want = glob[k] + sum(wi * (c[k] - glob[k]) for wi, c in zip(w, clients, strict=True)) / 3
    torch.testing.assert_close(out[k], want, rtol=0, atol=1e-6)
    assert info["attention_scale"][k] == pytest.approx(sum(w) / 3)
    assert info["attention_max"] <= info["attention_cap"] == pytest.approx(1 / 3)


def test_fixed_normalizer_option_from_the_settings():
    """--fedatt-normalizer reaches the strategy (Settings.strategy_params), and a normalizer
    the strategy does not know is refused in one line."""
    from fedkey.server.settings import Settings

    params = Settings(strategy="fedatt", fedatt_normalizer="fixed").strategy_params()
    s = get_strategy("fedatt", **params)
    assert s.normalizer == "fixed" and s.config()["normalizer"] == "fixed"
    assert get_strategy("fedatt").normalizer == "softmax"
    with pytest.raises(ValueError, match="unknown normalizer 'sum'"):
        get_strategy("fedatt", normalizer="sum")
