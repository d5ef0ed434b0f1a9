"""The Kneser-Ney n-gram: the model a keyboard would otherwise ship, and the one it mixes with the
neural model (the unigram by position of the seed papers' column batches is
fedkey.models.positional).

Chen & Goodman's interpolated Kneser-Ney with one absolute discount per order
(D = n1 / (n1 + 2 n2) from that order's count-of-counts): the highest order uses raw counts,
lower orders continuation counts (in how many distinct contexts a word follows), and the
unigram level is interpolated with the uniform distribution so no word gets zero probability.

Written here rather than taken from a library because a suggestion bar and top-k accuracy need
the whole next-word distribution at every position: nltk's KneserNeyInterpolated scores one word
per call (10k calls a position), and KenLM needs a compiled toolkit. `distribution` builds it
with two or three vector operations over the vocabulary.

A KneserNey model is a handful of sorted arrays, the same in memory and in its file
(`ngram.safetensors`, format "fedkey-kn-1", which the keyboard ships beside its ONNX model and
mixes with it): a context's row is found by binary search. This module imports numpy, the
standard library and (in save / load) safetensors, never torch: the web keyboard imports it.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from fedkey.common.files import atomic_write
from fedkey.models.scoring import Tally
from fedkey.models.tokenizers import WordTokenizer

if TYPE_CHECKING:  # never fedkey.models.metrics, which imports torch: the keyboard imports this
    from fedkey.models.scoring import Evaluation


def _discount(counts: np.ndarray) -> float:
    n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
    return n1 / (n1 + 2 * n2) if n1 + n2 else 0.5


#: The n-gram file's "format" (ngram.safetensors; the keyboard's browser mode parses it by hand).
KN_FORMAT = "fedkey-kn-1"
_LEVEL_DTYPES = {"ctx": np.int64, "off": np.int64, "gamma": np.float32, "word": np.int32,
                 "prob": np.float32}  # fmt: skip


def mix(model_log_probs: np.ndarray, ngram_probs: np.ndarray, lam: float) -> np.ndarray:
    """The keyboard's mixture, lam * p_model + (1 - lam) * p_ngram, float64, elementwise (lam = 1:
    the model's probabilities, lam = 0: the n-gram's, exactly): what fedkey.models.mixture scores
    and the keyboard serves (fedkey.keyboard_web.ngram)."""
    model = np.exp(np.asarray(model_log_probs, dtype=np.float64))
    mixed: np.ndarray = lam * model + (1.0 - lam) * np.asarray(ngram_probs, dtype=np.float64)
    return mixed


def mixture_share(value: Any) -> float | None:
    """`value` as the model's share of a mixture when it is a number in [0, 1] (not a bool), else
    None: how a recorded weight (an export's, a metrics row's) is read."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        return None
    return float(value)


def vocab_sha256(words: Sequence[str]) -> str:
    """sha256 hex of "\\n".join(words): the vocabulary an n-gram file and a model must share."""
    return hashlib.sha256("\n".join(words).encode()).hexdigest()


class Level(NamedTuple):
    """Level k >= 2 of a KneserNey model (context: the k-1 previous ids) as the file stores it.

    ctx: int64 [C] context keys, ascending (ids in base V, oldest first); off: int64 [C + 1],
    context i's rows are off[i]:off[i+1]; gamma: float32 [C], the mass context i leaves to the
    level below; word: int32 [E], next-word ids, ascending within a context; prob: float32 [E],
    their discounted probabilities max(c - D, 0) / total(context)."""

    ctx: np.ndarray
    off: np.ndarray
    gamma: np.ndarray
    word: np.ndarray
    prob: np.ndarray


