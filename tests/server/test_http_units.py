"""Pieces of the HTTP server on their own: settings from the environment, the event bus."""

import asyncio

import pytest
from pydantic import ValidationError

from fedkey.common.config import TrainConfig
from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.server.events import EventBus
from fedkey.server.settings import Settings


def test_settings_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDKEY_STRATEGY", "fedmed")
    monkeypatch.setenv("FEDKEY_TOPK_BETA", "0.8")
    monkeypatch.setenv("FEDKEY_ROUNDS", "7")
    monkeypatch.setenv("FEDKEY_ENROLLMENT_SECRET", "hush")
    monkeypatch.setenv("FEDKEY_STORAGE", str(tmp_path))
    monkeypatch.setenv("FEDKEY_EXIT_WHEN_DONE", "true")
    s = Settings()
    assert s.enrollment_secret.get_secret_value() == "hush" and "hush" not in repr(s)
    assert s.exit_when_done and s.topk
    assert s.db_url == f"sqlite:///{tmp_path.resolve() / 'fedkey.db'}"
    # the same FederationConfig `fedkey simulate --strategy fedmed --topk-beta 0.8` builds
    assert s.federation_config() == FederationConfig(
        strategy="fedmed",
        strategy_params={"eta": 1.0, "epsilon_med": 0.1, "beta": 0.8},
        fraction=0.1,
        rounds=7,
        seed=0,
        train=TrainConfig(epochs=5, batch_size=10, lr=1.0, momentum=0.5, clip=5.0),
        privacy=PrivacyConfig(),  # no noise multiplier asked: none (calibrated only under DP)
    )
    assert s.build_model_config(50).hidden_size == 300
    assert Settings(hidden_size=8).build_model_config(50).emb_size == 8
    assert [Settings(quorum_fraction=0.5).quorum_for(k) for k in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert Settings(quorum=3).quorum_for(2) == 2


def test_settings_refuse_nonsense():
    with pytest.raises(ValidationError, match="AdaFL selection"):
        Settings(strategy="fedatt", dp_clip=1.0, adafl=True)
    with pytest.raises(ValidationError, match="--topk-beta 1"):
        Settings(strategy="fedmed", dp_clip=1.0, topk_beta=0.8, epsilon_med=0)
    with pytest.raises(ValidationError, match="--epsilon-med 0"):
        Settings(strategy="fedmed", dp_clip=1.0)
    with pytest.raises(ValidationError, match="--dp-sampling fixed"):
        Settings(strategy="fedatt", dp_clip=1.0, dp_sampling="poisson")
    with pytest.raises(ValidationError, match="drop --bound off"):
        Settings(dp_clip=1.0, bound="off")
    with pytest.raises(ValidationError, match="--bound-norm"):
        Settings(bound="fixed")
    for strategy in ("fedavg", "fedatt", "fedattopt"):  # each has its sensitivity
        assert Settings(strategy=strategy, dp_clip=1.0).privacy_config().dp
    assert Settings(strategy="fedmed", dp_clip=1.0, epsilon_med=0).privacy_config().dp
    with pytest.raises(ValidationError):
        Settings(strategy="fedprox")
    with pytest.raises(ValidationError):
        Settings(rounds=0)


def test_event_bus_drops_the_oldest_for_a_slow_subscriber():
    async def main():
        bus = EventBus(queue_size=3)
        slow, other = bus.subscribe(), bus.subscribe()
        for i in range(10):
            bus.publish("round_opened", round=i)
        got = [(await slow.get())["round"] for _ in range(3)]
        assert got == [7, 8, 9] and slow.dropped == 7
        other.close()
        bus.publish("run_finished", round=10)
        assert (await slow.get())["type"] == "run_finished"
        assert other.queue.qsize() == 3  # unsubscribed: no longer fed
        bus.close()
        assert await slow.get() is None
        assert await bus.subscribe().get() is None  # subscribing after close ends at once

    asyncio.run(main())


def test_a_subscriber_drains_a_burst_in_order_and_the_close_last():
    async def main():
        bus = EventBus(queue_size=8)
        sub = bus.subscribe()
        assert sub.drain() == []
        for i in range(5):
            bus.publish("update_received", round=i)
        bus.close()
        assert (await sub.get())["round"] == 0
        rest = sub.drain()
        assert [e["round"] for e in rest[:-1]] == [1, 2, 3, 4] and rest[-1] is None
        assert sub.drain() == []

    asyncio.run(main())
