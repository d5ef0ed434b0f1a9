"""DP-FTRL's round mechanisms (fedkey.federation.privacy.ftrl): the separation rule they enforce,
the state a restarted server resumes from, and the BLT's factorization fixed with b."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedkey.federation.config import DPMechanism, PrivacyConfig
from fedkey.federation.privacy.ftrl import BLTMechanism, FTRLMechanism, TreeMechanism
from fedkey.federation.privacy.tree import prefix_nodes
from tests.federation.privacy.test_mechanism import make_fed, round_inputs


def ftrl(mechanism: DPMechanism, **kw) -> PrivacyConfig:
    return PrivacyConfig(
        clip_norm=0.05, noise_multiplier=0.5, mechanism=mechanism, secret="ftrl test", **kw
    )


@pytest.mark.parametrize("name, cls", [("tree", TreeMechanism), ("blt", BLTMechanism)])
def test_no_phone_trains_twice_within_b_rounds(tmp_path, name, cls):
    """12 phones, cohorts of 3: b defaults to floor(12 / 3) = 4, and the cohort of every round
    leaves out the phones of the last 3."""
    fed = make_fed(tmp_path, ftrl(name))
    mechanism = fed.privacy.mechanism
    assert isinstance(mechanism, cls) and mechanism.accountant.min_separation == 4
    last: dict[str, int] = {}
    for r in range(1, 10):
        plan, updates, new_state, bounded = round_inputs(fed)
        assert all(r - last[d] >= 4 for d in plan.cohort if d in last)
        _, dp = mechanism.add_noise(plan, updates, new_state, bounded, fed.global_state)
        assert dp is not None and dp["min_separation"] == 4
        assert dp["max_participations"] == -(-r // 4)
        last.update(dict.fromkeys(plan.cohort, r))
        assert mechanism.last_trained == {d: s for d, s in last.items() if r + 1 - s < 4}
        fed.round = r  # the engine's round counter: the next plan is round r + 1


def test_a_configured_b_the_population_cannot_fill_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--dp-min-separation 5"):
        make_fed(tmp_path, ftrl("tree", min_separation=5))  # 5 x 3 > 12 phones


@pytest.mark.parametrize("name", ["tree", "blt"])
def test_a_restored_mechanism_draws_the_next_rounds_noise_bit_for_bit(tmp_path, name):
    fed = make_fed(tmp_path / "a", ftrl(name))
    mechanism = fed.privacy.mechanism
    assert isinstance(mechanism, FTRLMechanism)
    for r in range(1, 4):
        mechanism.add_noise(*round_inputs(fed), fed.global_state)
        fed.round = r
    state = json.loads(json.dumps(mechanism.state_dict()))  # as the checkpoint holds it
    assert set(state) == {"accountant", "secret", name}
    assert state[name]["last_trained"] == mechanism.last_trained
    restored = make_fed(tmp_path / "b", ftrl(name)).privacy.mechanism
    assert isinstance(restored, FTRLMechanism)
    restored.load_state_dict(state)
    assert restored.last_trained == mechanism.last_trained
    assert restored.accountant.rho == mechanism.accountant.rho > 0
    template = {k: v for k, v in fed.global_state.items() if v.is_floating_point()}
    a, b = mechanism.noise.release(template, 0.1), restored.noise.release(template, 0.1)
    assert a is not None and b is not None
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_mechanism_refuses_the_others_state(tmp_path):
    tree = make_fed(tmp_path / "tree", ftrl("tree")).privacy.mechanism
    blt = make_fed(tmp_path / "blt", ftrl("blt")).privacy.mechanism
    with pytest.raises(ValueError, match="--dp-mechanism tree"):
        blt.load_state_dict(tree.state_dict())
    with pytest.raises(ValueError, match="--dp-mechanism blt"):
        tree.load_state_dict(blt.state_dict())


def test_the_tree_row_counts_the_nodes_of_the_release(tmp_path):
    fed = make_fed(tmp_path, ftrl("tree"))
    mechanism = fed.privacy.mechanism
    for r in range(1, 8):
        _, dp = mechanism.add_noise(*round_inputs(fed), fed.global_state)
        assert dp is not None and dp["tree_nodes"] == len(prefix_nodes(r)) == bin(r).count("1")
        assert dp["release_noise_std"] == pytest.approx(mechanism.noise.release_std())
        fed.round = r


def test_the_blt_noise_uses_the_factorization_b_fixes(tmp_path):
    fed = make_fed(tmp_path, ftrl("blt"))
    mechanism = fed.privacy.mechanism
    assert isinstance(mechanism, BLTMechanism)
    assert mechanism.noise.blt is mechanism.accountant.blt  # fixed with b = 4 at the start
    assert mechanism.noise.blt.min_separation <= 4
    restored = make_fed(tmp_path / "b", ftrl("blt")).privacy.mechanism
    assert isinstance(restored, BLTMechanism)
    restored.load_state_dict(mechanism.state_dict())
    assert restored.noise.blt == mechanism.noise.blt
    rng = np.random.default_rng(0)
    assert len(restored.cohort(1, sorted(fed.strategy.client_sizes), rng) or []) == 3
