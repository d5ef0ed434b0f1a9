"""The personal cache: the user's own words, learned on the device and mixed into the bar.

A cache language model (Kuhn & De Mori 1990, "A cache-based natural language model for speech
recognition"), as the web keyboard keeps it (keyboard_web/static/personal.js, its port):

- counts: ``c1[w]`` of the words the user sent, ``c2[prev][w]`` of each word after the previous
  token of its sentence (``<s>`` at a sentence start, and again after a ". ! ?" token),
  ``n = sum of c1``. Tokens are normalize_text's (fedkey.common.text); only suggestible words (a
  letter or a digit) are counted as w, in the vocabulary or not: that is how the keyboard learns
  a user's own names and slang.
- ``p_cache(w | prev) = (c2[prev][w] + beta * c1[w] / n) / (sum_w c2[prev][w] + beta)``;
- its weight ``mu = max_weight * n / (n + ramp)``: nothing while the cache is empty, growing
  with what the user has typed;
- ``p(w) = (1 - mu) * p_base(w) + mu * p_cache(w | prev)`` over the vocabulary and the cache's
  words (a cache word outside the vocabulary has ``p_base = 0``).
- bounded: at most :data:`MAX_WORDS` distinct words; past them the least counted are dropped
  first (among equal counts the one used longest ago), with their bigrams.

numpy and the standard library only: the keyboard imports this module and never imports torch.
:func:`fedkey.models.personal_eval.evaluate_personal` measures it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from fedkey.common.text import is_terminator, is_word

__all__ = [
    "BOS",
    "DEFAULTS",
    "MAX_WORDS",
    "PersonalCache",
    "bigram_row",
    "cache_formula",
    "cache_probabilities",
    "previous_tokens",
]

#: max_weight, ramp, beta of the formula above: the best of max_weight 0.1/0.2/0.3/0.5 x ramp
#: 10/50/200 x beta 0.5/2/8 by all_top1, then keystroke savings (fedkey.models.personal_eval), on
#: the validation split of NUS SMS (195 senders' validation messages, 41,026 words, each sender's
#: in time order; the test split and the held-out senders never looked at), the base a
#: Kneser-Ney 3-gram of the public Chit-Chat text and its 10k words: all_top1 0.0853 -> 0.0948,
#: ksr 0.273 -> 0.309 (0.3/50/2: 0.0929, 0.309). The best max_weight is the grid's largest, with
#: a base out of the SMS domain; no in-domain base was measured.
DEFAULTS: dict[str, float] = {"max_weight": 0.5, "ramp": 50.0, "beta": 2.0}

#: Distinct words the cache keeps at most (the browser's bound too).
MAX_WORDS = 5000

BOS = "<s>"


def previous_tokens(tokens: Sequence[str]) -> list[str]:
    """The cache's bigram context of each token: the token before it in its sentence, ``<s>`` at
    the start and after a terminator ("hi . you" -> ``<s>``, ``hi``, ``<s>``)."""
    out, prev = [], BOS
    for tok in tokens:
        out.append(prev)
        prev = BOS if is_terminator(tok) else tok
    return out


def cache_formula(c1: np.ndarray, c2: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """p_cache = (c2[prev][w] + beta * c1[w] / n) / (sum_w c2[prev][w] + beta) for each beta:
    [len(betas), words] from the counts c1 and c2[prev] of the same words (n = sum of c1 > 0)."""
    b = np.asarray(betas, dtype=np.float64)[:, None]
    p: np.ndarray = (c2 + b * c1 / c1.sum()) / (c2.sum() + b)
    return p


def cache_probabilities(
    cache: PersonalCache, prev: str, betas: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """The cache's words (least recently used first) and p_cache(w | prev) for each beta:
    [len(betas), words], each row summing to 1 (no words when the cache is empty)."""
    words = list(cache.unigrams)
    if not words:
        return words, np.zeros((len(betas), 0))
    c1 = np.fromiter(cache.unigrams.values(), dtype=np.float64, count=len(words))
    return words, cache_formula(
        c1, bigram_row(cache, prev, {w: j for j, w in enumerate(words)}), betas
    )


def bigram_row(cache: PersonalCache, prev: str, index: Mapping[str, int]) -> np.ndarray:
    """c2[prev][w] of the cache's words, at their position in `index` (word -> position)."""
    c2 = np.zeros(len(index))
    row = cache.bigrams.get(prev)
    if row:
        c2[[index[w] for w in row]] = list(row.values())
    return c2


