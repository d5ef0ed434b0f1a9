"""The aggregation arithmetic against hand computation, stacked references and autograd."""

import math

import pytest
import torch

from fedkey.federation.strategies.aggregate import (
    AttOptGradient,
    LayerwiseAttention,
    OnlineSoftmaxSum,
    attopt_step_scale,
    fedatt,
    fedattopt,
    fedattopt_gradient,
    fedavg,
    fedmed_adaptive,
    js_divergence_softmax,
    layer_distance,
    model_distance,
)

E = math.e


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def py_softmax(xs):
    m = max(xs)
    ex = [math.exp(x - m) for x in xs]
    return [e / sum(ex) for e in ex]


def close(a, b, tol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert abs(float(x) - float(y)) <= tol, (a, b)


class OneShot:
    """An iterable that refuses to be iterated twice (like a generator reading from disk)."""

    def __init__(self, items):
        self.items = list(items)
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        assert self.iterations == 1, "iterated more than once"
        yield from self.items


# --------------------------------------------------------------------------- by hand


def test_fedavg_by_hand():
    glob = {"w": t(0, 0), "b": t(0)}
    a = {"w": t(1, 2), "b": t(0)}  # n = 1
    b = {"w": t(3, 6), "b": t(4)}  # n = 3
    out = fedavg(glob, [(a, 1), (b, 3)])
    close(out["w"], [(1 * 1 + 3 * 3) / 4, (1 * 2 + 3 * 6) / 4])  # 2.5, 5.0
    close(out["b"], [(1 * 0 + 3 * 4) / 4])  # 3.0
    assert out["w"].dtype == torch.float32


def test_fedatt_l2_by_hand():
    glob = {"w": t(1, 1), "b": t(0.5)}
    a = {"w": t(4, 5), "b": t(1.5)}  # ||w - w_a|| = ||(-3, -4)|| = 5 ; |b - b_a| = 1
    b = {"w": t(1, 2), "b": t(2.5)}  # ||(0, -1)|| = 1 ; |b - b_b| = 2
    eps = 1.2
    aw = [E**5 / (E**5 + E**1), E**1 / (E**5 + E**1)]
    ab = [E**1 / (E**1 + E**2), E**2 / (E**1 + E**2)]
    exp_w = [
        1 - eps * (aw[0] * (1 - 4) + aw[1] * (1 - 1)),
        1 - eps * (aw[0] * (1 - 5) + aw[1] * (1 - 2)),
    ]
    exp_b = [0.5 - eps * (ab[0] * (0.5 - 1.5) + ab[1] * (0.5 - 2.5))]
    out = fedatt(glob, [a, b], epsilon=eps, norm="l2")
    close(out["w"], exp_w)
    close(out["b"], exp_b)


def test_fedatt_spectral_by_hand():
    glob = {"m": torch.zeros(2, 2), "b": t(0)}
    a = {"m": torch.tensor([[3.0, 0.0], [0.0, 1.0]]), "b": t(1)}  # sigma_max 3 (L2 would be 10**.5)
    b = {"m": torch.tensor([[0.0, 2.0], [0.0, 0.0]]), "b": t(-3)}  # sigma_max 2
    assert layer_distance(glob["m"], a["m"], "spectral") == pytest.approx(3.0)
    assert layer_distance(glob["m"], a["m"], "l2") == pytest.approx(math.sqrt(10))
    eps = 0.7
    am = py_softmax([3.0, 2.0])
    ab = py_softmax([1.0, 3.0])  # 1-D layers use the L2 norm
    out = fedatt(glob, [a, b], epsilon=eps, norm="spectral")
    exp_m = [eps * (am[0] * 3 + am[1] * 0), eps * am[1] * 2, 0.0, eps * am[0] * 1]
    close(out["m"].reshape(-1), exp_m)
    close(out["b"], [eps * (ab[0] * 1 + ab[1] * -3)])


def py_attopt_loss(theta, clients):
    """L' = sum_k (log a_k + log d_k), straight from FedAttOpt (Jiang et al. 2020), eqs. 2-5, in
    plain python."""
    n = len(theta)
    s = [sum(x * y for x, y in zip(theta, c, strict=True)) / math.sqrt(n) for c in clients]
    a = py_softmax(s)
    d = [math.sqrt(sum((x - y) ** 2 for x, y in zip(theta, c, strict=True))) for c in clients]
    return sum(math.log(ak) + math.log(dk) for ak, dk in zip(a, d, strict=True))


def test_fedattopt_by_hand():
    # theta = (w, b) = (1, 0 | 1); clients (2, 1 | 0) and (0, 1 | 1); n = 3.
    theta = [1.0, 0.0, 1.0]
    clients = [[2.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    glob = {"w": t(*theta[:2]), "b": t(theta[2])}
    states = [{"w": t(*c[:2]), "b": t(c[2])} for c in clients]
    # Numerical gradient of L' by central differences, in plain python.
    h = 1e-6
    num = []
    for i in range(3):
        up = theta.copy()
        dn = theta.copy()
        up[i] += h
        dn[i] -= h
        num.append((py_attopt_loss(up, clients) - py_attopt_loss(dn, clients)) / (2 * h))
    # The closed form by hand: s = (2, 1)/sqrt 3, d = (sqrt 3, sqrt 2).
    a = py_softmax([2 / math.sqrt(3), 1 / math.sqrt(3)])
    d2 = [3.0, 2.0]
    hand = [
        (clients[0][i] + clients[1][i] - 2 * (a[0] * clients[0][i] + a[1] * clients[1][i]))
        / math.sqrt(3)
        + (theta[i] - clients[0][i]) / d2[0]
        + (theta[i] - clients[1][i]) / d2[1]
        for i in range(3)
    ]
    close(hand, num, tol=1e-6)
    grad = fedattopt_gradient(glob, states)
    close([*grad["w"].tolist(), *grad["b"].tolist()], hand)
    eps = 0.3
    out = fedattopt(glob, states, epsilon=eps)
    close(
        [*out["w"].tolist(), *out["b"].tolist()],
        [x - eps * g for x, g in zip(theta, hand, strict=True)],
    )
    acc = AttOptGradient(glob)
    for st in states:
        acc.add(st)
    assert acc.loss() == pytest.approx(py_attopt_loss(theta, clients), abs=1e-9)


@pytest.mark.parametrize("floor", [0.0, 1.5])
def test_attopt_step_scale_is_the_steps_total_weight(floor):
    """theta' - theta = sum_k c_k u_k: with the phones' deltas on disjoint coordinates each c_k can
    be read off, and their sum is the scale the server reports (FedAvg's is 1)."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(6, generator=gen, dtype=torch.float64)
    deltas = []
    for k, size in enumerate((0.5, 1.0, 4.0)):  # d_k: one below the floor, others above
        u = torch.zeros(6, dtype=torch.float64)
        u[2 * k : 2 * k + 2] = torch.randn(2, generator=gen, dtype=torch.float64)
        deltas.append(u * size / u.norm())
    glob = {"w": theta}
    acc = AttOptGradient(glob, distance_floor=floor)
    for u in deltas:
        acc.add({"w": theta + u})
    eps = 0.7
    moved = acc.result(eps)["w"] - theta
    weights = [float(moved @ u / (u @ u)) for u in deltas]
    scale = attopt_step_scale(eps, [float(u.norm()) for u in deltas], floor)
    assert sum(weights) == pytest.approx(scale, rel=1e-9)
    d_eff = [max(size, floor) for size in (0.5, 1.0, 4.0)]
    assert scale == pytest.approx(eps * sum(1 / d**2 for d in d_eff))
    assert attopt_step_scale(eps, [0.0, 2.0]) == pytest.approx(eps / 4)  # at the server: no term


def py_js_softmax(x, y):
    p = py_softmax(x)
    q = py_softmax(y)
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl = lambda u, v: sum(a * math.log(a / b) for a, b in zip(u, v, strict=True))  # noqa: E731
    return kl(p, m) / 2 + kl(q, m) / 2


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_fedmed_adaptive_by_hand(eta):
    glob = {"w": t(0, 0), "b": t(0.3)}
    a = {"w": t(1, 0), "b": t(0.7)}
    b = {"w": t(0, 3), "b": t(-1)}
    ja = py_js_softmax([0, 0], [1, 0])
    jb = py_js_softmax([0, 0], [0, 3])
    assert js_divergence_softmax(glob["w"], a["w"]) == pytest.approx(ja, abs=1e-12)
    gw = py_softmax([ja, jb])
    exp_w = [
        0 - eta * (gw[0] * (0 - 1) + gw[1] * (0 - 0)),
        0 - eta * (gw[0] * (0 - 0) + gw[1] * (0 - 3)),
    ]
    # A 1-element layer maps to the distribution [1]: JS = 0, so gamma = (1/2, 1/2).
    exp_b = [0.3 - eta * (0.5 * (0.3 - 0.7) + 0.5 * (0.3 - (-1)))]
    out = fedmed_adaptive(glob, [a, b], eta=eta)
    close(out["w"], exp_w)
    close(out["b"], exp_b)


# --------------------------------------------------------------------------- invariants


def test_fedavg_of_identical_models_is_that_model(make_states):
    glob, clients = make_states(1)
    out = fedavg(glob, [(clients[0], n) for n in (1, 5, 9)])
    for k, v in clients[0].items():
        if k != "steps":
            torch.testing.assert_close(out[k], v, rtol=0, atol=1e-6)
    assert out["steps"].item() == 4  # non-floating entries come from the global state


def test_fedatt_single_client_epsilon_one_returns_client(make_states):
    glob, clients = make_states(1)
    for norm in ("l2", "spectral"):
        out = fedatt(glob, [clients[0]], epsilon=1.0, norm=norm)
        for k, v in clients[0].items():
            if k != "steps":
                torch.testing.assert_close(out[k], v, rtol=0, atol=1e-6)


def test_fedmed_eta_one_single_client_returns_client(make_states):
    glob, clients = make_states(1)
    out = fedmed_adaptive(glob, [clients[0]], eta=1.0)
    torch.testing.assert_close(out["emb.weight"], clients[0]["emb.weight"], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- stacked references


def stack(glob, clients, key):
    return torch.stack([c[key].to(torch.float64) for c in clients]), glob[key].to(torch.float64)


def ref_fedavg(glob, clients, weights):
    w = torch.tensor(weights, dtype=torch.float64)
    out = {}
    for k in ("emb.weight", "rnn.weight", "rnn.bias", "out.bias"):
        x, _ = stack(glob, clients, k)
        out[k] = torch.einsum("k,k...->...", w / w.sum(), x)
    return out


def ref_layerwise(glob, clients, score, step):
    out = {}
    for k in ("emb.weight", "rnn.weight", "rnn.bias", "out.bias"):
        x, g = stack(glob, clients, k)
        s = torch.tensor([score(g, xi) for xi in x], dtype=torch.float64)
        alpha = torch.softmax(s, dim=0)
        out[k] = g - step * torch.einsum("k,k...->...", alpha, g.unsqueeze(0) - x)
    return out


def ref_fedattopt(glob, clients, eps):
    """Autograd on L' over the concatenated vectors: the reference for the closed form."""
    keys = ("emb.weight", "rnn.weight", "rnn.bias", "out.bias")
    theta = torch.cat([glob[k].reshape(-1).to(torch.float64) for k in keys]).requires_grad_(True)
    ths = torch.stack(
        [torch.cat([c[k].reshape(-1).to(torch.float64) for k in keys]) for c in clients]
    )
    n = theta.numel()
    s = ths @ theta / math.sqrt(n)
    loss = (
        torch.log_softmax(s, dim=0).sum()
        + torch.log(torch.linalg.vector_norm(theta - ths, dim=1)).sum()
    )
    (grad,) = torch.autograd.grad(loss, theta)
    new = (theta - eps * grad).detach()
    out_g, out_n, i = {}, {}, 0
    for k in keys:
        m = glob[k].numel()
        out_g[k] = grad[i : i + m].reshape(glob[k].shape)
        out_n[k] = new[i : i + m].reshape(glob[k].shape)
        i += m
    return out_g, out_n


def assert_matches(out, ref, atol=1e-6):
    for k, v in ref.items():
        torch.testing.assert_close(out[k].to(torch.float64), v.to(torch.float64), rtol=0, atol=atol)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_streaming_equals_stacked(make_states, m):
    glob, clients = make_states(m, seed=m)
    weights = [3.0, 1.0, 7.0, 2.0, 5.0][:m]
    assert_matches(
        fedavg(glob, (pair for pair in zip(clients, weights, strict=True))),
        ref_fedavg(glob, clients, weights),
    )
    for norm, fn in (
        ("l2", lambda g, x: torch.linalg.vector_norm(g - x)),
        (
            "spectral",
            lambda g, x: (
                torch.linalg.matrix_norm(g - x, ord=2)
                if x.dim() == 2
                else torch.linalg.vector_norm(g - x)
            ),
        ),
    ):
        out = fedatt(glob, (c for c in clients), epsilon=1.2, norm=norm)
        assert_matches(out, ref_layerwise(glob, clients, fn, 1.2))

    def js(g, x):
        lp, lq = torch.log_softmax(g.reshape(-1), 0), torch.log_softmax(x.reshape(-1), 0)
        mm = (lp.exp() + lq.exp()) / 2
        return 0.5 * (lp.exp() * (lp - mm.log())).sum() + 0.5 * (lq.exp() * (lq - mm.log())).sum()

    assert_matches(
        fedmed_adaptive(glob, iter(clients), eta=0.9), ref_layerwise(glob, clients, js, 0.9)
    )
    ref_grad, ref_new = ref_fedattopt(glob, clients, 0.05)
    assert_matches(fedattopt_gradient(glob, iter(clients)), ref_grad)
    assert_matches(fedattopt(glob, iter(clients), epsilon=0.05), ref_new)


def test_fedattopt_gradient_equals_autograd_large_spread():
    """Scores far apart (a near one-hot softmax) and float64 states still agree with autograd."""
    g = torch.Generator().manual_seed(3)
    glob = {
        "a": torch.randn(40, generator=g, dtype=torch.float64) * 3,
        "b": torch.randn(4, 5, generator=g, dtype=torch.float64),
    }
    clients = [
        {
            k: v * (1 + 0.5 * i) + torch.randn(v.shape, generator=g, dtype=torch.float64)
            for k, v in glob.items()
        }
        for i in range(4)
    ]
    keys = ("a", "b")
    theta = torch.cat([glob[k].reshape(-1) for k in keys]).requires_grad_(True)
    ths = torch.stack([torch.cat([c[k].reshape(-1) for k in keys]) for c in clients])
    s = ths @ theta / math.sqrt(theta.numel())
    loss = (
        torch.log_softmax(s, 0).sum()
        + torch.log(torch.linalg.vector_norm(theta - ths, dim=1)).sum()
    )
    (ref,) = torch.autograd.grad(loss, theta)
    out = fedattopt_gradient(glob, clients)
    got = torch.cat([out[k].reshape(-1) for k in keys])
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_aggregates_consume_iterable_once(make_states):
    glob, clients = make_states(3)
    for fn in (
        lambda it: fedatt(glob, it),
        lambda it: fedmed_adaptive(glob, it),
        lambda it: fedattopt(glob, it),
    ):
        src = OneShot(clients)
        fn(src)
        assert src.iterations == 1
    src = OneShot((c, 1.0) for c in clients)
    fedavg(glob, src)
    assert src.iterations == 1


def test_order_insensitive_values(make_states):
    glob, clients = make_states(4, seed=11)
    weights = [1.0, 2.0, 3.0, 4.0]
    pairs = list(zip(clients, weights, strict=True))
    assert_matches(fedavg(glob, pairs[::-1]), fedavg(glob, pairs))
    assert_matches(fedatt(glob, clients[::-1]), fedatt(glob, clients))
    assert_matches(fedmed_adaptive(glob, clients[::-1]), fedmed_adaptive(glob, clients))
    assert_matches(fedattopt(glob, clients[::-1], 0.01), fedattopt(glob, clients, 0.01))


# --------------------------------------------------------------------------- building blocks


def test_online_softmax_is_stable_and_exact():
    scores = [1000.0, -500.0, 1001.0, 3.0, 1000.5]
    xs = [torch.full((3,), float(i + 1), dtype=torch.float64) for i in range(5)]
    acc = OnlineSoftmaxSum()
    for s, x in zip(scores, xs, strict=True):
        acc.add(s, {"x": x})
    w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
    ref = sum(wi * x for wi, x in zip(w, xs, strict=True))
    torch.testing.assert_close(acc.result()["x"], ref)
    assert [acc.weight_of(s) for s in scores] == pytest.approx(w.tolist())
    assert len(acc.acc) == 1  # one buffer whatever the number of terms
    assert acc.log_normalizer() == pytest.approx(float(torch.logsumexp(torch.tensor(scores), 0)))


def test_layerwise_attention_weights_sum_to_one(make_states):
    glob, clients = make_states(4)
    att = LayerwiseAttention(glob, LayerwiseAttention.fedatt_scorer("l2"))
    for i, c in enumerate(clients):
        att.add(c, tag=f"d{i}")
    weights = att.weights()
    for k in ("emb.weight", "rnn.bias"):
        assert sum(w[k] for _, w in weights) == pytest.approx(1.0)
    assert [tag for tag, _ in weights] == ["d0", "d1", "d2", "d3"]


def test_model_distance_and_dtype(make_states):
    glob, clients = make_states(1)
    ref = math.sqrt(
        sum(float(((glob[k] - clients[0][k]).double() ** 2).sum()) for k in glob if k != "steps")
    )
    assert model_distance(glob, clients[0]) == pytest.approx(ref)
    g64 = {k: v.double() if v.is_floating_point() else v for k, v in glob.items()}
    out = fedatt(g64, clients)
    assert out["emb.weight"].dtype == torch.float64
    assert out["steps"].dtype == torch.int64


def test_bad_updates_are_rejected(make_states):
    glob, clients = make_states(1)
    missing = {k: v for k, v in clients[0].items() if k != "rnn.bias"}
    with pytest.raises(ValueError, match="missing"):
        fedatt(glob, [missing])
    wrong = dict(clients[0], **{"rnn.bias": torch.zeros(5)})
    with pytest.raises(ValueError, match="shape"):
        fedavg(glob, [(wrong, 1.0)])
    nan = dict(clients[0], **{"rnn.bias": torch.full((6,), float("nan"))})
    with pytest.raises(ValueError, match="finite"):
        fedatt(glob, [nan])
    with pytest.raises(ValueError, match="norm"):
        fedatt(glob, clients, norm="l1")
    with pytest.raises(ValueError, match="zero"):
        fedavg(glob, [(clients[0], 0.0)])


def test_fedattopt_zero_distance_client_is_skipped_in_distance_term(make_states):
    glob, clients = make_states(1)
    same = {k: v.clone() for k, v in glob.items()}
    acc = AttOptGradient(glob)
    acc.add(same, "same")
    acc.add(clients[0], "other")
    assert acc.zero_distance == 1
    assert acc.loss() == -math.inf
    grad = acc.gradient()
    assert all(torch.isfinite(g).all() for g in grad.values())
