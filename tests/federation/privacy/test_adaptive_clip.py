"""Adaptive clipping (fedkey.federation.privacy.adaptive_clip, Andrew et al. 2021) and production's delta: the clip
finds the quantile of the update norms, the update noise z_u keeps the total at z (the gaussian
mechanism's accounting unchanged, the tree's plus the counts), a resumed run gives the same
weights, delta defaults to 1/N^1.1, and what cannot run is refused in one line."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from pydantic import ValidationError

from fedkey.federation.config import FederationConfig, PrivacyConfig, dp_problem
from fedkey.federation.privacy.adaptive_clip import (
    AdaptiveClip,
    count_sensitivity,
    count_stddev_problem,
    update_noise_multiplier,
)
from fedkey.federation.privacy.gaussian import PrivacyAccountant, population_delta
from fedkey.federation.privacy.tree import TreeAccountant, count_rho, tree_rho
from fedkey.federation.strategies import ClientUpdate
from fedkey.server.settings import Settings
from tests.federation.privacy.test_tree import share_secret

PHONES = 12

# --------------------------------------------------------------------------- the rule


def test_the_clip_converges_to_the_quantile_of_fixed_norms_without_count_noise():
    norms = np.random.default_rng(0).lognormal(mean=0.0, sigma=1.0, size=200).tolist()
    for q in (0.2, 0.5, 0.9):
        clip = AdaptiveClip(initial=50.0, quantile=q, lr=0.2, count_stddev=0.0)
        for _ in range(300):
            clip.step(norms, len(norms), draw=0.0)
        within = sum(n <= clip.norm for n in norms) / len(norms)
        assert within == pytest.approx(q, abs=0.03), q
        lo, hi = np.quantile(norms, [q - 0.03, q + 0.03])
        assert lo <= clip.norm <= hi, q


def test_one_step_is_the_geometric_update_of_the_noised_fraction():
    clip = AdaptiveClip(initial=2.0, quantile=0.5, lr=0.2, count_stddev=3.0)
    info = clip.step([1.0, 1.5, 2.0, 4.0], denominator=4, draw=0.5)  # 3 within, +1.5 noise
    assert info["clip"] == 2.0
    assert info["unclipped_fraction_noisy"] == pytest.approx((3 + 1.5) / 4)
    assert clip.norm == info["next_clip"] == pytest.approx(2.0 * math.exp(-0.2 * (4.5 / 4 - 0.5)))
    # Poisson's fixed denominator q N: the centered count, 1/2 + (sum (b_i - 1/2) + noise) / D
    poisson = AdaptiveClip(initial=2.0, quantile=0.5, count_stddev=0.0, sensitivity=0.5)
    info = poisson.step([1.0, 3.0, 0.5], denominator=4.0, draw=0.0)
    assert info["unclipped_fraction_noisy"] == pytest.approx(0.5 + (2 - 1.5) / 4)


def test_the_update_noise_keeps_the_total_at_z():
    """z_u^-2 + (s_b / sigma_b)^2 = z^-2, Andrew et al.'s Theorem 1 at s_b = 1/2: the two
    releases together are, by RDP, exactly the Gaussian of multiplier z."""
    z, sigma_b = 1.0, 1.0
    paper = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    assert update_noise_multiplier(z, sigma_b, count_sensitivity("poisson")) == pytest.approx(paper)
    for s_b, sigma_b in ((0.5, 1.0), (1.0, 2.0), (1.0, 5.0)):
        z_u = update_noise_multiplier(z, sigma_b, s_b)
        assert z_u > z and z_u**-2 + (s_b / sigma_b) ** 2 == pytest.approx(z**-2)
        both, alone = RdpAccountant(), RdpAccountant()
        both.compose(dp_accounting.GaussianDpEvent(z_u))
        both.compose(dp_accounting.GaussianDpEvent(sigma_b / s_b))
        alone.compose(dp_accounting.GaussianDpEvent(z))
        assert both.get_epsilon(1e-6) == pytest.approx(alone.get_epsilon(1e-6), rel=1e-9)
    assert update_noise_multiplier(0.0, 0.0, 1.0) == 0.0  # no noise: nothing to keep
    assert count_stddev_problem(1.0, 1.0, 1.0) is not None  # sigma_b must exceed s_b z
    assert count_stddev_problem(1.0, 0.6, 0.5) is None
    with pytest.raises(ValueError, match="must exceed 1 x z = 1 under replace-one"):
        update_noise_multiplier(1.0, 1.0, 1.0)


def test_the_trees_counts_cost_at_most_what_z_alone_costs():
    """rho = W / (2 z_u^2) + ceil(T / b) / (2 sigma_b^2) <= W / (2 z^2) (W >= ceil(T / b))."""
    z, sigma_b = 1.0, 2.0
    z_u = update_noise_multiplier(z, sigma_b, 1.0)
    acc = TreeAccountant(z_u, min_separation=3, delta=1e-5, count_stddev=sigma_b)
    for t in range(1, 40):
        acc.step()
        rho = tree_rho(t, z_u, 3) + math.ceil(t / 3) / (2 * sigma_b**2)
        assert acc.rho == pytest.approx(rho) and count_rho(t, sigma_b, 3) > 0
        assert acc.rho <= tree_rho(t, z, 3) + 1e-12


# --------------------------------------------------------------------------- the round engine


def make_fed(tmp_path, privacy: PrivacyConfig, phones: int = PHONES, fraction: float = 0.25):
    from fedkey.testing.federation import tiny_federation

    config = FederationConfig(fraction=fraction, rounds=50, seed=3, privacy=privacy)
    return tiny_federation(tmp_path, config, phones)


def phone_norm(device: str) -> float:
    """Phone i's update norm, the same every round: 0.01 (i + 1)."""
    return 0.01 * (int(device[1:]) + 1)


