"""The n-gram an export ships for the keyboard to mix in: its file, its entry in the metadata, and
the mixture's weight.

The keyboard mixes the model with the n-gram linearly (fedkey.models.mixture, after Mikolov et
al. 2010, "Recurrent neural network based language model"): p(w) = weight * p_model(w) +
(1 - weight) * p_ngram(w), `weight` the model's share (1: the model alone). The export takes it
from the caller, else from the checkpoint's metrics row ("ngram_weight", chosen on the
validation text by a run with an n-gram), else from validation text (fedkey.models.mixture.
choose_weight over its GRID 0, 0.05, ..., 1), else DEFAULT_WEIGHT (`mixture_weight`).

The export copies the n-gram file (fedkey.models.ngram.KneserNey.save, format "fedkey-kn-1")
beside the model as ``<stem>.ngram.safetensors`` and records it in the metadata as "ngram"
(`ngram_entry`), after `read_ngram` has checked it against the model's vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedkey.models.mixture import choose_weight
from fedkey.models.ngram import KneserNey, mixture_share
from fedkey.models.tokenizers import Tokenizer, WordTokenizer

__all__ = [
    "DEFAULT_WEIGHT",
    "mixture_weight",
    "ngram_entry",
    "read_ngram",
    "row_weight",
    "target_probs",
]

#: The weight of an export that has neither a given weight, a measured one nor held-out text.
DEFAULT_WEIGHT = 0.5


def row_weight(row: Mapping[str, Any]) -> float | None:
    """The mixture weight a checkpoint's metrics row measured ("ngram_weight", the model's share,
    chosen on validation), when it holds a number in [0, 1]; else None."""
    return mixture_share(row.get("ngram_weight"))


def ngram_entry(
    file: str, data: bytes, lm: KneserNey, weight: float, weight_source: str
) -> dict[str, Any]:
    """The metadata's "ngram": the file beside the model, its sha256 and size, the mixture weight
    and where it came from ("argument", "metrics_row", "validation" or "default"), and what the
    n-gram is (order, the corpus it was trained on, its min_count)."""
    return {
        "file": file,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "weight": weight,
        "weight_source": weight_source,
        "order": lm.order,
        "corpus": lm.corpus,
        "min_count": lm.min_count,
    }


def read_ngram(path: str | Path, tokenizer: Tokenizer) -> tuple[bytes, KneserNey]:
    """The n-gram file's bytes and model, checked against a model's vocabulary: a one-line
    ValueError for a file that cannot be read, a foreign or damaged one, one of another
    vocabulary, or a model without a word vocabulary."""
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError(
            f"{path}: an n-gram needs a word-vocabulary model; this one uses a "
            f"{tokenizer.kind} tokenizer (export it without an n-gram)"
        )
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the n-gram file ({e.strerror or e})") from e
    return data, KneserNey.from_bytes(data, tokenizer, str(path))


def target_probs(
    lm: KneserNey, seqs: list[list[int]], model_logprobs: Iterable[tuple[int, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """The model's log-probability and the n-gram's probability of every held-out target (the
    ids of each encoded sentence but the first), aligned, for `mixture_weight`; `model_logprobs`
    yields (sentence index, [len - 1, vocab] log-probs), as
    fedkey.export.onnx_export.held_out_logprobs does."""
    model, ngram = [], []
    for i, logp in model_logprobs:
        rows, targets = np.arange(len(seqs[i]) - 1), np.asarray(seqs[i][1:])
        model.append(np.asarray(logp)[rows, targets].astype(np.float64))
        ngram.append(np.exp(lm.sentence_log_probs(seqs[i])[rows, targets]))
    return np.concatenate(model), np.concatenate(ngram)


def mixture_weight(
    given: float | None,
    row: Mapping[str, Any],
    targets: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[float, str, float | None]:
    """(the model's share, where it came from, the mixture's held-out perplexity at that share or
    None): `given` ("argument"), else the metrics row's ("metrics_row", `row_weight`), else the
    best of fedkey.models.mixture.GRID on the validation `targets` (`target_probs`; "validation"),
    else DEFAULT_WEIGHT ("default")."""
    weight: float | None
    if given is not None:
        weight, source = float(given), "argument"
    else:
        weight, source = row_weight(row), "metrics_row"
    if weight is not None:
        ppl = choose_weight(*targets, len(targets[0]), grid=[weight])[1] if targets else None
        return weight, source, ppl
    if targets is None:
        return DEFAULT_WEIGHT, "default", None
    lam, ppl = choose_weight(*targets, len(targets[0]))
    return lam, "validation", ppl
