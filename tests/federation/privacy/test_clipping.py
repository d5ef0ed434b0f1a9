"""The round's clip rule (fedkey.federation.privacy.clipping): the fixed clip S at z, or adaptive
clipping's C_t (Andrew et al. 2021, Algorithm 1) with z_u and its count noise from the secret."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.privacy.adaptive_clip import update_noise_multiplier
from fedkey.federation.privacy.clipping import AdaptiveClipping, FixedClip
from fedkey.federation.privacy.secret import RunSecret
from tests.federation.privacy.test_mechanism import make_fed, round_inputs

ADAPTIVE = PrivacyConfig(clip_norm=0.05, noise_multiplier=1.0, clip_quantile=0.5, secret="clip")
#: sigma_b given: 40 phones' cohorts of 10 would default it to 0.5, too small for z = 1.
RUN = replace(ADAPTIVE, clip_count_stddev=2.0)


def test_the_fixed_clip_is_s_at_z_and_remembers_nothing():
    clip = FixedClip(FederationConfig(privacy=PrivacyConfig(clip_norm=0.3, noise_multiplier=2.0)))
    assert clip.norm == 0.3 and clip.noise_multiplier() == 2.0 and clip.ready
    assert clip.count_stddev is None and not clip.observe(100)
    assert clip.start_info() == {} and clip.state_dict() == {}
    clip.load_state_dict({"accountant": {"steps": 3}})  # a fixed-clip run resumes
    with pytest.raises(ValueError, match="--dp-clip-quantile 0.5"):
        clip.load_state_dict({"accountant": {}, "clip": {"norm": 1.0, "quantile": 0.5}})
    assert FixedClip(FederationConfig()).norm is None  # no DP: nothing clips


def test_the_default_count_noise_is_fixed_once_by_the_first_population():
    config = FederationConfig(fraction=0.25, privacy=ADAPTIVE)
    clip = AdaptiveClipping(config, RunSecret(passphrase="clip"))
    assert not clip.ready
    with pytest.raises(RuntimeError, match="not fixed"):
        clip.noise_multiplier()
    assert clip.observe(400)  # cohorts of 100: sigma_b = 100 / 20
    assert clip.count_stddev == 5.0 and clip.ready
    assert not clip.observe(800)  # fixed for the run
    assert clip.count_stddev == 5.0
    assert clip.noise_multiplier() == update_noise_multiplier(1.0, 5.0, 1.0) > 1.0
    assert clip.start_info() == {"clip": 0.05, "clip_quantile": 0.5}


def test_the_clip_steps_alike_from_the_same_secret_and_resumes(tmp_path):
    feds = [make_fed(tmp_path / name, RUN, phones=40) for name in ("a", "b")]
    steps = []
    for fed in feds:
        clip = fed.privacy.clip
        assert isinstance(clip, AdaptiveClipping)
        plan, _, _, bounded = round_inputs(fed)
        step = clip.step(plan.round, bounded, 40)
        assert step["clip"] == 0.05 and step["next_clip"] == clip.norm != 0.05
        assert step["update_noise_multiplier"] == clip.noise_multiplier()
        steps.append(step)
    assert steps[0] == steps[1]  # the count's noise: the secret's stream for the round
    state = json.loads(json.dumps(feds[0].privacy.state_dict()))
    restored = make_fed(tmp_path / "c", RUN, phones=40).privacy.clip
    restored.load_state_dict(state)
    assert restored.norm == feds[0].privacy.clip.norm and restored.count_stddev == 2.0
    with pytest.raises(ValueError, match="without --dp-clip-quantile"):
        restored.load_state_dict({"accountant": {"steps": 1}})
    other = make_fed(tmp_path / "d", replace(RUN, clip_count_stddev=3.0), phones=40)
    with pytest.raises(ValueError, match="--dp-clip-count-stddev 2.0"):
        other.privacy.clip.load_state_dict(state)
