"""Privacy: the seed papers' randomization, clipping, calibrated Gaussian noise, the RDP
accountant."""

import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from common.noise import randomize
from server.privacy import (
    DPConfig,
    PrivacyAccountant,
    add_gaussian_noise,
    clip_update,
    clip_updates,
    dp_fedavg,
    noise_std,
    update_norm,
)
from server.strategies import ClientUpdate

N = 400_000  # standard error of an estimated std: about 1 / sqrt(2N) = 0.11 %


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_randomize_std_and_off_switch():
    state = {"w": torch.zeros(N), "step": torch.tensor(3)}
    same = randomize(state, beta=0.0, generator=gen())
    assert same["w"] is state["w"] and same["step"] is state["step"]
    noisy = randomize(state, beta=0.01, sigma=2.0, generator=gen(1))
    assert noisy["w"].std().item() == pytest.approx(0.02, rel=0.01)
    assert abs(noisy["w"].mean().item()) < 0.02 * 5 / math.sqrt(N)
    assert noisy["step"] is state["step"] and noisy["w"].dtype == torch.float32
    again = randomize(state, beta=0.01, sigma=2.0, generator=gen(1))
    assert torch.equal(noisy["w"], again["w"])  # deterministic under the generator
    with pytest.raises(ValueError):
        randomize(state, beta=-1.0)


def test_clip_update_bounds_norm_and_keeps_small_updates():
    glob = {"a": torch.ones(3, 4), "b": torch.zeros(5), "n": torch.tensor(1)}
    big = {"a": glob["a"] + 2.0, "b": torch.full((5,), -1.0), "n": torch.tensor(7)}
    norm = math.sqrt(12 * 4 + 5 * 1)
    clipped, orig = clip_update(glob, big, clip_norm=1.5)
    assert orig == pytest.approx(norm)
    assert update_norm(glob, clipped) == pytest.approx(1.5, rel=1e-6)
    # The direction is kept: the clipped delta is the original delta times S / ||u||.
    torch.testing.assert_close(clipped["a"] - glob["a"], (big["a"] - glob["a"]) * 1.5 / norm)
    assert clipped["n"] is big["n"]
    small = {"a": glob["a"] + 0.01, "b": glob["b"], "n": torch.tensor(7)}
    kept, orig = clip_update(glob, small, clip_norm=1.5)
    assert kept["a"] is small["a"] and orig < 1.5


def test_clip_updates_stream():
    glob = {"a": torch.zeros(4)}
    ups = (ClientUpdate({"a": torch.full((4,), float(i))}, 1, 0.0, f"d{i}") for i in range(3))
    norms = []
    out = list(clip_updates(glob, ups, 1.0, norms))
    assert norms == pytest.approx([0.0, 2.0, 4.0])
    assert [u.device_id for u in out] == ["d0", "d1", "d2"]
    assert all(update_norm(glob, u.state) <= 1.0 + 1e-6 for u in out)


def test_gaussian_noise_has_configured_std():
    assert noise_std(clip_norm=2.0, noise_multiplier=1.1, num_updates=4) == pytest.approx(0.55)
    state = {"w": torch.zeros(N // 2, 2)}
    noisy = add_gaussian_noise(state, 0.55, gen(2))
    assert noisy["w"].std().item() == pytest.approx(0.55, rel=0.01)
    assert add_gaussian_noise(state, 0.0)["w"] is state["w"]


def test_dp_fedavg_clips_averages_and_noises():
    glob = {"w": torch.zeros(N), "b": torch.ones(3)}
    clients = [{"w": torch.full((N,), 1.0 * (i + 1)), "b": torch.ones(3)} for i in range(4)]
    cfg = DPConfig(clip_norm=1.0, noise_multiplier=1.0)
    new, info = dp_fedavg(glob, iter(clients), cfg, gen(3))
    assert info["num_updates"] == 4 and info["clipped_fraction"] == 1.0
    assert info["noise_std"] == pytest.approx(1.0 * 1.0 / 4)
    # Every clipped delta is the same vector of norm 1 (all entries 1/sqrt(N)); noise std z S / m.
    expected_mean = 1.0 / math.sqrt(N)
    noise = new["w"].double() - expected_mean
    assert noise.std().item() == pytest.approx(0.25, rel=0.01)
    assert abs(noise.mean().item()) < 0.25 * 5 / math.sqrt(N)
    quiet, _ = dp_fedavg(glob, clients, DPConfig(clip_norm=1.0, noise_multiplier=0.0))
    assert update_norm(glob, quiet) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError):
        DPConfig(clip_norm=0.0, noise_multiplier=1.0)


def direct_epsilon(z, q, steps, delta):
    acc = RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def test_accountant_matches_dp_accounting():
    acc = PrivacyAccountant(noise_multiplier=1.1, sampling_rate=0.1, delta=1e-5)
    assert acc.epsilon == 0.0 and not acc.exhausted
    for _ in range(20):
        acc.step()
    assert acc.steps == 20
    assert acc.epsilon == pytest.approx(direct_epsilon(1.1, 0.1, 20, 1e-5), rel=1e-12)
    acc.step(30)
    assert acc.epsilon == pytest.approx(direct_epsilon(1.1, 0.1, 50, 1e-5), rel=1e-12)
    assert not acc.exhausted  # no target


def test_accountant_budget_and_state_dict():
    eps_5 = direct_epsilon(1.0, 0.2, 5, 1e-5)
    acc = PrivacyAccountant.from_config(
        DPConfig(clip_norm=1.0, noise_multiplier=1.0, target_epsilon=eps_5 + 1e-9), 0.2
    )
    for _ in range(4):
        acc.step()
    assert not acc.exhausted and not acc.would_exceed()
    acc.step()
    assert not acc.exhausted and acc.would_exceed()
    acc.step()
    assert acc.exhausted
    restored = PrivacyAccountant(1.0, 0.2, 1e-5, eps_5)
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.steps == 6 and restored.epsilon == acc.epsilon
    assert PrivacyAccountant(0.0, 0.1).step() == math.inf
