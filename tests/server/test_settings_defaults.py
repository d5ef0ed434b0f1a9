"""`fedkey server`'s Settings start from the engine's dataclass defaults: a server and a simulation
left at their defaults run the same federation."""

import os

import pytest

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.federation.config import FederationConfig, PrivacyConfig, ServerOptConfig
from fedkey.models.config import ModelConfig
from fedkey.server.settings import Settings


@pytest.fixture
def clean_env(monkeypatch):
    """No FEDKEY_ variable in the environment (Settings would read it)."""
    for name in list(os.environ):
        if name.upper().startswith("FEDKEY_"):
            monkeypatch.delenv(name)


@pytest.fixture
def settings(clean_env):
    return Settings()


def test_train_and_privacy_configs_are_the_dataclass_defaults(settings):
    assert settings.train_config() == TrainConfig()
    assert settings.privacy_config() == PrivacyConfig()
    # The two defaults that once disagreed between the layers: z is None, "not given" (1.0, or
    # calibrated to --dp-target-epsilon: fedkey.federation.privacy.calibrate).
    assert (settings.lr, settings.dp_noise_multiplier) == (1.0, None)


def test_federation_config_is_the_dataclass_default(settings):
    fed = settings.federation_config()
    default = FederationConfig()
    assert fed.server_opt == ServerOptConfig()
    for name in ("strategy", "strategy_params", "fraction", "rounds", "seed", "lr_decay"):
        assert getattr(fed, name) == getattr(default, name), name
    assert fed.ksr_sentences == default.ksr_sentences
    assert fed == default  # and the fields Settings does not set (label, eval_batch_size)


def test_data_and_model_configs_are_the_dataclass_defaults(settings):
    assert settings.data_config() == DataConfig()
    assert settings.data_config().seed == settings.federation_config().seed
    vocab = 1234
    assert settings.build_model_config(vocab) == ModelConfig(vocab_size=vocab)


@pytest.mark.parametrize("name", ["fedatt", "fedattopt", "fedmed"])
def test_strategy_options_are_the_strategy_defaults(clean_env, name):
    from fedkey.federation.strategies import get_strategy

    params = Settings(strategy=name).strategy_params()
    assert get_strategy(name, **params).config() == get_strategy(name).config()


def test_max_reach_is_fedattopts_and_reaches_its_strategy(clean_env):
    from fedkey.federation.strategies import get_strategy

    params = Settings(strategy="fedattopt", epsilon=100.0, max_reach=1.0).strategy_params()
    assert get_strategy("fedattopt", **params).max_reach == 1.0
    with pytest.raises(ValueError, match="use it with --strategy fedattopt"):
        Settings(strategy="fedatt", max_reach=1.0)


def test_server_lr_decay_reaches_the_server_optimizer_and_needs_one(clean_env):
    config = Settings(server_opt="adam", server_lr=0.1, server_lr_decay=0.97).federation_config()
    assert (config.server_opt.lr, config.server_opt.lr_decay) == (0.1, 0.97)
    with pytest.raises(ValueError, match="add --server-opt momentum or adam"):
        Settings(server_lr_decay=0.97)
    with pytest.raises(ValueError):
        Settings(server_opt="adam", server_lr_decay=1.5)  # a schedule that grows: refused


def test_every_field_has_a_description():
    """The description is the field's documentation, the help of its flag (tests/cli/test_options.py
    checks that the flags use it) and its row of reference/configuration.md: a sentence."""
    fields = Settings.model_fields
    assert not [name for name, f in fields.items() if not (f.description or "").endswith(".")]
