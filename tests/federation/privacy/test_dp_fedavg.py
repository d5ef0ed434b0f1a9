"""DP-FedAvg's gaussian mechanism (fedkey.federation.privacy.dp_fedavg): N(0, (z Delta)^2) on the
aggregate from the secret's stream for the round, the RDP accountant stepped for what was drawn,
and Poisson cohorts where the analysis samples them (McMahan et al. 2018)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkey.federation.config import PrivacyConfig
from fedkey.federation.privacy.dp_fedavg import GaussianMechanism
from fedkey.federation.privacy.gaussian import PrivacyAccountant, add_gaussian_noise
from fedkey.federation.privacy.mechanism import FLOAT32_MARGIN
from tests.federation.privacy.test_mechanism import make_fed, round_inputs

DP = PrivacyConfig(clip_norm=0.05, noise_multiplier=0.5, secret="gaussian test")


def test_the_noise_is_z_times_the_sensitivity_from_the_secrets_stream_for_the_round(tmp_path):
    feds = [make_fed(tmp_path / name, DP) for name in ("a", "b")]  # one passphrase: one secret
    rows = []
    for fed in feds:
        mechanism = fed.privacy.mechanism
        assert isinstance(mechanism, GaussianMechanism)
        plan, updates, new_state, bounded = round_inputs(fed)
        noised, dp = mechanism.add_noise(plan, updates, new_state, bounded, fed.global_state)
        assert dp is not None and dp["mechanism"] == "gaussian" and dp["sampling"] == "fixed"
        assert dp["noise_std"] == 0.5 * dp["sensitivity"] * FLOAT32_MARGIN
        unit = fed.privacy.secret.key().normal_state(new_state, "gaussian", plan.round)
        expected = add_gaussian_noise(new_state, dp["noise_std"], unit)
        assert all(torch.equal(noised[k], expected[k]) for k in expected)
        # The accountant composed one sampled round of m = 3 of N = 12 phones.
        reference = PrivacyAccountant(0.5, delta=None)
        reference.step(12, len(plan.cohort))
        assert mechanism.accountant.epsilon == reference.epsilon > 0
        rows.append(noised)
    assert all(torch.equal(rows[0][k], rows[1][k]) for k in rows[0])  # the same bits


def test_poisson_cohorts_take_each_phone_with_probability_q(tmp_path):
    fed = make_fed(tmp_path, PrivacyConfig(clip_norm=0.05, sampling="poisson"), fraction=0.5)
    mechanism = fed.privacy.mechanism
    phones = [f"p{i:03d}" for i in range(400)]
    rng = np.random.default_rng(0)
    sizes = []
    for r in range(1, 21):
        cohort = mechanism.cohort(r, phones, rng)
        assert cohort is not None and cohort == sorted(set(cohort)) and set(cohort) <= set(phones)
        sizes.append(len(cohort))
    assert np.mean(sizes) == pytest.approx(200, rel=0.05)
    assert len(set(sizes)) > 1  # not a fixed size
    fixed = make_fed(tmp_path / "fixed", DP).privacy.mechanism
    assert fixed.cohort(1, phones, rng) is None  # fixed-size cohorts: the strategy's


def test_the_budget_stop_looks_one_round_ahead(tmp_path):
    fed = make_fed(
        tmp_path, PrivacyConfig(clip_norm=0.05, noise_multiplier=1.0, target_epsilon=2.0)
    )
    mechanism = fed.privacy.mechanism
    assert isinstance(mechanism, GaussianMechanism)
    steps = 0
    while not mechanism.would_exceed(12):
        mechanism.accountant.step(12, 3)
        steps += 1
    assert steps > 0 and mechanism.accountant.epsilon <= 2.0
    mechanism.accountant.step(12, 3)
    assert mechanism.accountant.epsilon > 2.0