def _level(keys: np.ndarray, counts: np.ndarray, vocab: int, min_count: int = 1) -> Level:
    """A level from its sorted n-gram keys (context * V + word) and their counts, with one
    discount D from the counts' count-of-counts. The n-grams seen fewer than `min_count` times are
    dropped and their mass goes to the level below: gamma = 1 - the kept probabilities (unpruned:
    D * N1+(context .) / total(context), the same number); a context left with none is dropped
    (gamma 1: the level below as it is)."""
    d = _discount(counts)
    contexts, words = np.divmod(keys, vocab)
    starts = np.flatnonzero(np.r_[True, contexts[1:] != contexts[:-1]])
    sizes = np.diff(np.r_[starts, len(keys)])
    totals = np.add.reduceat(counts, starts).astype(np.float64)
    group = np.repeat(np.arange(len(starts)), sizes)
    prob = np.maximum(counts - d, 0) / totals[group]
    if min_count <= 1:
        off, gamma, ctx = np.r_[starts, len(keys)], d * sizes / totals, contexts[starts]
    else:
        keep = counts >= min_count
        kept = np.bincount(group[keep], minlength=len(starts))
        mass = np.bincount(group[keep], weights=prob[keep], minlength=len(starts))
        alive = kept > 0
        off, gamma, ctx = (
            np.r_[0, np.cumsum(kept[alive])],
            (1 - mass)[alive],
            contexts[starts][alive],
        )
        words, prob = words[keep], prob[keep]
    return Level(ctx.astype(np.int64), off.astype(np.int64), gamma.astype(np.float32),
                 words.astype(np.int32), prob.astype(np.float32))  # fmt: skip