class PersonalCache:
    """The counts of the words a user sent, and the mixture they give (module docstring)."""

    def __init__(
        self,
        max_weight: float = DEFAULTS["max_weight"],
        ramp: float = DEFAULTS["ramp"],
        beta: float = DEFAULTS["beta"],
        max_words: int = MAX_WORDS,
    ):
        if not 0 <= max_weight < 1 or ramp <= 0 or beta <= 0 or max_words < 1:
            raise ValueError(
                "need 0 <= max_weight < 1, ramp > 0, beta > 0, max_words >= 1; got "
                f"{max_weight}, {ramp}, {beta}, {max_words}"
            )
        self.max_weight, self.ramp, self.beta = float(max_weight), float(ramp), float(beta)
        self.max_words = max_words
        self.unigrams: dict[str, int] = {}  # c1, least recently used first
        self.bigrams: dict[str, dict[str, int]] = {}  # c2[prev][w]
        self.total = 0  # n = sum of c1

    def __len__(self) -> int:
        return len(self.unigrams)

    def __contains__(self, word: object) -> bool:
        return word in self.unigrams

    def __iter__(self) -> Iterator[str]:
        return iter(self.unigrams)

    def learn(self, tokens: Sequence[str]) -> None:
        """Count a sent message (normalize_text's tokens), then drop past `max_words`."""
        for prev, tok in zip(previous_tokens(tokens), tokens, strict=True):
            if not is_word(tok):
                continue
            self.unigrams[tok] = self.unigrams.pop(tok, 0) + 1  # to the end: used last
            row = self.bigrams.setdefault(prev, {})
            row[tok] = row.pop(tok, 0) + 1
            self.total += 1
        self._prune()

    def _prune(self) -> None:
        """The least counted words go first (ties: used longest ago), with their bigrams."""
        over = len(self.unigrams) - self.max_words
        if over <= 0:
            return
        by_count = sorted(self.unigrams.items(), key=lambda item: item[1])  # stable: LRU ties
        dropped = {w for w, _ in by_count[:over]}
        for w in dropped:
            self.total -= self.unigrams.pop(w)
            self.bigrams.pop(w, None)
        for prev in list(self.bigrams):
            row = self.bigrams[prev]
            for w in dropped & row.keys():
                del row[w]
            if not row:
                del self.bigrams[prev]

    def weight(self) -> float:
        """mu = max_weight * n / (n + ramp): 0 while nothing is learned."""
        n = self.total
        return self.max_weight * n / (n + self.ramp) if n > 0 else 0.0

    def probabilities(self, prev: str) -> dict[str, float]:
        """p_cache(w | prev) for every word of the cache (empty while nothing is learned)."""
        words, p = cache_probabilities(self, prev, np.array([self.beta]))
        return dict(zip(words, p[0].tolist(), strict=True))

    def mix(
        self, base: np.ndarray, stoi: Mapping[str, int], prev: str
    ) -> tuple[np.ndarray, list[str], np.ndarray]:
        """The mixture after `prev` of `base`, a next-word distribution over the vocabulary
        (`stoi`: word -> id): (its probabilities over the vocabulary, the cache's words outside
        the vocabulary, their probabilities). Together they sum to what `base` sums to."""
        mu = self.weight()
        p = (1.0 - mu) * np.asarray(base, dtype=np.float64)
        extra_words, extra_p = [], []
        if mu > 0:
            for w, q in self.probabilities(prev).items():
                wid = stoi.get(w)
                if wid is None:
                    extra_words.append(w)
                    extra_p.append(mu * q)
                else:
                    p[wid] += mu * q
        return p, extra_words, np.asarray(extra_p, dtype=np.float64)
