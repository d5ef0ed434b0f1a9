"""The smallest round engine the DP tests drive by hand: a 4-unit model over a six-word
vocabulary, `phones` phones of 10 words each named p00, p01, ..., and an evaluator that scores
nothing (the tests read the weights, the noise and the rows' privacy fields)."""

from __future__ import annotations

from pathlib import Path

from models.config import ModelConfig
from models.tokenizers import WordTokenizer
from server.config import FederationConfig
from server.engine import Federation
from server.storage import RunStorage


def tiny_federation(tmp_path: Path, config: FederationConfig, phones: int) -> Federation:
    tok = WordTokenizer.build(["the cat sat on the mat", "a dog ran"])
    return Federation(
        config,
        ModelConfig(vocab_size=tok.vocab_size, emb_size=4, hidden_size=4),
        tok,
        {f"p{i:02d}": 10 for i in range(phones)},
        ["the cat"],
        ["a dog"],
        RunStorage(tmp_path),
        evaluator=lambda state: {"val_ppl": 1.0, "test_ppl": 1.0},
    )