def _header(data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then the JSON)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("its header runs past the end of the file")
    header = json.loads(data[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def _check_level(k: int, lv: Level, vocab: int) -> None:
    """A ValueError when level k's arrays do not form a valid table (truncated, reordered)."""
    ok = (
        lv.ctx.ndim == lv.off.ndim == lv.gamma.ndim == lv.word.ndim == lv.prob.ndim == 1
        and len(lv.off) == len(lv.ctx) + 1 == len(lv.gamma) + 1
        and len(lv.word) == len(lv.prob) == int(lv.off[-1])
        and int(lv.off[0]) == 0
        and bool((np.diff(lv.off) > 0).all() and (np.diff(lv.ctx) > 0).all())
        and (len(lv.word) == 0 or (int(lv.word.min()) >= 0 and int(lv.word.max()) < vocab))
        and (len(lv.ctx) == 0 or (int(lv.ctx[0]) >= 0 and int(lv.ctx[-1]) < vocab ** (k - 1)))
    )
    if not ok:
        raise ValueError(f"level {k}'s tables are inconsistent (a damaged file)")


class Scored(ABC):
    """Scoring shared by the n-gram models, through the `sentence_log_probs(ids)` each defines."""

    tokenizer: WordTokenizer

    @abstractmethod
    def sentence_log_probs(self, ids: list[int]) -> np.ndarray:
        """[len(ids) - 1, vocab] log-probabilities of each next token of an encoded sentence."""

    def evaluate(self, sentences: list[str]) -> Evaluation:
        """Perplexity (</s> counted); top-1 / top-3 over the real words in the vocabulary, by the
        model's ranking and by the suggestion bar's (no </s>, <unk>); the bar's over every real
        word (all_top1, all_top3) and the out-of-vocabulary share (oov): as
        fedkey.models.metrics.evaluate, counted by the same fedkey.models.scoring.Tally."""
        tally, words = Tally.of(self.tokenizer), 0
        for s in sentences:
            ids = self.tokenizer.encode(s)
            tally.add(np.asarray(ids[1:]), self.sentence_log_probs(ids))
            words += len(ids) - 1
        return tally.result(words)


class KneserNey(Scored):
    """Order-n interpolated Kneser-Ney over token ids (sentences padded with n-2 extra <s>).

    The model is its arrays, the same ones its file holds (`save`, `load`; format "fedkey-kn-1"):
    `unigram` (float32 [V]) and `levels`, one `Level` per order k = 2 .. n (`levels[k - 2]`).
    """

    def __init__(self, tokenizer: WordTokenizer, order: int = 3):
        if order < 2:
            raise ValueError("order must be at least 2")
        if tokenizer.vocab_size**order >= 2**63:
            raise ValueError(f"order {order} over {tokenizer.vocab_size} words overflows int64")
        self.tokenizer, self.order, self.vocab = tokenizer, order, tokenizer.vocab_size
        self.min_count, self.sentences, self.tokens = 1, 0, 0
        self.corpus: str | None = None  # what a loaded file says it was trained on
        self.unigram = np.full(self.vocab, 1 / self.vocab, dtype=np.float32)
        self.levels: list[Level] = []

    def fit(self, sequences: Iterable[list[int]], min_count: int = 1) -> KneserNey:
        """Count the n-grams of encoded sentences (<s> ... </s>, as tokenizer.encode gives).

        `min_count`: the highest order keeps the n-grams seen at least that often (1: all); the
        mass of the others goes to the order below, so every distribution still sums to 1. The
        lower orders are never pruned (they are small)."""
        if min_count < 1:
            raise ValueError(f"min_count must be at least 1, got {min_count}")
        V, n = self.vocab, self.order
        grams, sentences, tokens = [], 0, 0
        for ids in sequences:
            sentences, tokens = sentences + 1, tokens + max(len(ids) - 1, 0)
            a = np.asarray([self.tokenizer.bos_id] * (n - 2) + list(ids), dtype=np.int64)
            if len(a) >= n:
                key = np.zeros(len(a) - n + 1, dtype=np.int64)
                for j in range(n):
                    key = key * V + a[j : len(a) - n + 1 + j]
                grams.append(key)
        if not grams:
            raise ValueError("no sentence long enough to train on")
        # The highest order: raw counts. Each lower order: continuation counts N1+(. context w),
        # the number of distinct words before it, read off the unique keys of the order above.
        keys, counts = np.unique(np.concatenate(grams), return_counts=True)
        levels = []  # highest order first
        for level in range(n, 1, -1):
            levels.append(_level(keys, counts, V, min_count if level == n else 1))
            keys, counts = np.unique(keys % V ** (level - 1), return_counts=True)
        d = _discount(counts)  # unigram continuation counts: keys are word ids now
        cont = np.zeros(V)
        cont[keys] = counts
        unigram = (np.maximum(cont - d, 0) + d * (cont > 0).sum() / V) / cont.sum()
        self.unigram, self.levels = unigram.astype(np.float32), levels[::-1]
        self.min_count, self.sentences, self.tokens = min_count, sentences, tokens
        return self

    def distribution(self, context: Sequence[int]) -> np.ndarray:
        """P(next word | context), float64 [V]: `context` is the sentence so far from its <s>;
        it is padded in front with order-2 <s> (as in training) and its last order-1 ids read.

        p = unigram; for k = 2 .. order: when the last k-1 ids are a context of level k (one
        binary search), p = gamma * p, plus the context's discounted probabilities."""
        ctx = [self.tokenizer.bos_id] * (self.order - 2) + list(context[-(self.order - 1) :])
        p = self.unigram.astype(np.float64)
        for k, lv in enumerate(self.levels, start=2):
            if len(ctx) < k - 1:
                break
            key = 0
            for t in ctx[len(ctx) - (k - 1) :]:
                key = key * self.vocab + t
            i = int(np.searchsorted(lv.ctx, key))
            if i == len(lv.ctx) or lv.ctx[i] != key:
                continue
            lo, hi = lv.off[i], lv.off[i + 1]
            p *= float(lv.gamma[i])
            p[lv.word[lo:hi]] += lv.prob[lo:hi]
        return p

    def sentence_log_probs(self, ids: list[int]) -> np.ndarray:
        """[len(ids) - 1, vocab] log-probabilities of each next token of an encoded sentence."""
        rows = [self.distribution(ids[: i + 1]) for i in range(len(ids) - 1)]
        log_probs: np.ndarray = np.log(np.stack(rows))
        return log_probs

    # -- the file (fedkey-kn-1) ------------------------------------------------------------------

    def to_bytes(self, corpus: str) -> bytes:
        """The safetensors file: `unigram`, `ctx{k}` `off{k}` `gamma{k}` `word{k}` `prob{k}` for
        k = 2 .. order, and string metadata (format, order, vocab_size, vocab_sha256, min_count,
        the `corpus` it was trained on, sentences, tokens)."""
        from safetensors.numpy import save  # imported here: the keyboard imports this module

        tensors = {"unigram": self.unigram}
        for k, lv in enumerate(self.levels, start=2):
            tensors.update({f"{name}{k}": arr for name, arr in zip(Level._fields, lv, strict=True)})
        meta = {
            "format": KN_FORMAT,
            "order": str(self.order),
            "vocab_size": str(self.vocab),
            "vocab_sha256": vocab_sha256(self.tokenizer.itos),
            "min_count": str(self.min_count),
            "corpus": corpus,
            "sentences": str(self.sentences),
            "tokens": str(self.tokens),
        }
        data: bytes = save(tensors, metadata=meta)
        return data

    def save(self, path: str | Path, corpus: str) -> Path:
        """Write the model to `path` atomically (see `to_bytes`); -> `path`."""
        return atomic_write(path, self.to_bytes(corpus))

    @classmethod
    def load(cls, path: str | Path, tokenizer: WordTokenizer) -> KneserNey:
        """The model in the file at `path`, for `tokenizer`'s vocabulary. Raises ValueError (one
        line: what is wrong, what to do) for a file that cannot be read, is not a fedkey-kn-1
        file or was built for another vocabulary."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{path}: cannot read the n-gram file ({e.strerror or e})") from e
        return cls.from_bytes(data, tokenizer, str(path))

    @classmethod
    def from_bytes(
        cls, data: bytes, tokenizer: WordTokenizer, source: str = "the n-gram file"
    ) -> KneserNey:
        """`load` from the file's bytes (`source` names it in errors)."""
        from safetensors.numpy import load

        try:
            meta = _header(data).get("__metadata__") or {}
            tensors = load(data)
        except Exception as e:  # safetensors' own error type, a JSON error, a short header
            raise ValueError(
                f"{source}: not a safetensors file ({type(e).__name__}: {e}); export the n-gram "
                "again (KneserNey.save)"
            ) from None
        fmt = meta.get("format")
        if fmt != KN_FORMAT:
            raise ValueError(
                f"{source}: format {fmt!r}, expected {KN_FORMAT!r}: not a fedkey n-gram file; "
                "save one with KneserNey.save"
            )
        words = list(tokenizer.itos)
        if meta.get("vocab_sha256") != vocab_sha256(words):
            raise ValueError(
                f"{source}: built for another vocabulary ({meta.get('vocab_size')} words, sha256 "
                f"{str(meta.get('vocab_sha256'))[:12]}...) than this one ({len(words)} words, "
                f"{vocab_sha256(words)[:12]}...); fit the n-gram on the model's own vocabulary"
            )
        try:
            order = int(meta["order"])
            lm = cls(tokenizer, order)
            lm.min_count, lm.sentences = int(meta["min_count"]), int(meta["sentences"])
            lm.tokens, lm.corpus = int(meta["tokens"]), str(meta.get("corpus", ""))
            lm.unigram = tensors["unigram"]
            lm.levels = [
                Level(*(tensors[f"{name}{k}"] for name in Level._fields))
                for k in range(2, order + 1)
            ]
            if lm.unigram.shape != (lm.vocab,) or lm.unigram.dtype != np.float32:
                raise ValueError("unigram is not float32 [vocab]")
            for k, lv in enumerate(lm.levels, start=2):
                for name, arr in zip(Level._fields, lv, strict=True):
                    if arr.dtype != _LEVEL_DTYPES[name]:
                        raise ValueError(f"{name}{k} is {arr.dtype}, not {_LEVEL_DTYPES[name]}")
                _check_level(k, lv, lm.vocab)
        except (KeyError, ValueError) as e:
            what = f"{e.args[0]} is missing" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{source}: a damaged n-gram file ({what}); save it again") from None
        return lm
