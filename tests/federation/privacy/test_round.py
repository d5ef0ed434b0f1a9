"""A round's DP as the engine composes it (fedkey.federation.privacy.round): one mechanism class
per --dp-mechanism, and the server state's layout a restarted server reads back."""

from __future__ import annotations

import pytest

from fedkey.common.config import DP_MECHANISMS, FTRL_MECHANISMS
from fedkey.federation.config import PrivacyConfig
from fedkey.federation.privacy.clipping import AdaptiveClipping, FixedClip
from fedkey.federation.privacy.ftrl import FTRLMechanism
from fedkey.federation.privacy.round import MECHANISMS
from tests.federation.privacy.test_mechanism import make_fed


def test_every_dp_mechanism_has_one_class():
    assert tuple(MECHANISMS) == DP_MECHANISMS
    assert all(cls.name == name for name, cls in MECHANISMS.items())
    ftrl = tuple(name for name, cls in MECHANISMS.items() if issubclass(cls, FTRLMechanism))
    assert ftrl == FTRL_MECHANISMS  # no sampling, the separation rule


@pytest.mark.parametrize(
    "privacy, keys",
    [
        (PrivacyConfig(), {"accountant"}),
        (PrivacyConfig(clip_norm=0.05), {"accountant", "secret"}),
        (PrivacyConfig(clip_norm=0.05, mechanism="tree"), {"accountant", "secret", "tree"}),
        (
            PrivacyConfig(clip_norm=0.05, mechanism="blt", clip_quantile=0.5, noise_multiplier=0),
            {"accountant", "secret", "blt", "clip"},
        ),
    ],
)
def test_the_server_state_holds_what_the_run_uses(tmp_path, privacy, keys):
    fed = make_fed(tmp_path, privacy)
    state = fed.privacy.state_dict()
    assert set(state) == keys
    assert isinstance(fed.privacy.clip, AdaptiveClipping if "clip" in keys else FixedClip)
    assert fed.privacy.accountant is fed.privacy.mechanism.accountant
    fed.privacy.load_state_dict(state)  # a run resumes from its own state


def test_adaptive_clipping_gives_the_ftrl_noise_and_accountant_z_u(tmp_path):
    privacy = PrivacyConfig(
        clip_norm=0.05, noise_multiplier=1.0, mechanism="tree", clip_quantile=0.5,
        clip_count_stddev=2.0,
    )  # fmt: skip
    fed = make_fed(tmp_path, privacy)
    mechanism = fed.privacy.mechanism
    assert isinstance(mechanism, FTRLMechanism)
    z_u = fed.privacy.clip.noise_multiplier()
    assert z_u > 1.0
    assert mechanism.noise.noise_multiplier == mechanism.accountant.noise_multiplier == z_u
    assert mechanism.accountant.count_stddev == 2.0
    assert fed.privacy.start_info()["dp"] == {
        "mechanism": "tree",
        "noise_multiplier": 1.0,
        "min_separation": 4,
        "clip": 0.05,
        "clip_quantile": 0.5,
    }
