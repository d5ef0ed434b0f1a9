"""Under DP a round summed where its phones trained (fedkey.federation.updates.summed) is the
per-phone path's round: each delta clipped to the round's clip before it is summed, the same
secret noise, the same epsilon and, under adaptive clipping, the same next clip; a sum clipped
to another clip than the round's is refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.engine import Federation
from fedkey.federation.updates.summed import PartialSum, SummedRound, SumRule, widened
from fedkey.testing.federation import seeded_updates, tiny_federation

#: Phone p<i>'s delta has norm 0.01 (i + 1) (seeded_updates): a clip of 0.065 clips half of them.
CLIP = 0.065
PRIVACY = {
    "gaussian": PrivacyConfig(clip_norm=CLIP, noise_multiplier=0.5),
    "poisson": PrivacyConfig(clip_norm=CLIP, noise_multiplier=0.5, sampling="poisson"),
    "tree": PrivacyConfig(clip_norm=CLIP, noise_multiplier=0.5, mechanism="tree"),
    "blt, adaptive clip": PrivacyConfig(
        clip_norm=CLIP,
        noise_multiplier=0.5,
        mechanism="blt",
        clip_quantile=0.5,
        clip_count_stddev=1.0,
    ),  # fmt: skip
}


#: FedAtt with the fixed normalizer (its weights each phone's own), at its default step.
FEDATT = {"strategy": "fedatt", "strategy_params": {"normalizer": "fixed"}}
#: The cells: a DP rule, and the strategy (FedAvg unless FEDATT).
CELLS = {**{name: (p, {}) for name, p in PRIVACY.items()},
         "fedatt, gaussian": (PRIVACY["gaussian"], FEDATT),
         "fedatt, blt, adaptive clip": (PRIVACY["blt, adaptive clip"], FEDATT)}  # fmt: skip


def federation(tmp_path, privacy: PrivacyConfig, **strategy: Any) -> Federation:
    """12 phones, cohorts of half of them, the noise from one passphrase (the same for every
    federation of the test: the same cohorts and the same noise)."""
    privacy = PrivacyConfig(**{**privacy.__dict__, "secret": "summed-dp-test"})
    config = FederationConfig(fraction=0.5, rounds=5, seed=3, privacy=privacy, **strategy)
    return tiny_federation(tmp_path, config, 12)


def summed_round(fed: Federation, plan, workers: int = 2) -> SummedRound:
    """The plan's phones summed by `fed`'s rule as `workers` workers would, alternately."""
    rule, wide = fed.sum_rule(), widened(fed.global_state)
    parts = [PartialSum.empty(fed.global_state, rule) for _ in range(workers)]
    for i, u in enumerate(seeded_updates(fed, plan)):
        parts[i % workers].add(u.device_id, u.state, u.num_samples, u.train_loss, wide)
    return SummedRound.of(parts)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Two rows' values equal, floats to 1e-9 relative."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) and not math.isnan(a):
        assert a == pytest.approx(b, rel=1e-9), path
    else:
        assert a == b, path


@pytest.mark.parametrize("name", list(CELLS))
def test_a_dp_round_summed_where_the_phones_trained_is_the_per_phone_round(tmp_path, name):
    privacy, strategy = CELLS[name]
    per_phone = federation(tmp_path / "per-phone", privacy, **strategy)
    summed = federation(tmp_path / "summed", privacy, **strategy)
    assert summed.summable
    phones, clipped, summed_phones = sorted(summed.strategy.client_sizes), 0, 0
    for _ in range(3):
        plan, same = per_phone.plan_round(phones), summed.plan_round(phones)
        assert plan.cohort == same.cohort
        want = per_phone.complete_round(plan, seeded_updates(per_phone, plan))
        round_ = summed_round(summed, same)
        clip = round_.info(summed.config.influence.weight_cap)
        assert clip["mode"] == "dp"
        clipped, summed_phones = clipped + clip["clipped"], summed_phones + len(round_)
        got = summed.complete_summed_round(same, round_)
        for k in ("clip", "dp"):
            assert_same(want["info"][k], got["info"][k], k)
        assert got["epsilon"] == want["epsilon"] and got["aggregated"] == want["aggregated"]
        for k, v in per_phone.global_state.items():
            torch.testing.assert_close(summed.global_state[k], v, rtol=1e-6, atol=1e-7)
    assert 0 < clipped < summed_phones  # some phones clipped, some not
    if name.endswith("adaptive clip"):
        assert summed.privacy.clip_norm() == pytest.approx(per_phone.privacy.clip_norm())
        assert summed.privacy.clip_norm() != CLIP  # it adapted


def test_a_sum_clipped_to_another_clip_is_refused_and_changes_nothing(tmp_path):
    fed = federation(tmp_path, PRIVACY["gaussian"])
    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    before = {k: v.clone() for k, v in fed.global_state.items()}
    unclipped = PartialSum.empty(fed.global_state, SumRule(weighted=False))
    for u in seeded_updates(fed, plan):
        unclipped.add(u.device_id, u.state, u.num_samples, u.train_loss, fed.global_state)
    with pytest.raises(ValueError, match="was summed as"):
        fed.complete_summed_round(plan, SummedRound(unclipped))
    assert fed.round == 0 and fed.privacy.accountant.steps == 0
    assert all(torch.equal(fed.global_state[k], v) for k, v in before.items())
