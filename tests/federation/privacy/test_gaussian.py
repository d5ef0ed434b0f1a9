"""Privacy: the seed papers' randomization, the Gaussian noise, the RDP accountant against
dp_accounting's own answer for the same events."""

import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from fedkey.common.noise import randomize
from fedkey.federation.privacy.gaussian import PrivacyAccountant, add_gaussian_noise
from fedkey.federation.privacy.secret import SecretKey

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


def test_gaussian_noise_has_configured_std():
    state = {"w": torch.zeros(N // 2, 2)}
    noisy = add_gaussian_noise(state, 0.55, SecretKey.fresh().normal_state(state, "round", 1))
    assert noisy["w"].std().item() == pytest.approx(0.55, rel=0.01)
    assert add_gaussian_noise(state, 0.0)["w"] is state["w"]
    with pytest.raises(ValueError):
        add_gaussian_noise(state, -1.0)


def library_epsilon(relation, events, delta=1e-5):
    acc = RdpAccountant(neighboring_relation=relation)
    for event, count in events:
        acc.compose(event, count)
    return acc.get_epsilon(delta)


def wor(n, m, z):
    return dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z))


def test_fixed_size_cohorts_are_accounted_as_sampling_without_replacement():
    """What the server does by default: m of N phones without replacement, replace-one."""
    acc = PrivacyAccountant(noise_multiplier=1.1, sampling="fixed")
    assert acc.epsilon == 0.0 and not acc.exhausted
    for _ in range(20):
        acc.step(population=100, cohort=10)
    rel = dp_accounting.NeighboringRelation.REPLACE_ONE
    assert acc.steps == 20
    assert acc.epsilon == pytest.approx(library_epsilon(rel, [(wor(100, 10, 1.1), 20)]), rel=1e-12)
    # Phones enroll: later rounds draw from a larger population; each round is its own event.
    for _ in range(5):
        acc.step(population=120, cohort=12)
    expected = library_epsilon(rel, [(wor(100, 10, 1.1), 20), (wor(120, 12, 1.1), 5)])
    assert acc.epsilon == pytest.approx(expected, rel=1e-12)
    lib = RdpAccountant(neighboring_relation=rel)
    lib.compose(acc.dp_event())
    assert acc.epsilon == pytest.approx(lib.get_epsilon(1e-5), rel=1e-12)
    with pytest.raises(ValueError, match="cannot be accounted"):
        acc.step(population=5, cohort=6)


def test_poisson_cohorts_are_accounted_as_poisson_sampling():
    acc = PrivacyAccountant(noise_multiplier=1.1, sampling="poisson", sampling_rate=0.1)
    for _ in range(50):
        acc.step(population=100, cohort=7)  # the realized size does not enter the analysis
    event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1))
    rel = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    assert acc.epsilon == pytest.approx(library_epsilon(rel, [(event, 50)]), rel=1e-12)


def test_sampling_without_replacement_costs_more_than_poisson_at_the_same_rate():
    """Replace-one adjacency is the stronger one: the honest epsilon of a fixed-size cohort is
    larger than the Poisson figure the server used to report for it."""
    fixed, poisson = PrivacyAccountant(1.0), PrivacyAccountant(1.0, "poisson", 0.1)
    for _ in range(30):
        fixed.step(100, 10)
        poisson.step(100, 10)
    assert fixed.epsilon > poisson.epsilon > 0


def test_accountant_budget_and_state_dict():
    rel = dp_accounting.NeighboringRelation.REPLACE_ONE
    eps_5 = library_epsilon(rel, [(wor(50, 10, 1.0), 5)])
    acc = PrivacyAccountant(1.0, "fixed", delta=1e-5, target_epsilon=eps_5 + 1e-9)
    for _ in range(4):
        acc.step(50, 10)
    assert not acc.exhausted and not acc.would_exceed(50, 10)
    acc.step(50, 10)
    assert not acc.exhausted and acc.would_exceed(50, 10)
    acc.step(50, 10)
    assert acc.exhausted
    restored = PrivacyAccountant(1.0, "fixed", delta=1e-5, target_epsilon=eps_5)
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.steps == 6 and restored.epsilon == acc.epsilon
    assert PrivacyAccountant(0.0).step(10, 1) == math.inf
    with pytest.raises(ValueError, match="poisson"):
        PrivacyAccountant(1.0, "poisson", 0.1).load_state_dict(acc.state_dict())


def test_older_poisson_spend_resumes_only_as_poisson():
    legacy = {"steps": 7, "noise_multiplier": 1.0, "sampling_rate": 0.1, "delta": 1e-5}
    acc = PrivacyAccountant(1.0, "poisson", 0.1)
    acc.load_state_dict(legacy)
    assert acc.steps == 7
    with pytest.raises(ValueError, match="--dp-sampling poisson"):
        PrivacyAccountant(1.0, "fixed").load_state_dict(legacy)
