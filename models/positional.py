"""A unigram by position in the sentence: the best score on the seed papers' column batches
(fedkey.models.batching.column_batches), scored as the n-grams are (fedkey.models.ngram.Scored).
Apart from fedkey.models.ngram, which the keyboard imports, since its column perplexity reads the
torch batches."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from fedkey.models.batching import column_batches, seeded_order
from fedkey.models.ngram import Scored
from fedkey.models.tokenizers import WordTokenizer

__all__ = ["PRIORS", "PositionalUnigram"]

#: The priors PositionalUnigram.choose_prior tries: 10, 31.6, 100, ... 100k.
PRIORS = tuple(10 ** (k / 2) for k in range(2, 11))


class PositionalUnigram(Scored):
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
        seqs = [self.tokenizer.encode(s) for s in sentences]
        nll, count = 0.0, 0
        for _, targets in column_batches(seqs, batch_size, seeded_order(len(seqs), seed)):
            for j, column in enumerate(targets.numpy()):
                nll -= float(self.position_log_probs(j)[column].sum())
                count += len(column)
        return math.exp(nll / max(count, 1))
