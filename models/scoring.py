"""The counts behind every evaluation's figures: one rule for the neural model
(fedkey.models.metrics.evaluate), the n-grams (fedkey.models.ngram) and their mixture
(fedkey.models.mixture), on numpy arrays or torch tensors alike.

A target's rank in a row of scores (log-probabilities, or anything that orders as they do) is the
number of tokens that score higher, a tie going to the lower vocabulary id (the suggestion bar's
rule: fedkey.models.bar); the bar's rank leaves out the special tokens it never shows. A target
whose score is NaN (a diverged model) ranks last.

This module imports numpy alone, never torch (the web keyboard imports fedkey.models.ngram, which
uses it): a torch tensor brings its own methods.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import numpy as np

from fedkey.models.tokenizers import Tokenizer, WordTokenizer

#: The ranks below which a target counts as a hit: top-1 and top-3.
TOP = 3


class Evaluation(TypedDict):
    """What :func:`fedkey.models.metrics.evaluate` (and the n-gram models' `evaluate`) report on
    held-out sentences."""

    ppl: float
    nll: float
    words: int
    top1: float | None  # None for SentencePiece, or when no target is a real word
    top3: float | None
    bar_top1: float | None  # the suggestion bar's ranking: </s> and <unk> never shown
    bar_top3: float | None
    all_top1: float | None  # bar_top1 over every real word, an out-of-vocabulary one a miss
    all_top3: float | None
    oov: float | None  # the share of real words out of the vocabulary (<unk>)


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL), inf past the float range (a diverged model: a x100 update, say)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def _arange(n: int, ids: Any) -> Any:
    """0 .. n - 1, as the kind of array `ids` (an integer array) is, on its device."""
    if isinstance(ids, np.ndarray):
        return np.arange(n)
    return ids.new_ones(n).cumsum(0) - 1  # a torch tensor's, without importing torch here


def target_ranks(scores: Any, targets: Any, special_ids: list[int]) -> tuple[Any, Any]:
    """(rank, bar rank) of each row's target: `scores` [n, vocab], `targets` [n] (numpy or torch).

    rank: the tokens ahead of the target (higher score, or equal with a lower id); bar rank: the
    same without `special_ids`. Both are exact below TOP and at least TOP otherwise (the ties are
    counted only where they can decide a hit)."""
    at = scores[_arange(len(targets), targets), targets][:, None]
    ahead = scores > at
    rank = ahead.sum(-1)
    special = ahead[:, special_ids].sum(-1)
    close = (rank - special) < TOP  # where ties can still bring the target into the top 3
    if bool(close.any()):
        lower = _arange(scores.shape[1], targets)[None, :] < targets[close][:, None]
        tied = (scores[close] == at[close]) & lower
        rank[close] += tied.sum(-1)
        special[close] += tied[:, special_ids].sum(-1)
    bar = rank - special
    diverged = (at != at)[:, 0]  # NaN
    rank[diverged] = TOP
    bar[diverged] = TOP
    return rank, bar


class Tally:
    """The running sums of one evaluation: the NLL of every target, and for the real words (every
    target but </s>) the hits of the model's ranking and of the bar's.

    top1/top3 and bar_top1/bar_top3 count the targets in the vocabulary (not <unk>); all_top1 and
    all_top3 are bar_top1/bar_top3 over every real word, an out-of-vocabulary one counting as a
    miss (so vocabularies of different sizes compare fairly); oov is the share of real words that
    are <unk>. With `accuracy` False (as `of` sets it for a SentencePiece vocabulary) they are
    None and only the NLL is summed."""

    def __init__(self, special_ids: list[int], unk_id: int, eos_id: int, accuracy: bool = True):
        self.special_ids, self.unk_id, self.eos_id = list(special_ids), unk_id, eos_id
        self.accuracy = accuracy
        self.nll = 0.0
        self.hits = dict.fromkeys(("top1", "top3", "bar_top1", "bar_top3"), 0)
        self.known = 0  # real words in the vocabulary
        self.unknown = 0  # real words out of it

    @classmethod
    def of(cls, tokenizer: Tokenizer, accuracy: bool = True) -> Tally:
        """A tally for `tokenizer`'s ids; accuracy only for a word vocabulary."""
        word_level = accuracy and isinstance(tokenizer, WordTokenizer)
        return cls(tokenizer.special_ids, tokenizer.unk_id, tokenizer.eos_id, word_level)

    def add(self, targets: Any, scores: Any, target_log_probs: Any = None) -> None:
        """One batch: `targets` [n], `scores` [n, vocab] (log-probabilities, or anything that ranks
        as they do), `target_log_probs` [n] (default: read off `scores`)."""
        if target_log_probs is None:
            target_log_probs = scores[_arange(len(targets), targets), targets]
        self.nll -= float(target_log_probs.sum())
        if not self.accuracy:
            return
        real = targets != self.eos_id
        known = real & (targets != self.unk_id)
        rank, bar = target_ranks(scores, targets, self.special_ids)
        for name, r in (("top", rank), ("bar_top", bar)):
            self.hits[name + "1"] += int((known & (r < 1)).sum())
            self.hits[name + "3"] += int((known & (r < TOP)).sum())
        self.known += int(known.sum())
        self.unknown += int((real & ~known).sum())

    def merge(self, other: Tally) -> None:
        """Add `other`'s sums (a tally of other sentences, with the same ids): the tallies of a
        set's parts, scored apart (fedkey.models.held_out), make the set's."""
        self.nll += other.nll
        for name, hits in other.hits.items():
            self.hits[name] += hits
        self.known += other.known
        self.unknown += other.unknown

    def result(self, words: int) -> Evaluation:
        """The figures, perplexity per `words` (the predicted words, end of sentence counted)."""
        real = self.known + self.unknown
        on = self.accuracy

        def share(hits: int, of: int) -> float | None:
            return hits / of if on and of else None

        hits = self.hits
        return {
            "ppl": perplexity(self.nll / max(words, 1)),
            "nll": self.nll,
            "words": words,
            "top1": share(hits["top1"], self.known),
            "top3": share(hits["top3"], self.known),
            "bar_top1": share(hits["bar_top1"], self.known),
            "bar_top3": share(hits["bar_top3"], self.known),
            "all_top1": share(hits["bar_top1"], real),
            "all_top3": share(hits["bar_top3"], real),
            "oov": share(self.unknown, real),
        }