def run_round(fed, random: bool = False) -> tuple[dict, list[str]]:
    """One round: each phone's delta has norm phone_norm(phone) (a fixed direction), or with
    `random` a seeded Gaussian delta of about that norm."""
    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    keys = sorted(k for k, v in fed.global_state.items() if v.is_floating_point())
    updates = []
    for d in plan.cohort:
        gen = torch.Generator().manual_seed(plan.round * 1000 + int(d[1:]) if random else 7)
        shapes = [fed.global_state[k].shape for k in keys]
        draws = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
        length = math.sqrt(sum(float((x * x).sum()) for x in draws))
        state = dict(fed.global_state)
        for k, x in zip(keys, draws, strict=True):
            v = fed.global_state[k]
            state[k] = (v.double() + phone_norm(d) * x / length).to(v.dtype)
        updates.append(ClientUpdate(state, 10, 1.0, d))
    return fed.complete_round(plan, updates), plan.cohort


ADAPTIVE = PrivacyConfig(clip_norm=0.5, noise_multiplier=0.0, clip_quantile=0.5)


@pytest.mark.parametrize("mechanism", ["gaussian", "tree"])
def test_the_engines_clip_finds_the_median_update_norm(tmp_path, mechanism):
    """Every phone each round (fraction 1, b = 1), no noise at all: the clip settles at the
    median of the 12 norms 0.01..0.12, and every row records the clip it used."""
    privacy = replace(
        ADAPTIVE,
        clip_count_stddev=0.0,
        mechanism=mechanism,
        min_separation=1 if mechanism == "tree" else None,
    )
    fed = make_fed(tmp_path, privacy, fraction=1.0)
    row0 = fed.start()
    assert row0["info"]["dp"]["clip"] == 0.5
    rows = [run_round(fed)[0] for _ in range(60)]
    clips = [r["info"]["dp"]["clip"] for r in rows]
    assert clips[0] == 0.5 and clips[1] < 0.5
    for row, clip in zip(rows, clips, strict=True):
        assert row["info"]["clip"]["norm"] == pytest.approx(clip)  # what bound_round clipped to
    assert 0.055 <= fed.privacy.clip.norm <= 0.075  # between the 6th and 7th norms, within one step
    last = rows[-1]["info"]["dp"]
    assert last["unclipped_fraction_noisy"] in (6 / 12, 7 / 12)
    assert last["next_clip"] == fed.privacy.clip.norm and last["update_noise_multiplier"] == 0.0


