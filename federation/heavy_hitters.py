"""Federated heavy hitters: the words many phones type that the base vocabulary lacks, found by a
differentially private count.

The mechanism is the thresholded Gaussian histogram of differentially private set union
(Korolova et al. 2009, "Releasing Search Queries and Clicks Privately"; Wilson et al. 2020,
"Differentially Private SQL with Bounded User Contribution"; Gopi et al. 2020, "Differentially
Private Set Union"), in three steps:

1. **The phone** (:func:`phone_vote`): the at most ``k`` distinct words it typed most often that
   are out of the base vocabulary and could be suggested (a letter or a digit). Nothing else
   leaves it: not how often, not where. Its vote is a one-hot vector over words of L2 norm at
   most ``sqrt(k)``, whatever the phone typed (bounded contribution).
2. **The server** (:func:`tally`, :func:`noisy_counts`): the number of phones that voted for each
   word, plus ``N(0, sigma^2)`` on each, drawn from a secret stream of the operating system's
   randomness (fedkey.federation.privacy.secret), never from a published seed.
3. **The release** (:func:`release`): the words whose noisy count passes the threshold ``T``,
   with their noisy counts (the counts themselves are never released).

Privacy, for adding or removing one phone (:func:`plan`): on the words some other phone also
voted for, the release is the Gaussian mechanism of L2 sensitivity ``sqrt(k)``, whose epsilon at
``delta_noise`` is exact (Balle & Wang 2018, "Improving the Gaussian Mechanism for Differential
Privacy: Analytical Calibration and Optimal Denoising", eq. (6) of arXiv:1805.06530, which
dp_accounting's ``get_sigma_gaussian`` and ``get_epsilon_gaussian`` solve). A word only that
phone voted for has count 1 with it and does not exist without it; it is released only when
``1 + N(0, sigma^2) > T``. With at most ``k`` such words, the chance that any is released is
``delta_threshold = 1 - Phi((T - 1) / sigma)^k`` (:func:`threshold_delta`), and ``T`` is chosen
to make it the half of ``delta`` the noise leaves (:func:`threshold_for`): the threshold of Gopi
et al. 2020's Gaussian mechanism, each item weighted 1 instead of ``1 / sqrt(|W_i|)``. The
release is then ``(epsilon, delta_noise + delta_threshold)``-DP; ``delta`` defaults to
``1 / N^1.1`` for N phones (fedkey.federation.privacy.gaussian.population_delta).

Why not TrieHH (Zhu et al. 2020, "Federated Heavy Hitters Discovery with Differential Privacy")?
TrieHH needs no noise (its privacy is sampling and a vote threshold) and grows a trie of
prefixes over many rounds; its guarantee and its recall both need large populations (the paper
runs millions of users), and with the few hundred phones of NUS SMS its threshold leaves next
to nothing. The set-union mechanism spends one round and reaches useful recall at a few hundred
phones. Both trust the server with the phones' votes (central DP: the noise is added by the
server), as fedkey's DP-FedAvg does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import dp_accounting

from fedkey.common.text import is_word
from fedkey.federation.privacy.gaussian import population_delta
from fedkey.federation.privacy.secret import SecretKey

__all__ = [
    "Plan",
    "Release",
    "discover",
    "noisy_counts",
    "phone_vote",
    "plan",
    "release",
    "tally",
    "threshold_delta",
    "threshold_for",
]

_NORMAL = NormalDist()


@dataclass(frozen=True)
class Plan:
    """The mechanism's parameters and its guarantee: `epsilon` at `delta` (their sum,
    `delta_noise` + `delta_threshold`) for adding or removing one of `phones` phones, each
    voting for at most `max_words` words; noise std `sigma` on each count, threshold `threshold`
    (in phones)."""

    epsilon: float
    delta: float
    delta_noise: float
    delta_threshold: float
    phones: int
    max_words: int
    sigma: float
    threshold: float


@dataclass(frozen=True)
class Release:
    """What the server publishes: the released words with their noisy counts, most counted
    first (ties alphabetical), and the plan that guarantees it."""

    words: list[tuple[str, float]]
    plan: Plan

    @property
    def added(self) -> list[str]:
        return [word for word, _ in self.words]


def phone_vote(sentences: Iterable[str], vocabulary: Container[str], max_words: int) -> list[str]:
    """A phone's vote: the at most `max_words` distinct words of its `sentences` (normalized
    text, words separated by spaces) that are not in `vocabulary` and hold a letter or a digit,
    those it typed most often first (ties alphabetical)."""
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    counts = Counter(w for s in sentences for w in s.split() if w not in vocabulary and is_word(w))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    return ranked[:max_words]


def tally(votes: Iterable[Sequence[str]], max_words: int) -> Counter[str]:
    """How many phones voted for each word. A vote with repeated words or more than
    `max_words` of them is refused: the sensitivity the plan assumes would not hold."""
    counts: Counter[str] = Counter()
    for vote in votes:
        if len(set(vote)) != len(vote) or len(vote) > max_words:
            raise ValueError(
                f"a phone's vote holds at most {max_words} distinct words, got {list(vote)}"
            )
        counts.update(vote)
    return counts


def threshold_delta(sigma: float, threshold: float, max_words: int) -> float:
    """The chance that at least one of a phone's `max_words` words that no other phone voted
    for (count 1) is released: ``1 - Phi((threshold - 1) / sigma)^max_words``."""
    tail = 0.5 * math.erfc((threshold - 1) / (sigma * math.sqrt(2)))  # 1 - Phi, without rounding
    return -math.expm1(max_words * math.log1p(-tail))


def threshold_for(sigma: float, delta_threshold: float, max_words: int) -> float:
    """The threshold ``T`` whose :func:`threshold_delta` is `delta_threshold`:
    ``T = 1 + sigma * Phi^-1((1 - delta_threshold)^(1 / max_words))``."""
    tail = -math.expm1(math.log1p(-delta_threshold) / max_words)  # 1 - (1 - d)^(1/k)
    return 1.0 - sigma * _NORMAL.inv_cdf(tail)


def plan(epsilon: float, phones: int, max_words: int, delta: float | None = None) -> Plan:
    """The noise and the threshold that make the release ``(epsilon, delta)``-DP for `phones`
    phones voting for at most `max_words` words each: half of `delta` (default
    ``1 / phones^1.1``) for the Gaussian noise, half for the threshold."""
    if not epsilon > 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon must be a positive number, got {epsilon}")
    if phones < 1 or max_words < 1:
        raise ValueError(f"need at least one phone and one word a phone ({phones}, {max_words})")
    total = population_delta(phones) if delta is None else float(delta)
    if not 0 < total < 1:
        raise ValueError(f"delta must be in (0, 1), got {total}")
    delta_noise = delta_threshold = total / 2
    # The Gaussian mechanism of sensitivity 1 scaled by the vote's L2 sensitivity sqrt(k).
    sigma = math.sqrt(max_words) * float(dp_accounting.get_sigma_gaussian(epsilon, delta_noise))
    spent = float(dp_accounting.get_epsilon_gaussian(sigma / math.sqrt(max_words), delta_noise))
    threshold = threshold_for(sigma, delta_threshold, max_words)
    return Plan(
        epsilon=spent,
        delta=delta_noise + threshold_delta(sigma, threshold, max_words),
        delta_noise=delta_noise,
        delta_threshold=threshold_delta(sigma, threshold, max_words),
        phones=phones,
        max_words=max_words,
        sigma=sigma,
        threshold=threshold,
    )


def noisy_counts(counts: Mapping[str, int], sigma: float, secret: SecretKey) -> dict[str, float]:
    """Each count plus ``N(0, sigma^2)`` from the secret's stream, the words in sorted order
    (so the draw depends on the key and the words, not on the order they came in)."""
    words = sorted(counts)
    noise = secret.normals(len(words), "heavy-hitters").tolist() if words else []
    return {w: counts[w] + sigma * z for w, z in zip(words, noise, strict=True)}


def release(noisy: Mapping[str, float], threshold: float) -> list[tuple[str, float]]:
    """The words whose noisy count is above `threshold`, with it; most counted first."""
    kept = [(w, c) for w, c in noisy.items() if c > threshold]
    return sorted(kept, key=lambda item: (-item[1], item[0]))


def discover(
    votes: Sequence[Sequence[str]],
    epsilon: float,
    max_words: int,
    delta: float | None = None,
    secret: SecretKey | None = None,
) -> Release:
    """The whole mechanism on the phones' `votes` (:func:`phone_vote`): the plan for
    ``len(votes)`` phones, the tally, the noise (a fresh secret of the operating system's
    unless `secret` names one: a test's), the release."""
    the_plan = plan(epsilon, len(votes), max_words, delta)
    key = secret if secret is not None else SecretKey.fresh()
    noisy = noisy_counts(tally(votes, max_words), the_plan.sigma, key)
    return Release(release(noisy, the_plan.threshold), the_plan)
