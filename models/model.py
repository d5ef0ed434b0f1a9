"""The keyboard's language model: embedding -> GRU/LSTM -> softmax over the vocabulary.

Kept small and readable in the spirit of pytorch/examples word_language_model. The recurrent
state goes in and comes out of `forward`, so a keyboard can feed one new word at a time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

# The seeds' sizes: embedding = hidden, 1-layer GRU, tied embeddings for "small".
PRESETS: dict[str, int] = {"small": 300, "medium": 650, "large": 1500}

State = Tensor | tuple[Tensor, Tensor]


@dataclass
class ModelConfig:
    vocab_size: int
    cell: str = "gru"  # "gru" | "lstm"
    emb_size: int = 300
    hidden_size: int = 300
    num_layers: int = 1
    tied: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.cell not in ("gru", "lstm"):
            raise ValueError(f"cell must be 'gru' or 'lstm', got {self.cell!r}")
        if self.tied and self.emb_size != self.hidden_size:
            raise ValueError(
                f"tied embeddings need emb_size == hidden_size (got {self.emb_size} and {self.hidden_size})"
            )

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides) -> ModelConfig:
        """small / medium / large as in the seeds (emb = hidden = 300 / 650 / 1500)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        size = PRESETS[name]
        return cls(vocab_size=vocab_size, emb_size=size, hidden_size=size, **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


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
        x = self.drop(self.embedding(tokens))
        out, state = self.rnn(x, state)
        return self.decoder(self.drop(out)), state

    def init_state(self, batch_size: int) -> State:
        c = self.config
        h = torch.zeros(c.num_layers, batch_size, c.hidden_size, device=self.decoder.bias.device)
        return (h, h.clone()) if c.cell == "lstm" else h


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())
