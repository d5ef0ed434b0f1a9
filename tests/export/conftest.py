"""Tiny trained checkpoints to export: emb = hidden = 16, demo word vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedkey.common.config import TrainConfig
from fedkey.corpora.demo import demo_corpus
from fedkey.device_sim.training.trainer import train_local
from fedkey.models.checkpoint import build_model, model_state, save_checkpoint
from fedkey.models.config import Cell
from fedkey.models.model import ModelConfig
from fedkey.models.tokenizers import WordTokenizer


@pytest.fixture(scope="session")
def demo():
    corpus = demo_corpus()
    train = corpus.train[:400]
    return {"train": train, "held_out": corpus.test[:150], "tok": WordTokenizer.build(train)}


@pytest.fixture(scope="session")
def make_checkpoint(demo, tmp_path_factory):
    """(cell, layers, tied) -> path of a checkpoint trained one short epoch on demo text."""
    cache: dict[tuple, Path] = {}

    def make(cell: Cell = "gru", num_layers: int = 1, tied: bool = True) -> Path:
        key = (cell, num_layers, tied)
        if key not in cache:
            torch.manual_seed(0)
            tok = demo["tok"]
            cfg = ModelConfig(tok.vocab_size, cell, 16, 16, num_layers, tied)
            seqs = [tok.encode(s) for s in demo["train"]]
            result = train_local(
                cfg,
                model_state(build_model(cfg)),
                seqs,
                TrainConfig(epochs=1, batch_size=20, lr=0.5, momentum=0.5),
                seed=0,
                device="cpu",
            )
            path = tmp_path_factory.mktemp("ckpt") / f"{cell}{num_layers}{'t' if tied else 'u'}.st"
            save_checkpoint(
                path,
                result.state,
                cfg,
                tok,
                round_idx=7,
                strategy="fedatt",
                extra={
                    "metrics": {"round": 7, "val_ppl": 123.4, "test_ppl": 130.5, "top1": 0.2},
                    "server": {"scores": [1, 2, 3]},
                },
            )
            cache[key] = path
        return cache[key]

    return make
