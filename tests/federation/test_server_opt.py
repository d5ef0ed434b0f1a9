"""Server optimizers: the FedAvgM and FedAdam steps by hand, and their place in the round engine."""

import pytest
import torch

from fedkey.federation.config import ServerOptConfig
from fedkey.federation.server_opt import ServerOptimizer, adam_step, momentum_step


def test_momentum_step_accumulates_the_pseudo_gradients():
    theta, d1, d2 = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), torch.tensor([1.0, 1.0])
    t1, m1 = momentum_step(theta, d1, None, lr=1.0, beta=0.9)
    assert torch.allclose(t1, torch.tensor([1.5, 1.0])) and torch.equal(m1, d1)
    t2, m2 = momentum_step(t1, d2, m1, lr=0.5, beta=0.9)
    assert torch.allclose(m2, torch.tensor([1.45, 0.1]))  # 0.9 * m1 + d2
    assert torch.allclose(t2, t1 + 0.5 * m2)


def test_adam_step_matches_the_formula():
    theta, delta = torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0.2, -0.4]).double()
    new, m, v = adam_step(theta, delta, None, None, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    assert torch.allclose(m, 0.1 * delta)
    assert torch.allclose(v, 0.99 * 1e-6 + 0.01 * delta**2)
    assert torch.allclose(new, theta + 0.1 * m / (v.sqrt() + 1e-3))
    # Adam's step is about lr * sign(Delta) * (1 - b1) / sqrt(1 - b2) on the first round.
    assert torch.allclose((new - theta).abs(), torch.full((2,), 0.1).double(), rtol=0.06)


def test_plain_momentum_zero_server_step_is_the_strategy_itself():
    g = {"w": torch.tensor([1.0, -1.0]), "n": torch.tensor([3])}
    agg = {"w": torch.tensor([2.0, 0.5]), "n": torch.tensor([3])}
    for opt in (
        ServerOptimizer(ServerOptConfig("none")),
        ServerOptimizer(ServerOptConfig("momentum", lr=1.0, momentum=0.0)),
    ):
        new, _ = opt.step(g, agg)
        assert torch.allclose(new["w"], agg["w"]) and new["w"].dtype == torch.float32
        assert torch.equal(new["n"], g["n"])


def test_step_keeps_nothing_until_commit():
    opt = ServerOptimizer(ServerOptConfig("momentum", lr=1.0, momentum=0.9))
    g, agg = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    new, bufs = opt.step(g, agg)
    assert opt.buffers == {}  # a round that fails now leaves the optimizer untouched
    opt.commit(bufs)
    new2, _ = opt.step(new, {"w": new["w"] + 1})
    assert torch.allclose(new2["w"], torch.full((2,), 1 + 1.9))


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown server optimizer"):
        ServerOptConfig("sgd")


def test_a_server_lr_decay_steps_round_r_at_lr_times_decay_to_the_r_minus_1():
    """--server-lr-decay d: round r steps with server lr * d^(r-1), read from the round number
    alone (a resumed run needs nothing else); d = 1 is the constant lr."""
    g, agg = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    opt = ServerOptimizer(ServerOptConfig("momentum", lr=2.0, momentum=0.0, lr_decay=0.5))
    assert [opt.lr_at(r) for r in (1, 2, 3)] == [2.0, 1.0, 0.5]
    for r, lr in ((1, 2.0), (3, 0.5)):
        new, _ = opt.step(g, agg, r)  # momentum 0: theta + lr * Delta
        assert torch.allclose(new["w"], torch.full((2,), lr))
    adam = ServerOptimizer(ServerOptConfig("adam", lr=0.1, lr_decay=0.5))
    constant = ServerOptimizer(ServerOptConfig("adam", lr=0.025))
    assert torch.allclose(adam.step(g, agg, 3)[0]["w"], constant.step(g, agg, 3)[0]["w"])
    assert ServerOptimizer(ServerOptConfig("adam", lr=0.1)).lr_at(50) == 0.1
