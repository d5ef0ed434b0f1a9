"""Real typing measured as production does: on a per-sender corpus the
validation and test sets hold the later messages of the senders who have a phone (with
``--clients K``, the K kept), and every run (simulate, train-central, ngram) also scores the
held-out senders who never trained (the ``unseen_*`` fields of a metrics row)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.common.config import DataConfig, TrainConfig
from fedkey.corpora.dataset import load_cut
from fedkey.corpora.loaders import load_corpus
from fedkey.corpora.partition import partition
from fedkey.federation.config import FederationConfig
from fedkey.federation.metrics_row import CONDITIONAL, undeclared
from fedkey.models.config import ModelConfig
from fedkey.runners.baselines import train_central, train_ngram
from fedkey.runners.simulate import SimulationConfig, simulate
from tests.corpora.test_nus_sms import _timed, write_zip

UNSEEN = ("unseen_test_ppl", "unseen_top1", "unseen_top3", "unseen_bar_top1", "unseen_bar_top3",
          "unseen_ksr")  # fmt: skip


def _corpus(folder: Path) -> Path:
    """Ten senders of 10 to 28 messages each (sender s9 the most); one of them is held out."""
    msgs = []
    for i in range(10):
        msgs += _timed(f"s{i}", 10 + 2 * i)
    write_zip(folder, msgs)
    return folder


def test_the_held_out_splits_know_their_senders(tmp_path):
    c = load_corpus(_corpus(tmp_path))
    assert c.valid_users is not None and c.test_users is not None
    assert len(c.valid_users) == len(c.valid) and len(c.test_users) == len(c.test)
    for texts, users in ((c.valid, c.valid_users), (c.test, c.test_users)):
        for text, user in zip(texts, users, strict=True):
            assert text.endswith(f"from {user} !")  # "Msg k from <sender>!", normalized
    assert set(c.valid_users) == set(c.test_users) == set(c.users)
    assert not set(c.users) & set(c.unseen_users or [])


def test_clients_k_keeps_only_the_phones_held_out_messages(tmp_path):
    folder = _corpus(tmp_path)
    full = load_corpus(folder)
    cfg = DataConfig(data=str(folder), partition="user", clients=3)
    cut, _ = load_cut(cfg)
    shards = partition(cut, "user", 3, cfg.seed)
    phones = {cut.train_users[s[0]] for s in shards}  # type: ignore[index]
    assert len(phones) == 3
    assert set(cut.valid_users or []) == phones == set(cut.test_users or [])
    # every held-out message of those three, none of the others'
    assert cut.valid == [t for t, u in zip(full.valid, full.valid_users, strict=True) if u in phones]  # type: ignore[arg-type]  # fmt: skip
    assert cut.test == [t for t, u in zip(full.test, full.test_users, strict=True) if u in phones]  # type: ignore[arg-type]  # fmt: skip
    # the unseen senders are the same whatever K is, so their scores compare across K
    assert cut.unseen_test == full.unseen_test and cut.unseen_users == full.unseen_users
    # another partition: every training sender trains somewhere, so valid/test stay whole
    iid, _ = load_cut(DataConfig(data=str(folder), partition="iid", clients=3))
    assert iid.valid == full.valid and iid.test == full.test
    # --max-eval-sentences cuts after the phones are chosen, the owners alongside
    capped, _ = load_cut(DataConfig(data=str(folder), partition="user", clients=3,
                                    max_eval_sentences=4))  # fmt: skip
    assert capped.valid == cut.valid[:4] and capped.valid_users == (cut.valid_users or [])[:4]
    assert capped.unseen_test == (full.unseen_test or [])[:4]


def tiny(vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, emb_size=8, hidden_size=8)


def _check(row: dict) -> None:
    assert undeclared(row) == []
    for key in UNSEEN:
        assert key in CONDITIONAL
        assert row[key] is not None, key
    assert row["unseen_test_ppl"] > 1 and 0 <= row["unseen_top1"] <= row["unseen_top3"] <= 1
    # the bar shows no </s> or <unk>: a real word first in the model's ranking is first in the
    # bar's too, so the bar's top-k is never below the model's
    for prefix in ("", "unseen_"):
        assert row[f"{prefix}top1"] <= row[f"{prefix}bar_top1"] <= row[f"{prefix}bar_top3"] <= 1
        assert row[f"{prefix}top3"] <= row[f"{prefix}bar_top3"]


def test_the_ngram_scores_the_unseen_senders(tmp_path):
    data = DataConfig(data=str(_corpus(tmp_path / "data")), partition="user", clients=4)
    (row,) = train_ngram(data, 3, str(tmp_path / "ngram"), ksr_sentences=3)
    _check(row)


@pytest.mark.slow
def test_simulate_and_train_central_score_the_unseen_senders(tmp_path):
    data = DataConfig(data=str(_corpus(tmp_path / "data")), partition="user", clients=4)
    fed = FederationConfig(
        rounds=1, fraction=0.5, ksr_sentences=3, train=TrainConfig(epochs=1, max_len=20)
    )
    rows = simulate(
        SimulationConfig(
            data, fed, tiny, str(tmp_path / "sim"), workers=0, device="cpu", progress=False
        )  # fmt: skip
    )
    for row in rows:
        _check(row)
    # `fedkey evaluate` scores the kept checkpoint on the same messages: the phones' senders'
    # (--partition user --clients 4) and the held-out senders', as the run recorded them
    ckpt = tmp_path / "sim" / "checkpoints" / "round_0001.safetensors"
    args = ["evaluate", str(ckpt), "--data", data.data, "--partition", "user", "--clients", "4",
            "--ksr-sentences", "3", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    scores = json.loads(result.output)
    for key in ("test_ppl", "bar_top1", *UNSEEN):
        assert scores[key] == pytest.approx(rows[-1][key], rel=1e-6), key
    assert scores["agrees"] is True
    central = train_central(data, TrainConfig(epochs=1, max_len=20), tiny, str(tmp_path / "c"),
                            epochs=1, device="cpu", progress=False, ksr_sentences=3)  # fmt: skip
    for row in central:
        _check(row)
    # a corpus without held-out senders has no unseen fields (the demo corpus)
    demo = DataConfig(data="demo", clients=3, max_train_tokens=1500, max_eval_sentences=20)
    plain = simulate(
        SimulationConfig(
            demo, fed, tiny, str(tmp_path / "demo"), workers=0, device="cpu", progress=False
        )  # fmt: skip
    )
    assert not set(UNSEEN) & set(plain[-1])
