"""Fixtures for the web keyboard: tiny exported models (built once per session).

The models are trained here with torch (tests only; the serving code never imports it): a GRU
with hidden 32, one epoch on 3,000 demo sentences (~3 s), exported with export_checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fedkey.testing.browser import CHROMIUM, CHROMIUM_ARGS
from fedkey.testing.keyboard import Models, export_model

HIDDEN = 32
TRAIN_SENTENCES = 3000


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    import torch

    from fedkey.common.config import TrainConfig
    from fedkey.corpora.loaders import load_corpus
    from fedkey.device_sim.training.trainer import train_local
    from fedkey.models.checkpoint import model_state, save_checkpoint
    from fedkey.models.config import ModelConfig
    from fedkey.models.model import LanguageModel
    from fedkey.models.tokenizers import SentencePieceTokenizer, WordTokenizer

    root = tmp_path_factory.mktemp("kw-models")
    corpus = load_corpus("demo")
    tok = WordTokenizer.build(corpus.train)

    cfg = ModelConfig(vocab_size=tok.vocab_size, cell="gru", emb_size=HIDDEN, hidden_size=HIDDEN)
    torch.manual_seed(0)
    init = model_state(LanguageModel(cfg))
    seqs = [tok.encode(s) for s in corpus.train[:TRAIN_SENTENCES]]
    res = train_local(cfg, init, seqs, TrainConfig(epochs=1, batch_size=20, lr=1.0), seed=0)
    word_ckpt = save_checkpoint(
        root / "word.safetensors",
        res.state,
        cfg,
        tok,
        round_idx=3,
        strategy="fedavg",
        extra={"metrics": {"val_ppl": 171.5, "test_ppl": 175.25}},
    )
    word = export_model(word_ckpt, root / "word" / "model.onnx")

    lcfg = ModelConfig(vocab_size=tok.vocab_size, cell="lstm", emb_size=24, hidden_size=24)
    torch.manual_seed(1)
    lstm_ckpt = save_checkpoint(
        root / "lstm.safetensors",
        model_state(LanguageModel(lcfg)),
        lcfg,
        tok,
        round_idx=0,
        strategy="fedavg",
    )
    lstm = export_model(lstm_ckpt, root / "lstm" / "model.onnx")

    sp = SentencePieceTokenizer.train(corpus.train[:2000], vocab_size=300)
    scfg = ModelConfig(vocab_size=sp.vocab_size, cell="gru", emb_size=16, hidden_size=16)
    sp_ckpt = save_checkpoint(
        root / "sp.safetensors",
        model_state(LanguageModel(scfg)),
        scfg,
        sp,
        round_idx=1,
        strategy="fedavg",
    )
    spm = export_model(sp_ckpt, root / "sp" / "model.onnx")
    return Models(word=word, checkpoint=word_ckpt, lstm=lstm, sentencepiece=spm, vocab=tok.itos)


@pytest.fixture
def watch_dir(models, tmp_path) -> Path:
    """A directory holding a copy of the round-3 export, for hot-reload tests."""
    d = tmp_path / "watch"
    d.mkdir()
    shutil.copy(models.word, d / "model.onnx")
    shutil.copy(models.word.with_suffix(".json"), d / "model.json")
    return d


@pytest.fixture(scope="module")
def browser():
    """Chromium for the browser tests (each of their modules skips where it is not installed)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()
