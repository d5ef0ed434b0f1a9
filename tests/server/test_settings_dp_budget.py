"""--dp-noise-multiplier left out is "not given" (None): with --dp-target-epsilon under DP the
engine calibrates z (fedkey.federation.privacy.calibrate), else z is 1.0; a z given is kept."""

from __future__ import annotations

import os

import pytest

from fedkey.federation.privacy.calibrate import needs_calibration, noise_multiplier_of
from fedkey.server.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No FEDKEY_ variable in the environment (Settings would read it)."""
    for name in list(os.environ):
        if name.upper().startswith("FEDKEY_"):
            monkeypatch.delenv(name)


def test_a_target_without_z_leaves_z_to_the_calibration():
    asked = Settings(dp_clip=0.05, dp_target_epsilon=4.0).privacy_config()
    assert asked.noise_multiplier is None and needs_calibration(asked)
    given = Settings(dp_clip=0.05, dp_target_epsilon=4.0, dp_noise_multiplier=0.8)
    assert given.privacy_config().noise_multiplier == 0.8
    assert not needs_calibration(given.privacy_config())
    for plain in (Settings(dp_clip=0.05), Settings(dp_target_epsilon=4.0)):  # no target; no DP
        assert not needs_calibration(plain.privacy_config())
        assert noise_multiplier_of(plain.privacy_config()) == 1.0


def test_the_count_noise_is_checked_against_the_z_given_or_the_default_now():
    adaptive = dict(dp_clip=0.05, dp_clip_quantile=0.5, dp_clip_count_stddev=0.5)
    with pytest.raises(ValueError, match="too small for --dp-noise-multiplier 1:"):
        Settings(**adaptive)  # the default z, 1.0
    Settings(**adaptive, dp_noise_multiplier=0.4)
    # Calibrating: against the z found, which calibration keeps below sigma_b / s_b.
    assert needs_calibration(Settings(**adaptive, dp_target_epsilon=4.0).privacy_config())
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Settings(dp_clip=0.05, dp_noise_multiplier=-1.0)
