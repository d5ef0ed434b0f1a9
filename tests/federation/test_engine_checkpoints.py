"""--checkpoint-every N: the round engine writes a round's checkpoint every N rounds, at every new
best round and at the last round, prunes to the latest it wrote, and a resume continues from the
last one written; under DP the setting is refused (a resume would run published rounds again)."""

from __future__ import annotations

import pytest

from fedkey.federation.config import FederationConfig, InfluenceConfig, PrivacyConfig
from fedkey.federation.engine import Federation
from fedkey.federation.storage import RunStorage
from fedkey.server.settings import Settings
from fedkey.testing.federation import seeded_updates, tiny_federation

#: Validation perplexity after rounds 0..6: new bests at rounds 0, 1 and 4.
VAL = [5.0, 4.0, 6.0, 7.0, 3.0, 8.0, 9.0]


def run(tmp_path, every: int, keep: int = 0) -> Federation:
    config = FederationConfig(
        rounds=6, fraction=0.5, checkpoint_every=every, keep_checkpoints=keep,
        influence=InfluenceConfig(mode="off"),
    )  # fmt: skip
    fed = tiny_federation(tmp_path, config, phones=4)
    scores = iter(VAL)
    fed.evaluator = lambda state: {"val_ppl": (v := next(scores)), "test_ppl": v}
    fed.start()
    for _ in range(6):
        plan = fed.plan_round(sorted(fed.strategy.client_sizes))
        fed.complete_round(plan, seeded_updates(fed, plan))
    return fed


def saved(tmp_path) -> list[int]:
    return sorted(int(p.stem[-4:]) for p in RunStorage(tmp_path).checkpoints.glob("round_*"))


def test_every_third_round_the_best_rounds_and_the_last(tmp_path):
    fed = run(tmp_path, every=3)
    assert saved(tmp_path) == [0, 1, 3, 4, 6]
    assert [r["round"] for r in fed.storage.read_metrics()] == list(range(7))  # every row


def test_pruning_keeps_the_latest_written_and_the_best(tmp_path):
    run(tmp_path, every=4, keep=1)
    assert saved(tmp_path) == [4, 6]  # 6: the last round (4 was also written as every 4th)


def test_a_resume_continues_from_the_last_round_written(tmp_path):
    run(tmp_path, every=4)
    (tmp_path / "checkpoints" / "round_0006.safetensors").unlink()  # as if killed in round 6
    config = FederationConfig(rounds=6, fraction=0.5, checkpoint_every=4,
                              influence=InfluenceConfig(mode="off"))  # fmt: skip
    again = tiny_federation(tmp_path, config, phones=4)
    assert again.resume() and again.round == 4
    assert [r["round"] for r in again.storage.read_metrics()] == [0, 1, 2, 3, 4]


def test_under_dp_only_every_round(tmp_path):
    """Refused by the settings and by the round engine itself (a config built by hand)."""
    with pytest.raises(ValueError, match="--checkpoint-every"):
        Settings(checkpoint_every=2, dp_clip=1.0, dp_noise_multiplier=1.0)
    assert Settings(checkpoint_every=2).federation_config().checkpoint_every == 2
    dp = PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0)
    config = FederationConfig(rounds=6, fraction=0.5, checkpoint_every=2, privacy=dp)
    with pytest.raises(ValueError, match="--checkpoint-every"):
        tiny_federation(tmp_path, config, phones=4)
