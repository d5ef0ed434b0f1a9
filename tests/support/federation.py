"""The smallest round engine the DP tests drive by hand: a 4-unit model over a six-word
vocabulary, `phones` phones of 10 words each named p00, p01, ..., and an evaluator that scores
nothing (the tests read the weights, the noise and the rows' privacy fields)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from fedkey.federation.config import FederationConfig
from fedkey.federation.engine import Federation
from fedkey.federation.storage import RunStorage
from fedkey.federation.strategies import ClientUpdate
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import WordTokenizer


def tiny_federation(
    tmp_path: Path, config: FederationConfig, phones: int, size: int = 4
) -> Federation:
    """A federation of `phones` phones over a two-sentence vocabulary, its model's embedding and
    hidden state `size` wide, evaluated by a constant."""
    tok = WordTokenizer.build(["the cat sat on the mat", "a dog ran"])
    return Federation(
        config,
        ModelConfig(vocab_size=tok.vocab_size, emb_size=size, hidden_size=size),
        tok,
        {f"p{i:02d}": 10 for i in range(phones)},
        ["the cat"],
        ["a dog"],
        RunStorage(tmp_path),
        evaluator=lambda state: {"val_ppl": 1.0, "test_ppl": 1.0},
    )


def seeded_updates(
    fed: Federation, plan, loss: Callable[[int], float] = lambda i: 3.0
) -> list[ClientUpdate]:
    """The updates of `plan`'s cohort: phone p<i> sends the global model plus a delta of norm
    0.01 (i + 1) in a direction seeded by (round, i), 10 + i examples, train loss loss(i)."""
    updates = []
    for d in plan.cohort:
        i = int(d[1:])
        gen = torch.Generator().manual_seed(plan.round * 1000 + i)
        state = dict(fed.global_state)
        draws = {k: torch.randn(v.shape, generator=gen) for k, v in state.items()}
        length = math.sqrt(sum(float((x * x).sum()) for x in draws.values()))
        for k, x in draws.items():
            state[k] = state[k] + 0.01 * (i + 1) * x / length
        updates.append(ClientUpdate(state, 10 + i, loss(i), d))
    return updates