def test_with_noise_the_update_noise_is_z_u_and_epsilon_is_that_of_z(tmp_path):
    privacy = PrivacyConfig(
        clip_norm=0.05, noise_multiplier=1.0, clip_quantile=0.5, clip_count_stddev=2.0, delta=1e-5
    )
    fed = make_fed(tmp_path, privacy)
    fixed = PrivacyAccountant(1.0, "fixed", delta=1e-5)
    z_u = update_noise_multiplier(1.0, 2.0, 1.0)
    for _ in range(4):
        row, _ = run_round(fed, random=True)
        fixed.step(PHONES, 3)
        dp = row["info"]["dp"]
        assert dp["update_noise_multiplier"] == pytest.approx(z_u)
        assert dp["noise_std"] == pytest.approx(z_u * dp["sensitivity"] * (1 + 1e-4))
        assert dp["sensitivity"] == pytest.approx(2 * dp["clip"] / 3)  # the mean of 3 at C_t
        assert row["epsilon"] == fixed.epsilon and row["rho"] == fixed.rho
    tree = make_fed(tmp_path / "tree", replace(privacy, mechanism="tree"))
    for t in range(1, 5):
        row, _ = run_round(tree, random=True)
        b = row["info"]["dp"]["min_separation"]
        assert row["rho"] == pytest.approx(tree_rho(t, z_u, b) + count_rho(t, 2.0, b))
        assert row["info"]["dp"]["noise_std"] == pytest.approx(
            z_u * row["info"]["dp"]["sensitivity"] * (1 + 1e-4)
        )


@pytest.mark.parametrize("mechanism", ["gaussian", "tree"])
def test_a_resumed_adaptive_run_gives_the_same_weights(tmp_path, mechanism):
    privacy = PrivacyConfig(
        clip_norm=0.05,
        noise_multiplier=0.5,
        clip_quantile=0.5,
        clip_count_stddev=1.0,
        mechanism=mechanism,
    )
    share_secret(tmp_path / "straight", tmp_path / "resumed")
    straight = make_fed(tmp_path / "straight", privacy)
    straight.start()
    for _ in range(5):
        run_round(straight, random=True)
    first = make_fed(tmp_path / "resumed", privacy)
    first.start()
    for _ in range(3):
        run_round(first, random=True)
    resumed = make_fed(tmp_path / "resumed", privacy)
    assert resumed.resume() and resumed.privacy.clip.norm == first.privacy.clip.norm != 0.05
    for _ in range(2):
        row, _ = run_round(resumed, random=True)
    for k, v in straight.global_state.items():
        assert torch.equal(resumed.global_state[k], v), k
    assert resumed.privacy.clip.norm == straight.privacy.clip.norm
    acc = straight.privacy.accountant
    assert row["rho"] == acc.rho and row["epsilon"] == acc.epsilon
    # It resumes only as it clipped, with its count noise.
    with pytest.raises(ValueError, match="resume it with --dp-clip-quantile 0.5"):
        fixed_clip = replace(privacy, clip_quantile=None, clip_count_stddev=None)
        make_fed(tmp_path / "resumed", fixed_clip).resume()
    with pytest.raises(ValueError, match="--dp-clip-count-stddev 1.0"):
        make_fed(tmp_path / "resumed", replace(privacy, clip_count_stddev=3.0)).resume()
    fixed = make_fed(
        tmp_path / "fixed", replace(privacy, clip_quantile=None, clip_count_stddev=None)
    )
    fixed.start()
    with pytest.raises(ValueError, match="without --dp-clip-quantile"):
        make_fed(tmp_path / "fixed", privacy).resume()


def test_the_default_count_noise_is_the_expected_cohort_over_20_and_refused_when_too_small(
    tmp_path,
):
    fed = make_fed(tmp_path, replace(ADAPTIVE, noise_multiplier=0.01), phones=40, fraction=0.5)
    assert fed.privacy.clip.count_stddev == 1.0  # 20 a round
    with pytest.raises(
        ValueError,
        match=r"default --dp-clip-count-stddev \(the expected cohort 3 / 20 = 0.15\) is too small",
    ):
        make_fed(tmp_path, replace(ADAPTIVE, noise_multiplier=1.0), phones=12)


# --------------------------------------------------------------------------- delta


