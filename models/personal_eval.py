"""The personal cache measured as the cache-model papers measure it: a user's messages in order.

Each held-out sender's messages are scored in time order, the cache (fedkey.models.personal)
holding the messages of that sender already scored: a message is learned after it is scored, so
it is never helped by itself or by a later one (Kuhn & De Mori 1990; the same protocol as the
adaptive text-prediction literature, e.g. Trnka & McCoy 2008, "Evaluating word prediction:
framing keystroke savings"). The base is any next-word model: a callable from an encoded message
(``tokenizer.encode``) to its next-token probabilities, [len(ids) - 1, vocab], so a Kneser-Ney
n-gram, the neural model or their mixture plugs in.

The fields (as fedkey.models.metrics names them, for the bar with the cache mixed in):

- ``all_top1`` / ``all_top3``: the bar's ranking by probability (the specials never shown, the
  cache's words outside the vocabulary shown), over EVERY real-word target (every target but
  </s>); a word outside the vocabulary is a hit when the cache ranks it.
- ``bar_top1`` / ``bar_top3``: the same ranking over the targets in the vocabulary only (not
  </s>, not <unk>), the denominator of fedkey.models.metrics' bar_top1.
- ``oov``: the share of the real-word targets outside the vocabulary.
- ``ksr``: keystroke savings with the bar of fedkey.models.bar (P(w) * (len(w) - typed)), its
  candidates the suggestible vocabulary words and the cache's words that complete what is typed.
  :func:`fedkey.models.metrics.keystroke_savings_of` scores the same bar without a cache; it takes
  no extra words, so the bar is simulated here again (and this module stays free of torch).

Ties go to the lower vocabulary id, a word outside the vocabulary after every vocabulary word
and among them by code point, as the web keyboard's TopK. Several parameter settings are scored
in one pass (the base model is run once), so a grid costs little more than one setting; a
setting with ``max_weight`` 0 is the base alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from fedkey.common.text import is_word
from fedkey.models.bar import savings_scores, word_lengths
from fedkey.models.personal import (
    DEFAULTS,
    MAX_WORDS,
    PersonalCache,
    bigram_row,
    cache_formula,
    previous_tokens,
)
from fedkey.models.tokenizers import WordTokenizer

__all__ = ["PersonalEvaluation", "by_sender", "evaluate_personal"]

#: An encoded message -> its next-token probabilities [len(ids) - 1, vocab].
BaseScorer = Callable[[list[int]], np.ndarray]


class PersonalEvaluation(TypedDict):
    """What :func:`evaluate_personal` reports for one parameter setting."""

    max_weight: float
    ramp: float
    beta: float
    words: int  # real-word targets: every target but </s>
    all_top1: float | None
    all_top3: float | None
    bar_top1: float | None
    bar_top3: float | None
    oov: float | None
    ksr: float | None


def by_sender(items: Sequence[str], owners: Sequence[str]) -> dict[str, list[str]]:
    """{owner: their items, in the order given}. A per-sender corpus (fedkey.corpora.senders)
    interleaves each sender's time-ordered messages round-robin, so ``by_sender(corpus.valid,
    corpus.valid_users)`` gives each sender's validation messages in time order."""
    out: dict[str, list[str]] = {}
    for item, owner in zip(items, owners, strict=True):
        out.setdefault(owner, []).append(item)
    return out


