"""A budget, not only a stop (fedkey.federation.privacy.calibrate): --dp-target-epsilon without
--dp-noise-multiplier calibrates z before round 1 to the smallest three-digit z whose epsilon
after the planned rounds is within the target, by the run's own accountant; the run then ends
there, records z, keeps it on resume; a z given is untouched; the impossible is one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.engine import Federation
from fedkey.federation.privacy.calibrate import (
    MAX_NOISE_MULTIPLIER,
    grid_index,
    grid_value,
    needs_calibration,
    smallest_noise_multiplier,
    with_noise_multiplier,
)
from fedkey.federation.privacy.round import RoundPrivacy
from fedkey.testing.federation import seeded_updates, tiny_federation

PHONES = 40
FRACTION = 0.1  # cohorts of 4 of 40: the tree's and the BLT's b = 10
TARGET = 4.0

#: The planned rounds per mechanism: the RDP accountant's sampled Gaussian takes ~0.5 s a call.
CASES = {
    "gaussian fixed": ({}, 3),
    "gaussian poisson": ({"sampling": "poisson"}, 3),
    "tree": ({"mechanism": "tree"}, 12),
    "blt": ({"mechanism": "blt"}, 12),
}


def make_fed(tmp_path, privacy: PrivacyConfig, rounds: int) -> Federation:
    config = FederationConfig(fraction=FRACTION, rounds=rounds, seed=5, privacy=privacy)
    return tiny_federation(tmp_path, config, PHONES)


def dp(target: float | None = TARGET, z: float | None = None, **kw) -> PrivacyConfig:
    return PrivacyConfig(
        clip_norm=0.05, noise_multiplier=z, target_epsilon=target, secret="calibrate", **kw
    )


def planned(fed: Federation, z: float) -> float:
    """Epsilon after the planned rounds at z, by a trial of `fed`'s run (its accountant)."""
    trial = RoundPrivacy(
        with_noise_multiplier(fed.privacy.config, z), fed.strategy, fed.privacy.secret
    )
    trial.observe(PHONES)
    return trial.planned_epsilon(fed.config.rounds, PHONES)


def run(fed: Federation) -> list[dict]:
    """Round 0 and the planned rounds while the budget's stop allows them."""
    rows = [fed.start()]
    while fed.round < fed.config.rounds and not fed.budget_spent:
        plan = fed.plan_round(sorted(fed.strategy.client_sizes))
        rows.append(fed.complete_round(plan, seeded_updates(fed, plan)))
    return rows


# --------------------------------------------------------------------------- the search


def test_the_grid_is_every_number_of_three_significant_digits_from_0_001_to_1000():
    assert [grid_value(i) for i in (0, 1, 899, 900, 2700, 2701, 5400)] == [
        0.001, 0.00101, 0.00999, 0.01, 1.0, 1.01, 1000.0,
    ]  # fmt: skip
    for i in range(0, 5401, 7):
        z = grid_value(i)
        assert float(f"{z:.3g}") == z and grid_index(z) == i
        assert grid_index(z * (1 + 1e-9)) == i and (i == 0 or grid_index(z * (1 - 1e-9)) == i - 1)


@pytest.mark.parametrize("root", [0.00123456, 0.0421, 0.999, 1.0, 3.14159, 77.7, 512.3456])
@pytest.mark.parametrize("slope", [0.5, 1.0, 2.0, 3.0])
def test_the_search_finds_the_smallest_grid_z_within_the_target(root, slope):
    calls = []

    def epsilon(z: float) -> float:
        calls.append(z)
        return 2.0 * (root / z) ** slope

    z = smallest_noise_multiplier(epsilon, 2.0)
    i = grid_index(root)
    expected = grid_value(i) if grid_value(i) >= root else grid_value(i + 1)
    assert z == expected
    assert len(calls) <= 16  # a handful, not the grid's 5401


def test_the_search_says_none_when_even_the_limit_is_not_enough():
    assert smallest_noise_multiplier(lambda z: 1.0 / z, 1e-4) is None  # z would be 10^4
    assert smallest_noise_multiplier(lambda z: 1.0 / z, 0.5, limit=1.5) is None
    assert smallest_noise_multiplier(lambda z: 1.0 / z, 0.5, limit=2.5) == 2.0
    assert smallest_noise_multiplier(lambda z: 1e-9 / z, 1.0) == 0.001  # the grid's first


# --------------------------------------------------------------------------- a run's z


@pytest.mark.parametrize("case", list(CASES))
def test_a_target_without_z_calibrates_the_smallest_z_and_the_run_ends_there(tmp_path, case):
    kw, rounds = CASES[case]
    fed = make_fed(tmp_path, dp(**kw), rounds)
    calibrated = fed.privacy.calibration
    assert calibrated is not None and calibrated.rounds == rounds
    assert calibrated.population == PHONES and calibrated.delta == PHONES**-1.1
    z = calibrated.noise_multiplier
    assert float(f"{z:.3g}") == z  # three significant digits
    assert fed.privacy.config.privacy.noise_multiplier == fed.privacy.clip.z == z
    # Within the target and within 1% of it, and the smallest: less noise passes it.
    assert planned(fed, z) == calibrated.epsilon
    assert TARGET * 0.99 <= calibrated.epsilon <= TARGET
    assert planned(fed, z * 0.99) > TARGET
    assert planned(fed, grid_value(grid_index(z) - 1)) > TARGET
    # The run: every planned round, the stop never needed, epsilon what was planned, z in rows.
    rows = run(fed)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    assert rows[-1]["epsilon"] == pytest.approx(calibrated.epsilon, rel=1e-12)
    assert all(r["epsilon"] <= TARGET for r in rows)
    assert all(r["info"]["dp"]["noise_multiplier"] == z for r in rows)  # round 0's too
    assert fed.privacy.state_dict()["calibration"]["noise_multiplier"] == z


