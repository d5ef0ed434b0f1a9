"""The round's noise mechanism (fedkey.federation.privacy.mechanism): without DP, NoPrivacy leaves
every round as the strategy made it; every DP mechanism resumes only with its own secret."""

from __future__ import annotations

import numpy as np
import pytest

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.engine import Federation
from fedkey.federation.influence.bounding import bound_round
from fedkey.federation.privacy.mechanism import AccountedMechanism, NoPrivacy
from fedkey.testing.federation import seeded_updates, tiny_federation


def make_fed(tmp_path, privacy: PrivacyConfig, phones: int = 12, fraction: float = 0.25):
    config = FederationConfig(fraction=fraction, rounds=20, seed=3, privacy=privacy)
    return tiny_federation(tmp_path, config, phones)


def round_inputs(fed: Federation) -> tuple:
    """What the engine hands the mechanism for its next round: the plan, the updates, the
    strategy's aggregate and the bounded round (fedkey.federation.engine.Federation._aggregate)."""
    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    updates = seeded_updates(fed, plan)
    bounded = bound_round(
        fed.config.influence,
        fed.global_state,
        updates,
        fed.privacy.clip_norm(),
        uniform=fed.config.privacy.dp,
    )
    new_state, _ = fed.strategy.aggregate(fed.global_state, bounded, bounded.bound)
    return plan, updates, new_state, bounded


def test_without_dp_the_round_is_the_strategys(tmp_path):
    fed = make_fed(tmp_path, PrivacyConfig())
    mechanism = fed.privacy.mechanism
    assert isinstance(mechanism, NoPrivacy) and fed.privacy.accountant is None
    assert fed.privacy.selection_rng(1) is None  # the run's seed draws the cohort
    plan, updates, new_state, bounded = round_inputs(fed)
    assert fed.privacy.cohort(1, plan.cohort, np.random.default_rng(0)) is None
    noised, dp = fed.privacy.noise(plan, updates, new_state, bounded, fed.global_state)
    assert noised is new_state and dp is None
    assert fed.privacy.row_fields() == dict.fromkeys(
        ("epsilon", "rho", "delta", "noise_reproducible")
    )
    assert fed.privacy.start_info() == {} and not fed.privacy.would_exceed(12)
    assert fed.privacy.state_dict() == {"accountant": None}
    fed.privacy.load_state_dict({"accountant": None})


def test_a_plain_run_refuses_the_state_of_an_adaptive_dp_run(tmp_path):
    fed = make_fed(tmp_path, PrivacyConfig())
    with pytest.raises(ValueError, match="--dp-clip-quantile 0.5"):
        fed.privacy.load_state_dict({"accountant": None, "clip": {"norm": 1.0, "quantile": 0.5}})


@pytest.mark.parametrize("mechanism", ["gaussian", "tree", "blt"])
def test_every_dp_mechanism_resumes_only_with_its_own_secret(tmp_path, mechanism):
    privacy = PrivacyConfig(clip_norm=0.05, noise_multiplier=1.0, mechanism=mechanism)
    fed = make_fed(tmp_path / "a", privacy)
    assert isinstance(fed.privacy.mechanism, AccountedMechanism)
    assert fed.privacy.mechanism.name == mechanism
    state = fed.privacy.state_dict()
    assert state["secret"] == fed.privacy.secret.key().fingerprint
    other = make_fed(tmp_path / "b", privacy)  # its own run directory: no secret.key yet
    with pytest.raises(ValueError, match="secret is gone"):
        other.privacy.load_state_dict(state)
    other.privacy.secret.key()  # now one of its own
    with pytest.raises(ValueError, match="drawn with another secret"):
        other.privacy.load_state_dict(state)
    with pytest.raises(ValueError, match="public seed"):
        other.privacy.load_state_dict({**state, "secret": None})