def test_delta_defaults_to_one_over_n_to_the_1_1(tmp_path):
    assert population_delta(1000) == pytest.approx(1000**-1.1)
    for mechanism in ("gaussian", "tree"):
        fed = make_fed(tmp_path / mechanism, PrivacyConfig(clip_norm=1.0, mechanism=mechanism))
        rows = [fed.start(), run_round(fed)[0]]
        assert all(r["delta"] == PHONES**-1.1 for r in rows)
        assert fed.privacy.accountant.state_dict()["delta"] == PHONES**-1.1
    explicit = make_fed(tmp_path / "explicit", PrivacyConfig(clip_norm=1.0, delta=1e-7))
    assert explicit.start()["delta"] == 1e-7
    plain = make_fed(tmp_path / "plain", PrivacyConfig())
    assert plain.start()["delta"] is None
    # A server's accountant knows no population before its first round; delta follows the
    # largest population seen, and a fresh accountant spent nothing.
    acc = PrivacyAccountant(1.0, delta=None)
    assert acc.delta is None and acc.epsilon == 0.0
    acc.step(population=100, cohort=10)
    acc.step(population=200, cohort=10)
    assert acc.delta == 200**-1.1
    restored = PrivacyAccountant(1.0, delta=None)
    restored.load_state_dict(acc.state_dict())
    assert restored.delta == acc.delta and restored.epsilon == acc.epsilon


@pytest.mark.parametrize("mechanism", ["gaussian", "tree"])
def test_the_budget_stop_works_at_the_default_delta(tmp_path, mechanism):
    probe = make_fed(tmp_path / "probe", PrivacyConfig(clip_norm=1.0, mechanism=mechanism))
    eps = [run_round(probe)[0]["epsilon"] for _ in range(4)]
    assert probe.privacy.accountant.delta == PHONES**-1.1
    target = (eps[2] + eps[3]) / 2  # three rounds fit, the fourth would pass it
    privacy = PrivacyConfig(
        clip_norm=1.0, noise_multiplier=1.0, mechanism=mechanism, target_epsilon=target
    )  # z given: the target only stops the run (without z it calibrates z)
    fed = make_fed(tmp_path / "run", privacy)
    done = 0
    while not fed.budget_spent:
        run_round(fed)
        done += 1
    assert done == 3 and fed.privacy.accountant.epsilon == eps[2]


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("privacy", "message"),
    [
        (PrivacyConfig(clip_quantile=0.5), "add --dp-clip S"),
        (PrivacyConfig(clip_norm=1.0, clip_quantile=1.0), r"must be in \(0, 1\)"),
        (PrivacyConfig(clip_norm=1.0, clip_quantile=0.0), r"must be in \(0, 1\)"),
        (PrivacyConfig(clip_norm=1.0, clip_quantile=0.5, clip_lr=0.0), "--dp-clip-lr must be > 0"),
        (PrivacyConfig(clip_norm=1.0, clip_count_stddev=2.0), "add --dp-clip-quantile q"),
        (
            PrivacyConfig(clip_norm=1.0, clip_quantile=0.5, clip_count_stddev=0.9),
            "--dp-clip-count-stddev 0.9 is too small.*exceed 1 x z = 1 under replace-one",
        ),
        (
            PrivacyConfig(
                clip_norm=1.0, clip_quantile=0.5, clip_count_stddev=0.4, sampling="poisson"
            ),
            "exceed 0.5 x z = 0.5 under add/remove-one",
        ),
    ],
)
def test_invalid_combinations_are_one_line(privacy, message):
    from fedkey.federation.config import InfluenceConfig

    problem = dp_problem("fedavg", privacy, InfluenceConfig(), {})
    assert problem is not None and "\n" not in problem
    assert re.search(message, problem), problem


def test_settings_refuse_them_too():
    with pytest.raises(ValidationError, match="add --dp-clip S"):
        Settings(dp_clip_quantile=0.5)
    with pytest.raises(ValidationError):
        Settings(dp_clip=1.0, dp_clip_quantile=1.5)
    with pytest.raises(ValidationError):
        Settings(dp_clip=1.0, dp_clip_quantile=0.5, dp_clip_lr=0.0)
    s = Settings(dp_clip=1.0, dp_clip_quantile=0.5, dp_clip_lr=0.1, dp_clip_count_stddev=3.0)
    p = s.privacy_config()
    assert (p.clip_quantile, p.clip_lr, p.clip_count_stddev, p.delta) == (0.5, 0.1, 3.0, None)
