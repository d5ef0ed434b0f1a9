"""server.metrics_row declares every field of a metrics row: a real round's row has exactly the
declared fields its options ask for (the reference page, docs/reference/metrics.md, is generated
from the declaration); and its checkpoint holds exactly the metadata models.checkpoint.METADATA
declares (docs/reference/checkpoint.md)."""

from dataclasses import replace

import pytest

from common.config import DataConfig, TrainConfig
from models.checkpoint import METADATA, read_metadata
from models.config import ModelConfig
from runners.simulate import SimulationConfig, simulate
from server.config import FederationConfig
from server.metrics_row import ALWAYS, CONDITIONAL, FIELDS, undeclared

DATA = DataConfig(data="demo", clients=3, max_train_tokens=1500, max_eval_sentences=20)
FED = FederationConfig(
    rounds=1, fraction=1.0, ksr_sentences=2, train=TrainConfig(epochs=1, max_len=20)
)


def tiny(vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, emb_size=8, hidden_size=8)


@pytest.mark.slow
def test_a_plain_round_has_exactly_the_fields_every_row_has(tmp_path):
    rows = simulate(
        SimulationConfig(DATA, FED, tiny, str(tmp_path), workers=0, device="cpu", progress=False)
    )
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        assert list(row) == list(ALWAYS)
    # The checkpoint reference's keys (models.checkpoint.METADATA) are what the round wrote.
    meta = read_metadata(tmp_path / "checkpoints" / "round_0001.safetensors")
    assert list(meta) == list(METADATA)


@pytest.mark.slow
def test_the_conditional_fields_are_written_when_asked(tmp_path):
    fed = replace(FED, train=replace(FED.train, batching="columns"))
    rows = simulate(
        SimulationConfig(
            DATA, fed, tiny, str(tmp_path), workers=0, device="cpu", progress=False, malicious=1
        )
    )
    row = rows[-1]
    assert undeclared(row) == []
    wanted = {"col_val_ppl", "col_test_ppl", "best_col_val_ppl", "best_col_test_ppl", "rejected"}
    assert set(row) == set(ALWAYS) | wanted


def test_every_field_is_described_once():
    assert not set(ALWAYS) & set(CONDITIONAL)
    for name, field in FIELDS.items():
        assert field.description and field.type, name
        assert bool(field.when) == (name in CONDITIONAL), name