@dataclass(frozen=True)
class _Vocab:
    """The vocabulary as the bar reads it."""

    stoi: Mapping[str, int]
    shown: np.ndarray  # bool [V]: ranked for top-k (every word but the specials)
    suggestible: np.ndarray  # int ids: ranked by the bar while typing (shown, a letter/digit)
    lengths: np.ndarray  # float [V]
    sorted_words: list[str]  # the suggestible words in code-point order
    sorted_ids: np.ndarray

    @classmethod
    def of(cls, tok: WordTokenizer) -> _Vocab:
        shown = np.ones(tok.vocab_size, dtype=bool)
        shown[tok.special_ids] = False
        ids = [i for i, w in enumerate(tok.itos) if shown[i] and is_word(w)]
        ordered = sorted(ids, key=tok.itos.__getitem__)
        return cls(tok.stoi, shown, np.array(ids, dtype=np.int64), word_lengths(tok.itos),
                   [tok.itos[i] for i in ordered], np.array(ordered, dtype=np.int64))  # fmt: skip

    def completions(self, prefix: str) -> np.ndarray:
        """The suggestible ids that start with `prefix` (all of them for "")."""
        if not prefix:
            return self.suggestible
        lo = bisect.bisect_left(self.sorted_words, prefix)
        hi = bisect.bisect_left(self.sorted_words, prefix + "\U0010ffff", lo)
        return self.sorted_ids[lo:hi]


class _Snapshot:
    """The cache as it stands before a message, in arrays, and the settings' weights."""

    def __init__(self, cache: PersonalCache, vocab: _Vocab, settings: np.ndarray):
        size = len(vocab.shown)
        self.cache = cache
        self.words = list(cache.unigrams)
        self.index = {w: j for j, w in enumerate(self.words)}
        self.c1 = np.fromiter(cache.unigrams.values(), dtype=np.float64, count=len(self.words))
        self.ids = np.array([vocab.stoi.get(w, -1) for w in self.words], dtype=np.int64)
        oov = sorted(w for w, i in zip(self.words, self.ids, strict=True) if i < 0)
        rank = {w: size + r for r, w in enumerate(oov)}  # after every vocabulary id
        self.keys = np.array([rank.get(w, i) for w, i in zip(self.words, self.ids, strict=True)],
                             dtype=np.int64)  # fmt: skip
        in_cache = np.zeros(size, dtype=bool)
        in_cache[self.ids[self.ids >= 0]] = True
        self.in_cache = in_cache
        self.free_shown = vocab.shown & ~in_cache  # the vocabulary's shown words not cached
        self.free_suggestible = vocab.suggestible[~in_cache[vocab.suggestible]]
        self.lengths = word_lengths(self.words)
        order = sorted(range(len(self.words)), key=self.words.__getitem__)
        self.sorted_words = [self.words[j] for j in order]
        self.sorted_pos = np.array(order, dtype=np.int64)
        n = cache.total
        max_weight, ramp, self.betas = settings.T
        self.mu = max_weight * n / (n + ramp) if n > 0 else np.zeros(len(settings))
        with np.errstate(divide="ignore"):
            self.log_keep = np.log1p(-self.mu)

    def completions(self, prefix: str) -> np.ndarray:
        """Positions of the cache's words that start with `prefix`."""
        if not prefix:
            return np.arange(len(self.words))
        lo = bisect.bisect_left(self.sorted_words, prefix)
        hi = bisect.bisect_left(self.sorted_words, prefix + "\U0010ffff", lo)
        return self.sorted_pos[lo:hi]

    def mixed(self, base: np.ndarray, prev: str) -> np.ndarray:
        """[settings, cache words]: (1 - mu) * p_base(w) + mu * p_cache(w | prev)."""
        if not self.words:
            return np.zeros((len(self.mu), 0))
        p_cache = cache_formula(self.c1, bigram_row(self.cache, prev, self.index), self.betas)
        b = np.where(self.ids >= 0, base[np.maximum(self.ids, 0)], 0.0)
        mixed: np.ndarray = (1 - self.mu)[:, None] * b + self.mu[:, None] * p_cache
        return mixed


def _best_rows(scores: np.ndarray, keys: np.ndarray, k: int) -> list[np.ndarray]:
    """For each row of `scores` ([rows, n]), the indices of its k best finite scores, best
    first, ties to the lower key."""
    n = scores.shape[1]
    kth = np.partition(scores, n - k, axis=1)[:, n - k] if n > k else np.full(len(scores), -np.inf)
    out = []
    for row, cut in zip(scores, kth, strict=True):
        keep = np.flatnonzero((row >= cut) & (row > -np.inf))
        out.append(keep[np.lexsort((keys[keep], -row[keep]))[:k]])
    return out


