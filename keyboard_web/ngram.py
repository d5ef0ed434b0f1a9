"""The n-gram an export mixes into the keyboard's suggestions (numpy + stdlib + safetensors).

An export may name an n-gram beside its model (the metadata's "ngram", written by
fedkey.export.onnx_export.export_checkpoint: {"file", "sha256", "weight", "order", "corpus",
"min_count", ...}). The keyboard mixes it in linearly (fedkey.models.ngram.mix, what
fedkey.models.mixture scores):

    p(w) = weight * p_model(w) + (1 - weight) * p_ngram(w)

A file that is missing, does not match the export's sha256, is damaged or was built for another
vocabulary is not used: the model suggests alone and `ServedNgram.error` says why (GET /api/info
shows it); the keyboard never fails for it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedkey.models.ngram import KneserNey, mix, mixture_share
from fedkey.models.tokenizers import WordTokenizer

__all__ = ["ServedNgram", "mix_log_probs"]


def mix_log_probs(model_logprobs: np.ndarray, ngram_probs: np.ndarray, weight: float) -> np.ndarray:
    """log(weight * exp(model_logprobs) + (1 - weight) * ngram_probs), float64, elementwise."""
    with np.errstate(divide="ignore"):
        out: np.ndarray = np.log(mix(model_logprobs, ngram_probs, weight))
    return out


def _weight(entry: dict) -> float:
    w = mixture_share(entry.get("weight"))
    if w is None:
        raise ValueError(f"its weight {entry.get('weight')!r} is not a number in [0, 1]")
    return w


def _read(onnx_path: Path, entry: dict, words: list[str]) -> tuple[KneserNey, bytes, float]:
    """The n-gram `entry` names beside `onnx_path`, checked (sha256, format, vocabulary)."""
    name = entry.get("file")
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"its file {name!r} is not a file name beside the model")
    weight = _weight(entry)
    try:
        data = (onnx_path.parent / name).read_bytes()
    except OSError as e:
        raise ValueError(f"{name} cannot be read ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise ValueError(f"{name} does not match the export's sha256 (replaced or damaged)")
    return KneserNey.from_bytes(data, WordTokenizer(words), name), data, weight


@dataclass(frozen=True)
class ServedNgram:
    """The served export's n-gram: loaded (`lm`, its file's `data`, the model's share `weight`),
    or not (`lm` None; `error` says why when the export names one)."""

    entry: dict[str, Any] | None = None  # the metadata's "ngram" (None: the export names none)
    lm: KneserNey | None = None
    data: bytes = b""
    weight: float = 1.0
    error: str | None = None

    @classmethod
    def load(cls, onnx_path: Path, metadata: dict, words: list[str]) -> ServedNgram:
        """The n-gram the export's metadata names, or why it is not used (never raises)."""
        entry = metadata.get("ngram")
        if not isinstance(entry, dict):
            return cls()
        if not words:
            return cls(entry, error="the model has no word vocabulary to mix an n-gram with")
        try:
            lm, data, weight = _read(onnx_path, entry, words)
        except ValueError as e:
            msg = f"the n-gram is not used, suggestions come from the model alone: {e}"
            return cls(entry, error=msg.replace("\n", " "))
        return cls(entry, lm, data, weight)

    def mix(self, model_logprobs: np.ndarray, context: list[int]) -> np.ndarray:
        """The next word's log-probabilities: the model's (float32 [vocab]) mixed with the
        n-gram's after `context` (the sentence's ids from its <s>), float32; the model's own
        without an n-gram."""
        if self.lm is None:
            return model_logprobs
        mixed = mix_log_probs(model_logprobs, self.lm.distribution(context), self.weight)
        return mixed.astype(np.float32)

    def info(self) -> dict[str, Any] | None:
        """For GET /api/info: None when the export names no n-gram; else whether it is used
        ("active"), its order, weight, corpus, min_count, size in bytes and file, and why it is
        not used ("error")."""
        if self.entry is None:
            return None
        e, lm = self.entry, self.lm

        def fact(key: str) -> Any:
            v = e.get(key)
            ok = isinstance(v, str | int) or (isinstance(v, float) and math.isfinite(v))
            return v if ok else None

        return {
            "active": lm is not None,
            "order": lm.order if lm is not None else fact("order"),
            "weight": self.weight if lm is not None else fact("weight"),
            "weight_source": fact("weight_source"),
            "corpus": lm.corpus if lm is not None else fact("corpus"),
            "min_count": lm.min_count if lm is not None else fact("min_count"),
            "bytes": len(self.data) if lm is not None else None,
            "file": fact("file"),
            "error": self.error,
        }
