"""The language model's shape, as plain data: what a checkpoint records and the command line sets.
Standard library only (no torch), so `fedkey --help` stays fast."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict, Unpack, get_args

Cell = Literal["gru", "lstm"]
CELLS: tuple[Cell, ...] = get_args(Cell)

# The seed papers' sizes: embedding = hidden, 1-layer GRU, tied embeddings for "small".
Preset = Literal["small", "medium", "large"]
PRESETS: dict[Preset, int] = {"small": 300, "medium": 650, "large": 1500}


class ModelOverrides(TypedDict, total=False):
    """The fields of a ModelConfig that a preset leaves free (its sizes are the preset's)."""

    cell: Cell
    num_layers: int
    tied: bool
    dropout: float


@dataclass
class ModelConfig:
    vocab_size: int
    cell: Cell = "gru"
    emb_size: int = 300
    hidden_size: int = 300
    num_layers: int = 1
    tied: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.cell not in CELLS:
            raise ValueError(f"cell must be 'gru' or 'lstm', got {self.cell!r}")
        if self.tied and self.emb_size != self.hidden_size:
            raise ValueError(
                f"tied embeddings need emb_size == hidden_size (got {self.emb_size} and {self.hidden_size})"
            )

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: Unpack[ModelOverrides]) -> ModelConfig:
        """small / medium / large as in the seed papers (emb = hidden = 300 / 650 / 1500)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        size = PRESETS[name]
        return cls(vocab_size=vocab_size, emb_size=size, hidden_size=size, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