def _best(scores: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k best finite `scores`, best first, ties to the lower key."""
    return _best_rows(scores[None, :], keys, k)[0]


def _beats(scores: np.ndarray, keys: np.ndarray, target: np.ndarray, key: int) -> np.ndarray:
    """[settings]: how many of the candidates ([settings, c] `scores`) rank before the target."""
    t = target[:, None]
    before = (scores > t) | ((scores == t) & (keys < key)[None, :])
    counted: np.ndarray = before.sum(axis=1)
    return counted


def _rank(word: str, wid: int | None, base: np.ndarray, mixed: np.ndarray, snap: _Snapshot,
          top: np.ndarray, depth: int) -> np.ndarray:  # fmt: skip
    """[settings]: the target's rank in the bar's ranking by probability (`depth`: a miss);
    `top`: the `depth` likeliest shown vocabulary ids outside the cache, best first."""
    miss = np.full(len(snap.mu), depth)
    keep = 1 - snap.mu
    j = snap.index.get(word)
    if j is not None:
        target, key = mixed[:, j], int(snap.keys[j])
        rank = _beats(keep[:, None] * base[top][None, :], top, target, key)
    elif wid is not None and wid in top:
        target, key = keep * base[wid], wid
        rank = np.full(len(snap.mu), int(np.flatnonzero(top == wid)[0]))
    else:
        return miss
    rank = rank + _beats(mixed, snap.keys, target, key)
    return np.where(target > 0, rank, miss)


def _keystrokes(word: str, wid: int | None, log_base: np.ndarray, log_mixed: np.ndarray,
                vocab: _Vocab, snap: _Snapshot, first: np.ndarray, slots: int) -> np.ndarray:  # fmt: skip
    """[settings]: the keystrokes `word` costs with the bar: len + 1 (its space), or k + 1 when
    the bar offers it after k letters. `first`: the bar's `slots` vocabulary ids outside the
    cache with nothing typed."""
    cost = np.full(len(snap.mu), len(word) + 1)
    j = snap.index.get(word)
    if j is not None:
        logp, key = log_mixed[:, j], int(snap.keys[j])
    elif wid is not None and vocab.shown[wid] and is_word(word):
        logp, key = log_base[wid] + snap.log_keep, wid
    else:
        return cost
    pending = logp > -np.inf
    for k in range(len(word)):
        if not pending.any():
            break
        prefix, target = word[:k], logp + np.log(len(word) - k)
        if k == 0:
            top = first
        else:
            ids = vocab.completions(prefix)
            ids = ids[~snap.in_cache[ids]]
            top = ids[_best(savings_scores(log_base[ids], vocab.lengths[ids], k), ids, slots)]
        if j is None:  # the target is one of these: its rank among them, whatever the setting
            if wid not in top:
                continue
            rank = np.full(len(cost), int(np.flatnonzero(top == wid)[0]))
        else:
            scores = savings_scores(log_base[top], vocab.lengths[top], k)
            rank = _beats(scores[None, :] + snap.log_keep[:, None], top, target, key)
        c = snap.completions(prefix)
        cached = savings_scores(log_mixed[:, c], snap.lengths[c], k)
        rank = rank + _beats(cached, snap.keys[c], target, key)
        hit = pending & (rank < slots)
        cost[hit] = k + 1
        pending &= ~hit
    return cost


class _Tally:
    """The counts behind the fields, one per setting."""

    def __init__(self, settings: int):
        self.hits = {
            f: np.zeros(settings) for f in ("all_top1", "all_top3", "bar_top1", "bar_top3")
        }
        self.keystrokes = np.zeros(settings)
        self.words = self.in_vocab = self.typed = 0

    def message(self, tokens: list[str], probs: np.ndarray, vocab: _Vocab, snap: _Snapshot,
                slots: int) -> None:  # fmt: skip
        """Count one message's words; probs[i] is the base's distribution before tokens[i]."""
        probs = probs[: len(tokens)]
        with np.errstate(divide="ignore"):
            log_probs = np.log(probs)
        # The vocabulary's best outside the cache, for every position at once.
        tops = _best_rows(np.where(snap.free_shown, probs, -np.inf), np.arange(probs.shape[1]), 3)
        free = snap.free_suggestible
        firsts = _best_rows(savings_scores(log_probs[:, free], vocab.lengths[free], 0), free, slots)
        for i, (word, prev) in enumerate(zip(tokens, previous_tokens(tokens), strict=True)):
            row, wid = probs[i], vocab.stoi.get(word)
            mixed = snap.mixed(row, prev)
            rank = _rank(word, wid, row, mixed, snap, tops[i], 3)
            known = wid is not None and bool(vocab.shown[wid])
            for prefix, counted in (("all_", True), ("bar_", known)):
                if counted:
                    self.hits[prefix + "top1"] += rank < 1
                    self.hits[prefix + "top3"] += rank < 3
            self.words += 1
            self.in_vocab += known
            self.typed += len(word) + 1
            with np.errstate(divide="ignore"):
                log_mixed = np.log(mixed)
            self.keystrokes += _keystrokes(
                word, wid, log_probs[i], log_mixed, vocab, snap, free[firsts[i]], slots
            )

    def result(self, j: int, setting: np.ndarray) -> PersonalEvaluation:
        """The fields of setting j (its max_weight, ramp, beta)."""

        def share(count: float, of: int) -> float | None:
            return float(count) / of if of else None

        w, v, h = self.words, self.in_vocab, {k: c[j] for k, c in self.hits.items()}
        ksr = 1.0 - float(self.keystrokes[j]) / self.typed if self.typed else None
        return PersonalEvaluation(
            max_weight=float(setting[0]), ramp=float(setting[1]), beta=float(setting[2]),
            words=w, all_top1=share(h["all_top1"], w), all_top3=share(h["all_top3"], w),
            bar_top1=share(h["bar_top1"], v), bar_top3=share(h["bar_top3"], v),
            oov=share(w - v, w), ksr=ksr,
        )  # fmt: skip


def _settings(settings: Sequence[Mapping[str, float]]) -> np.ndarray:
    """[settings, 3]: max_weight, ramp, beta of each (checked as PersonalCache checks them)."""
    rows = []
    for s in settings:
        PersonalCache(s["max_weight"], s["ramp"], s["beta"])  # raises on a bad setting
        rows.append((float(s["max_weight"]), float(s["ramp"]), float(s["beta"])))
    if not rows:
        raise ValueError("no parameter setting to score")
    return np.array(rows, dtype=np.float64)


def evaluate_personal(
    base: BaseScorer,
    tokenizer: WordTokenizer,
    senders: Mapping[str, Sequence[str]],
    settings: Sequence[Mapping[str, float]] = (DEFAULTS,),
    slots: int = 3,
    max_words: int = MAX_WORDS,
) -> list[PersonalEvaluation]:
    """Score each sender's messages ({sender: messages in time order}, normalized text) with the
    cache of that sender's earlier messages mixed into `base`; one result per setting
    ({"max_weight", "ramp", "beta"}), in order (see the module's docstring for the fields)."""
    vocab = _Vocab.of(tokenizer)
    grid = _settings(settings)
    tally = _Tally(len(grid))
    for messages in senders.values():
        cache = PersonalCache(max_words=max_words)
        for message in messages:
            tokens = message.split()
            probs = np.asarray(base(tokenizer.encode(message)), dtype=np.float64)
            tally.message(tokens, probs, vocab, _Snapshot(cache, vocab, grid), slots)
            cache.learn(tokens)  # after it is scored: never helped by itself or a later one
    return [tally.result(j, setting) for j, setting in enumerate(grid)]