def test_adaptive_clipping_calibrates_the_total_z_below_what_its_count_noise_allows(tmp_path):
    # Cohorts of 20 of 200: sigma_b defaults to 20 / 20 = 1, so z must stay below 1.
    config = FederationConfig(
        fraction=0.1, rounds=20, seed=5, privacy=dp(8.0, mechanism="tree", clip_quantile=0.5)
    )
    fed = tiny_federation(tmp_path / "ok", config, 200)
    calibrated = fed.privacy.calibration
    assert calibrated is not None and calibrated.noise_multiplier < 1.0
    assert fed.privacy.clip.max_noise_multiplier() == 1.0
    assert 0.99 * 8.0 <= calibrated.epsilon <= 8.0
    tight = replace(config, privacy=dp(1.0, mechanism="tree", clip_quantile=0.5))
    with pytest.raises(ValueError, match="out of reach of adaptive clipping's count noise") as e:
        tiny_federation(tmp_path / "tight", tight, 200)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- what stays


def test_a_given_z_is_untouched_and_the_target_only_stops_the_run(tmp_path):
    fed = make_fed(tmp_path / "given", dp(z=1.5, mechanism="tree"), 12)
    assert fed.privacy.calibration is None and not fed.privacy.calibrates
    assert fed.privacy.config.privacy.noise_multiplier == fed.privacy.clip.z == 1.5
    assert fed.privacy.accountant is not None and fed.privacy.accountant.noise_multiplier == 1.5
    rows = run(fed)
    assert all(r["info"]["dp"]["noise_multiplier"] == 1.5 for r in rows)
    # At z 1.5 the 11th round would pass the target: the stop ends the run after the 10th.
    assert rows[-1]["round"] == 10 and rows[-1]["epsilon"] <= TARGET
    assert "calibration" not in fed.privacy.state_dict()
    # Without a target (or without DP) nothing is calibrated: z is the default, 1.0.
    for privacy in (dp(target=None), replace(dp(), clip_norm=None)):
        assert not needs_calibration(privacy)
        plain = make_fed(tmp_path / f"plain{privacy.dp}", privacy, 12)
        assert plain.privacy.calibration is None and plain.privacy.clip.z == 1.0


def test_the_impossible_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="give --rounds") as e:
        make_fed(tmp_path / "a", dp(mechanism="tree"), 0)
    with pytest.raises(ValueError, match="out of reach: even --dp-noise-multiplier 1000") as e:
        make_fed(tmp_path / "b", dp(1e-3, mechanism="tree", delta=1e-10), 12)
    assert "\n" not in str(e.value)
    assert MAX_NOISE_MULTIPLIER == 1000


# --------------------------------------------------------------------------- servers, resumes


def test_a_server_calibrates_at_its_first_phones_and_a_resume_keeps_the_z(tmp_path):
    config = FederationConfig(fraction=FRACTION, rounds=12, seed=5, privacy=dp(mechanism="blt"))
    fed = tiny_federation(tmp_path / "a", config, PHONES)
    rows = run(fed)
    state = fed.privacy.state_dict()
    z = state["calibration"]["noise_multiplier"]
    # A server knows no phones at first: z is pending (round 0 says null), nothing is spent.
    server = RoundPrivacy(config, fed.strategy, fed.privacy.secret)
    assert server.calibration is None and server.start_info()["dp"]["noise_multiplier"] is None
    assert not server.would_exceed(PHONES)
    # It resumes at the z it calibrated, whatever its phones now (no calibration is run again).
    server.load_state_dict(state)
    assert server.calibration is not None and server.calibration.noise_multiplier == z
    assert server.config.privacy.noise_multiplier == z and server.accountant is not None
    assert server.accountant.epsilon == rows[-1]["epsilon"]
    server.observe(3 * PHONES)
    assert server.config.privacy.noise_multiplier == z
    # A z given that is not the one calibrated is refused, as is calibrating a run noised at one.
    other = RoundPrivacy(replace(config, privacy=dp(z=2 * z, mechanism="blt")), fed.strategy)
    with pytest.raises(ValueError, match=f"calibrated to {z:g}.*no --dp-noise-multiplier"):
        other.load_state_dict(state)
    given = make_fed(tmp_path / "b", dp(z=1.5, mechanism="blt"), 12)
    assert len(run(given)) > 1
    with pytest.raises(
        ValueError, match="not calibrated: resume it with --dp-noise-multiplier 1.5"
    ):
        RoundPrivacy(config, fed.strategy, given.privacy.secret).load_state_dict(
            given.privacy.state_dict()
        )
