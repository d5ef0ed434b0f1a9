"""Issue 52 item 4: under DP the round engine noises FedAtt's fixed normalizer
(``--fedatt-normalizer fixed``) exactly as it noises DP-FedAvg: the engine's std is
``z * strategy.sensitivity(...)`` (fedkey.federation.privacy.round), and the fixed normalizer declares
DP-FedAvg's ``2 S / m`` (times its server step epsilon), so at the same clip, noise multiplier and
cohort both draw the same noise and spend the same epsilon, where FedAtt's softmax draws more."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.testing.federation import seeded_updates, tiny_federation

PHONES = 12
# One passphrase for every run compared: the same cohorts and noise draws (fedkey.federation.privacy.secret).
DP = PrivacyConfig(clip_norm=0.05, noise_multiplier=1.0, delta=1e-5, secret="compared runs")
FEDAVG: tuple[str, dict] = ("fedavg", {})
FIXED: tuple[str, dict] = ("fedatt", {"normalizer": "fixed", "epsilon": 1.0})


def make_fed(tmp_path, strategy: tuple[str, dict], privacy: PrivacyConfig):
    name, params = strategy
    config = FederationConfig(
        strategy=name,  # type: ignore[arg-type]
        strategy_params=params,
        fraction=0.25,
        rounds=10,
        seed=5,
        privacy=privacy,
    )
    return tiny_federation(tmp_path, config, PHONES)


def run_round(fed) -> tuple[dict, dict[str, torch.Tensor]]:
    """One round whose phones send seeded deltas of norms 0.01 to 0.12 (half clipped at 0.05):
    its row and the new global model."""
    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    updates = seeded_updates(fed, plan)
    row = fed.complete_round(plan, updates)
    return row, {k: v.clone() for k, v in fed.global_state.items()}


def noise_of(tmp_path, strategy: tuple[str, dict]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Round 1's row under DP and the noise the engine added: the DP model less the model of the
    same round at z = 0."""
    noised = make_fed(tmp_path / "z1", strategy, DP)
    exact = make_fed(tmp_path / "z0", strategy, replace(DP, noise_multiplier=0.0))
    noised.start()
    exact.start()
    row, with_noise = run_round(noised)
    _, without = run_round(exact)
    return row, {k: with_noise[k] - without[k] for k in with_noise}


def test_the_fixed_normalizer_draws_dp_fedavgs_noise(tmp_path):
    avg_row, avg_noise = noise_of(tmp_path / "avg", FEDAVG)
    fix_row, fix_noise = noise_of(tmp_path / "fix", FIXED)
    m = avg_row["info"]["num_updates"]
    assert m == fix_row["info"]["num_updates"] == 3
    assert avg_row["info"]["dp"]["sensitivity"] == pytest.approx(2 * 0.05 / m)
    for key in ("sensitivity", "noise_std", "clip"):
        assert fix_row["info"]["dp"][key] == avg_row["info"]["dp"][key], key
    assert fix_row["epsilon"] == avg_row["epsilon"] and fix_row["delta"] == avg_row["delta"]
    # the same secret's draw at the same std: the very same noise on every weight
    std = avg_row["info"]["dp"]["noise_std"]
    floating = [k for k, v in avg_noise.items() if v.is_floating_point()]
    assert floating and set(floating) == {k for k, v in fix_noise.items() if v.is_floating_point()}
    for k in floating:
        torch.testing.assert_close(fix_noise[k], avg_noise[k], rtol=0, atol=1e-6)
    drawn = torch.cat([avg_noise[k].reshape(-1) for k in floating])
    assert float(drawn.std()) == pytest.approx(std, rel=0.25)  # it is the std's noise, not zero


def test_the_fixed_normalizers_noise_is_fedavgs_every_round_and_the_softmax_draws_more(tmp_path):
    """Rounds 1-3 of the fixed normalizer: DP-FedAvg's std every round (1.2 times it at FedAtt's
    default step epsilon 1.2, which scales the noised aggregate alike); the softmax's std is
    larger by its attention bound."""
    feds = {
        label: make_fed(tmp_path / label, strategy, DP)
        for label, strategy in {
            "fedavg": FEDAVG,
            "fixed": FIXED,
            "fixed-1.2": ("fedatt", {"normalizer": "fixed"}),
            "softmax": ("fedatt", {"epsilon": 1.0}),
        }.items()
    }
    for fed in feds.values():
        fed.start()
    for _ in range(3):
        rows = {label: run_round(fed)[0] for label, fed in feds.items()}
        std = {label: row["info"]["dp"]["noise_std"] for label, row in rows.items()}
        assert std["fixed"] == std["fedavg"] > 0
        assert std["fixed-1.2"] == pytest.approx(1.2 * std["fedavg"])
        assert std["softmax"] > 1.5 * std["fedavg"]
        assert len({row["epsilon"] for row in rows.values()}) == 1
        assert rows["fixed"]["info"]["attention_cap"] == pytest.approx(1 / 3)
