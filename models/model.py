"""The keyboard's language model: embedding -> GRU/LSTM -> softmax over the vocabulary.

Kept small and readable in the spirit of pytorch/examples word_language_model. The recurrent
state goes in and comes out of `forward`, so a keyboard can feed one new word at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedkey.models.config import PRESETS, ModelConfig

__all__ = ["PRESETS", "LanguageModel", "ModelConfig", "State", "num_parameters"]

State = Tensor | tuple[Tensor, Tensor]


class LanguageModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        self.embedding = nn.Embedding(c.vocab_size, c.emb_size)
        rnn = nn.GRU if c.cell == "gru" else nn.LSTM
        self.rnn = rnn(
            c.emb_size,
            c.hidden_size,
            num_layers=c.num_layers,
            batch_first=True,
            dropout=c.dropout if c.num_layers > 1 else 0.0,
        )
        self.drop = nn.Dropout(c.dropout)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size)
        if c.tied:
            # Press & Wolf (2017): sharing input and output embeddings halves the parameters
            # that dominate a small keyboard model and improves perplexity.
            self.decoder.weight = self.embedding.weight
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if not self.config.tied:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """tokens [batch, time] -> (logits [batch, time, vocab], new recurrent state)."""
        out, state = self.encode(tokens, state)
        return self.decoder(self.drop(out)), state

    def encode(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """tokens [batch, time] -> (the recurrent layer's outputs [batch, time, hidden], state):
        what the softmax layer reads."""
        out, state = self.rnn(self.drop(self.embedding(tokens)), state)
        return out, state

    def logits_at(self, tokens: Tensor, keep: Tensor) -> Tensor:
        """Logits [n, vocab] at the n positions where `keep` [batch, time] is True, row by row.

        The softmax layer is most of the work (hidden x vocab products per word: 300 x 10k,
        against the GRU's 3 x 2 x 300 x 300), and a batch of sentences of unequal length is
        about half padding (PTB, batches of 10 in random order: 56% real words). Training and
        scoring run it, forward and backward, on the real words only. A `keep` on the CPU
        spares a GPU the sync of finding the positions."""
        out, _ = self.encode(tokens)
        index = keep.flatten().nonzero().squeeze(1).to(out.device)
        logits: Tensor = self.decoder(self.drop(out.flatten(0, 1).index_select(0, index)))
        return logits

    def init_state(self, batch_size: int) -> State:
        c = self.config
        h = torch.zeros(c.num_layers, batch_size, c.hidden_size, device=self.decoder.bias.device)
        return (h, h.clone()) if c.cell == "lstm" else h


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())
