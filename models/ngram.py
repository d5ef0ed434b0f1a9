"""N-gram baselines: interpolated Kneser-Ney, the model a keyboard would otherwise ship, and a
unigram by position in the sentence, the best score on the seed papers' column batches.

Chen & Goodman's interpolated Kneser-Ney with one absolute discount per order
(D = n1 / (n1 + 2 n2) from that order's count-of-counts): the highest order uses raw counts,
lower orders continuation counts (in how many distinct contexts a word follows), and the
unigram level is interpolated with the uniform distribution so no word gets zero probability.

Written here rather than taken from a library because a suggestion bar and top-k accuracy need
the whole next-word distribution at every position: nltk's KneserNeyInterpolated scores one word
per call (10k calls a position), and KenLM needs a compiled toolkit. `distribution` builds it
with two or three vector operations over the vocabulary.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from fedkey.models.tokenizers import WordTokenizer

if TYPE_CHECKING:  # fedkey.models.metrics imports torch; this module does not
    from fedkey.models.metrics import Evaluation


def _discount(counts: np.ndarray) -> float:
    n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
    return n1 / (n1 + 2 * n2) if n1 + n2 else 0.5


def _grouped(
    keys: np.ndarray, values: np.ndarray, vocab: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """context key -> (next-word ids, values), from sorted keys context * vocab + word."""
    contexts, words = np.divmod(keys, vocab)
    cut = np.flatnonzero(np.diff(contexts)) + 1
    return {
        int(c[0]): (w, v)
        for c, w, v in zip(
            np.split(contexts, cut), np.split(words, cut), np.split(values, cut), strict=True
        )
    }


class _Scored(ABC):
    """Scoring shared by the n-gram models, through the `sentence_log_probs(ids)` each defines."""

    tokenizer: WordTokenizer

    @abstractmethod
    def sentence_log_probs(self, ids: list[int]) -> np.ndarray:
        """[len(ids) - 1, vocab] log-probabilities of each next token of an encoded sentence."""

    def evaluate(self, sentences: list[str]) -> Evaluation:
        """Perplexity (</s> counted), top-1 / top-3 over real words, by the model's ranking and
        by the suggestion bar's (no </s>, <unk>): as fedkey.models.metrics.evaluate."""
        tok = self.tokenizer
        nll, words, scored = 0.0, 0, 0
        hits = {"top1": 0, "top3": 0, "bar_top1": 0, "bar_top3": 0}
        for s in sentences:
            ids = tok.encode(s)
            logp = self.sentence_log_probs(ids)
            targets = np.asarray(ids[1:])
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            words += len(targets)
            real = (targets != tok.eos_id) & (targets != tok.unk_id)
            for prefix in ("", "bar_"):
                if prefix:  # the bar's ranking: the specials never shown
                    logp[:, tok.special_ids] = -np.inf
                top3 = np.argsort(-logp, axis=1)[:, :3]
                hits[prefix + "top1"] += int(((top3[:, 0] == targets) & real).sum())
                hits[prefix + "top3"] += int(((top3 == targets[:, None]).any(1) & real).sum())
            scored += int(real.sum())
        shares = {k: v / max(scored, 1) for k, v in hits.items()}
        return {"ppl": math.exp(nll / max(words, 1)), "nll": nll, "words": words,
                **shares}  # type: ignore[typeddict-item]  # fmt: skip


