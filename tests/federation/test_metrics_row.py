"""fedkey.federation.metrics_row declares every field of a metrics row: a real round's row has exactly the
declared fields its options ask for (the reference page, docs/reference/metrics.md, is generated
from the declaration); and its checkpoint holds exactly the metadata fedkey.models.checkpoint.METADATA
declares (docs/reference/checkpoint.md)."""

from dataclasses import replace

import pytest

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.federation.config import FederationConfig
from fedkey.federation.metrics_row import ALWAYS, CONDITIONAL, FIELDS, undeclared
from fedkey.models.checkpoint import BASE_ONLY, METADATA, read_metadata
from fedkey.models.config import ModelConfig
from fedkey.runners.simulate import SimulationConfig, simulate

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
    # The checkpoint reference's keys (fedkey.models.checkpoint.METADATA) are what the round wrote,
    # but those only a base model holds (fedkey pretrain's, fedkey vocabulary discover's).
    meta = read_metadata(tmp_path / "checkpoints" / "round_0001.safetensors")
    assert list(meta) == [key for key in METADATA if key not in BASE_ONLY]


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


def test_a_phone_the_outlier_filter_rejects_uploaded_but_was_not_aggregated(tmp_path):
    """The row's "aggregated" is the phones whose updates are in the new model: a phone whose
    update the cosine outlier filter rejects is in "uploaded" (and in bytes_up: its bytes came)
    and in info.clip.outliers, not in "aggregated" (which once listed every upload)."""
    import torch

    from fedkey.federation.strategies import ClientUpdate
    from fedkey.testing.federation import tiny_federation

    fed = tiny_federation(tmp_path, FederationConfig(fraction=1.0, rounds=1, seed=1), 10)
    fed.start()
    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    gen = torch.Generator().manual_seed(0)
    shared = {k: torch.randn(v.shape, generator=gen) for k, v in fed.global_state.items()}
    updates = []
    for d in plan.cohort:  # the same direction, each with its own small noise; p09 against it
        sign = -1.0 if d == "p09" else 1.0
        state = {k: v + 0.01 * (sign * shared[k] + 0.1 * torch.randn(v.shape, generator=gen))
                 for k, v in fed.global_state.items()}  # fmt: skip
        updates.append(ClientUpdate(state, 10, 3.0, d))
    row = fed.complete_round(plan, updates)
    assert list(row["info"]["clip"]["outliers"]) == ["p09"]
    assert row["uploaded"] == plan.cohort and "p09" in row["uploaded"]
    assert row["aggregated"] == [d for d in plan.cohort if d != "p09"]
    assert row["bytes_up"] == fed.model_bytes * 10


def _federation(tmp_path, tok, ngram: str):
    from fedkey.federation.engine import Federation
    from fedkey.federation.storage import RunStorage

    text = ["the cat sat on the mat", "a dog sat on the log", "the dog ran"]
    return Federation(
        FederationConfig(rounds=1, fraction=1.0, ksr_sentences=2, ngram=ngram, eval_device="cpu"),
        ModelConfig(vocab_size=tok.vocab_size, emb_size=4, hidden_size=4),
        tok,
        {"p0": 10},
        text[:2],
        text[1:],
        RunStorage(tmp_path / "run"),
    )


def test_a_run_with_an_ngram_scores_the_mixture_every_round(tmp_path):
    """--ngram: each row also holds the mixture's fields (fedkey.models.mixture.MIX_FIELDS), all
    declared; an n-gram of another vocabulary is refused at the start, in one line."""
    from fedkey.models.mixture import MIX_FIELDS
    from fedkey.models.ngram import KneserNey
    from fedkey.models.tokenizers import WordTokenizer

    train = ["the cat sat on the mat", "a dog ran", "the dog sat on the mat"]
    tok = WordTokenizer.build(train)
    path = tmp_path / "ngram.safetensors"
    KneserNey(tok, 3).fit(tok.encode(s) for s in train).save(path, corpus="three sentences")
    row = _federation(tmp_path, tok, str(path)).start()
    assert undeclared(row) == []
    assert set(MIX_FIELDS) <= set(row) and set(row) - set(ALWAYS) == set(MIX_FIELDS)
    assert row["ngram_weight"] in [i / 20 for i in range(21)]
    assert row["mix_val_ppl"] <= row["val_ppl"] + 1e-9  # lam = 1 is the model itself
    assert None not in [row[k] for k in MIX_FIELDS]

    other = WordTokenizer.build(train + ["zebra"])
    with pytest.raises(ValueError, match=r"^--ngram .*another vocabulary") as e:
        _federation(tmp_path, other, str(path))
    assert "\n" not in str(e.value)
