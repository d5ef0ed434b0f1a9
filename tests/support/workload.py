"""The smallest federated run that still trains: 4 demo phones, 2 rounds of FedAvg, a 16-unit
model. Shared by the tests that run `simulate` end to end (the attacks, the ray backend against
the local one), so they compare the same workload."""

from __future__ import annotations

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.federation.config import FederationConfig
from fedkey.models.config import ModelConfig

DATA = DataConfig(data="demo", clients=4, max_train_tokens=1500, max_eval_sentences=20)
FED = FederationConfig(
    strategy="fedavg",
    fraction=1.0,
    rounds=2,
    train=TrainConfig(epochs=1, lr=0.5),
    ksr_sentences=0,
)


def tiny(vocab_size: int) -> ModelConfig:
    """The model for a tokenizer of `vocab_size` words (simulate's build_model_config)."""
    return ModelConfig(vocab_size=vocab_size, emb_size=16, hidden_size=16)