class KneserNey(_Scored):
    """Order-n interpolated Kneser-Ney over token ids (sentences padded with n-1 <s>)."""

    def __init__(self, tokenizer: WordTokenizer, order: int = 3):
        if order < 2:
            raise ValueError("order must be at least 2")
        self.tokenizer, self.order, self.vocab = tokenizer, order, tokenizer.vocab_size

    def fit(self, sequences: Iterable[list[int]]) -> KneserNey:
        """Count the n-grams of encoded sentences (<s> ... </s>, as tokenizer.encode gives)."""
        V, n = self.vocab, self.order
        grams = []
        for ids in sequences:
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
        # [(discount, {context: (words, counts)})], highest order first
        self.levels: list[tuple[float, dict[int, tuple[np.ndarray, np.ndarray]]]] = []
        for level in range(n, 1, -1):
            self.levels.append((_discount(counts), _grouped(keys, counts, V)))
            keys, counts = np.unique(keys % V ** (level - 1), return_counts=True)
        d = _discount(counts)  # unigram continuation counts: keys are word ids now
        cont = np.zeros(V)
        cont[keys] = counts
        total = cont.sum()
        self.unigram = (np.maximum(cont - d, 0) + d * (cont > 0).sum() / V) / total
        return self

    def distribution(self, context: list[int]) -> np.ndarray:
        """P(next word | the last order-1 ids of `context`), a vector over the vocabulary."""
        p: np.ndarray = self.unigram
        for k, (d, table) in enumerate(reversed(self.levels), start=1):  # bigram, trigram, ...
            key = 0
            for t in context[-k:]:
                key = key * self.vocab + t
            hit = table.get(key)
            if hit is None:
                continue
            words, counts = hit
            total = counts.sum()
            p = (d * len(words) / total) * p
            p[words] += np.maximum(counts - d, 0) / total
        return p

    def sentence_log_probs(self, ids: list[int]) -> np.ndarray:
        """[len(ids) - 1, vocab] log-probabilities of each next token of an encoded sentence."""
        pad = [self.tokenizer.bos_id] * (self.order - 2)
        ctx = pad + list(ids)
        rows = [self.distribution(ctx[: len(pad) + i + 1]) for i in range(len(ids) - 1)]
        log_probs: np.ndarray = np.log(np.stack(rows))
        return log_probs


#: The priors PositionalUnigram.choose_prior tries: 10, 31.6, 100, ... 100k.
PRIORS = tuple(10 ** (k / 2) for k in range(2, 11))


class PositionalUnigram(_Scored):
    """P(w | j): how often token j of a training sentence is w (<s> is token 0), blended with
    the unigram by a pseudo-count `prior` so that unseen words keep some mass; positions past
    `max_position` share one distribution.

    It knows nothing but where a word stands in its sentence, so as a language model it is
    weak; on the seed papers' column batches (fedkey.models.batching.column_batches), where everything
    before a token is the same position of other sentences, that is all there is to know.
    """

    def __init__(self, tokenizer: WordTokenizer, max_position: int = 60, prior: float = 100.0):
        self.tokenizer, self.max_position, self.prior = tokenizer, max_position, prior
        self.vocab = tokenizer.vocab_size

    def fit(self, sequences: Iterable[list[int]]) -> PositionalUnigram:
        self.counts = np.zeros((self.max_position + 1, self.vocab))
        for ids in sequences:
            pos = np.minimum(np.arange(len(ids)), self.max_position)
            np.add.at(self.counts, (pos, np.asarray(ids)), 1)
        self.unigram = self.counts.sum(0) + 0.1  # add-0.1: every word possible
        self.unigram /= self.unigram.sum()
        return self.set_prior(self.prior)

    def set_prior(self, prior: float) -> PositionalUnigram:
        self.prior = prior
        self.log_probs: np.ndarray = np.log(
            (self.counts + prior * self.unigram) / (self.counts.sum(1, keepdims=True) + prior)
        )
        return self

    def choose_prior(
        self,
        sentences: list[str],
        candidates: Iterable[float] = PRIORS,
    ) -> PositionalUnigram:
        """Keep the prior (10 ... 100k) with the lowest column perplexity on held-out
        `sentences`."""
        scores = {p: self.set_prior(p).column_perplexity(sentences) for p in candidates}
        return self.set_prior(min(scores, key=scores.__getitem__))

    def position_log_probs(self, position: int) -> np.ndarray:
        row: np.ndarray = self.log_probs[min(position, self.max_position)]
        return row

    def sentence_log_probs(self, ids: list[int]) -> np.ndarray:
        return np.stack([self.position_log_probs(j) for j in range(1, len(ids))])

    def column_perplexity(
        self, sentences: list[str], batch_size: int = 128, seed: int = 0
    ) -> float:
        """fedkey.models.metrics.column_perplexity for this model: the targets of column j are token j
        of their sentences, scored by P(. | j)."""
        from fedkey.models.batching import column_batches, seeded_order

        seqs = [self.tokenizer.encode(s) for s in sentences]
        nll, count = 0.0, 0
        for _, targets in column_batches(seqs, batch_size, seeded_order(len(seqs), seed)):
            for j, column in enumerate(targets.numpy()):
                nll -= float(self.position_log_probs(j)[column].sum())
                count += len(column)
        return math.exp(nll / max(count, 1))
