"""A base model's vocabulary extended with new words: the model surgery, and the out-of-vocabulary
rate it is measured by.

The new words go at the end of the tokenizer's word list, so every old word keeps its id. Each
gets a row of the embedding (and of an untied decoder) copied from ``<unk>``'s, the word the
model saw wherever the new word was typed; so a new word read as input moves the model exactly
as ``<unk>`` did. On the output side the new words share ``<unk>``'s probability: ``<unk>``'s
decoder bias and each new word's are ``<unk>``'s minus ``log(m + 1)`` for m new words, so that
``P(<unk>) + sum P(new word)`` is the base's ``P(<unk>)`` and every old word's probability is
the base's, after any context (:func:`extend_state`). Before fine-tuning the extended model
scores the base's vocabulary exactly as the base did; a new word scores ``<unk>``'s share, and
an ``<unk>`` target ``log(m + 1)`` less than before. Fine-tuning (``--init NEW_BASE``) then
learns the new words from the phones' text, encoded with the extended vocabulary.

The extended base is a new checkpoint (:func:`extend_base`): the base's metadata with the larger
``model.vocab_size`` and word list, and a ``"vocabulary"`` list of notes, one per extension, of
what was added and with what guarantee.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.common.files import atomic_write
from fedkey.models.base import base_path, header_metadata
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import WordTokenizer, tokenizer_from_config

__all__ = ["extend_base", "extend_state", "extend_tokenizer", "oov_rate", "word_tokenizer"]

#: The metadata key of the notes of an extended base (one per extension, oldest first).
NOTE_KEY = "vocabulary"


def word_tokenizer(meta: Mapping[str, Any], name: str) -> WordTokenizer:
    """The base's word vocabulary; a ValueError in one line for a SentencePiece base (its
    pieces already spell any word: there is no word list to extend)."""
    tokenizer = tokenizer_from_config(meta["tokenizer"])
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError(
            f"--init {name}: a SentencePiece base has no out-of-vocabulary words to add "
            "(its pieces spell any word); give a base with a word vocabulary"
        )
    return tokenizer


def extend_tokenizer(tokenizer: WordTokenizer, words: Sequence[str]) -> WordTokenizer:
    """The vocabulary with `words` appended in their order (old ids unchanged); a ValueError for
    a word it holds already, a repeated word or one with a space."""
    if len(set(words)) != len(words):
        raise ValueError("the words to add repeat one another")
    held = [w for w in words if w in tokenizer.stoi]
    if held:
        raise ValueError(f"already in the vocabulary: {held[:5]}")
    spaced = [w for w in words if not w or w != w.strip() or " " in w]
    if spaced:
        raise ValueError(f"not single words: {spaced[:5]}")
    return WordTokenizer([*tokenizer.itos, *words])


def _grow(rows: torch.Tensor, unk: int, count: int) -> torch.Tensor:
    """`rows` with `count` copies of row `unk` appended."""
    return torch.cat([rows, rows[unk : unk + 1].expand(count, *rows.shape[1:])])


def extend_state(
    state: Mapping[str, torch.Tensor], config: ModelConfig, unk_id: int, count: int
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The model's tensors and config with `count` new words at the end (see the module's
    docstring): embedding rows (and an untied decoder's) copied from ``<unk>``'s; ``<unk>``'s
    and the new words' decoder biases ``<unk>``'s minus ``log(count + 1)``, computed in float64
    and stored in the bias's own dtype."""
    new_config = ModelConfig(**{**config.to_dict(), "vocab_size": config.vocab_size + count})
    out = dict(state)
    if count == 0:
        return out, new_config
    out["embedding.weight"] = _grow(state["embedding.weight"], unk_id, count)
    if "decoder.weight" in state:  # untied: the decoder has rows of its own
        out["decoder.weight"] = _grow(state["decoder.weight"], unk_id, count)
    bias = state["decoder.bias"]
    shared = bias[unk_id].double() - math.log(count + 1)
    grown = torch.cat([bias.double(), shared.expand(count)])
    grown[unk_id] = shared
    out["decoder.bias"] = grown.to(bias.dtype)
    return out, new_config


def extend_base(
    base: str | Path, out: str | Path, words: Sequence[str], note: Mapping[str, Any]
) -> Path:
    """Write the base checkpoint `base` ("base": the shipped one) extended with `words` to
    `out` (atomic): its weights in their dtype, its metadata with the new model size and word
    list and `note` (with "added": the words) appended to its "vocabulary" notes."""
    source = base_path(base)
    meta: dict[str, Any] = json.loads(header_metadata(source)["fedkey"])
    tokenizer = word_tokenizer(meta, str(base))
    extended = extend_tokenizer(tokenizer, words)
    state = st_load(source.read_bytes())
    grown, config = extend_state(state, ModelConfig(**meta["model"]), tokenizer.unk_id, len(words))
    notes = list(meta.get(NOTE_KEY, []))
    notes.append({**note, "added": list(words), "size_before": tokenizer.vocab_size})
    meta.update(model=config.to_dict(), tokenizer=extended.to_config(), **{NOTE_KEY: notes})
    data = st_save(
        {k: v.contiguous() for k, v in grown.items()}, metadata={"fedkey": json.dumps(meta)}
    )
    target = Path(out).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(target, data)


def oov_rate(tokenizer: WordTokenizer, sentences: Iterable[str]) -> float | None:
    """The share of real-word targets (every predicted token but ``</s>``) that are ``<unk>``:
    fedkey.models.metrics' out-of-vocabulary rate, counted without a model. None without a word."""
    unk = words = 0
    for sentence in sentences:
        targets = tokenizer.encode(sentence)[1:-1]  # neither <s> (input only) nor </s>
        words += len(targets)
        unk += sum(1 for t in targets if t == tokenizer.unk_id)
    return unk / words if words else None
