"""Federated heavy hitters (fedkey.federation.heavy_hitters): a phone's vote is bounded, the
release's epsilon is dp_accounting's for the Gaussian mechanism of sensitivity sqrt(k), its
threshold keeps a word few phones hold out with the promised probability, and the noise comes
from a secret."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from fedkey.federation.heavy_hitters import (
    discover,
    noisy_counts,
    phone_vote,
    plan,
    release,
    tally,
    threshold_delta,
    threshold_for,
)
from fedkey.federation.privacy.secret import SecretKey, passphrase_key

VOCAB = {"i", "am", "at", "home", "see", "you"}


def secret(name: str = "test") -> SecretKey:
    return SecretKey(passphrase_key(name), reproducible=True)


def test_a_phone_votes_for_its_most_typed_out_of_vocabulary_words_and_no_more():
    texts = ["i am at home lor", "see you tmr lor", "tmr lor !", "ok lah , 5pm"]
    assert phone_vote(texts, VOCAB, 2) == ["lor", "tmr"]  # 3 and 2 times; then ties alphabetical
    assert phone_vote(texts, VOCAB, 10) == [
        "lor",
        "tmr",
        "5pm",
        "lah",
        "ok",
    ]  # "!" "," are no words
    assert phone_vote(["i am at home"], VOCAB, 3) == []


def test_the_server_counts_phones_and_refuses_a_vote_past_the_bound():
    assert tally([["lor", "tmr"], ["lor"], []], 2) == {"lor": 2, "tmr": 1}
    with pytest.raises(ValueError, match="at most 2 distinct"):
        tally([["lor", "tmr", "lah"]], 2)
    with pytest.raises(ValueError, match="distinct"):
        tally([["lor", "lor"]], 2)


@pytest.mark.parametrize(("epsilon", "k"), [(1.0, 1), (4.0, 10), (8.0, 3)])
def test_epsilon_is_the_gaussian_mechanisms_of_sensitivity_sqrt_k(epsilon, k):
    p = plan(epsilon, 309, k)
    assert p.delta == pytest.approx(309**-1.1) and p.delta_noise == pytest.approx(p.delta / 2)
    assert p.epsilon == pytest.approx(epsilon, rel=1e-6)
    # Balle & Wang's exact condition, by hand: delta(eps) of N(0, sigma^2), sensitivity sqrt(k).
    s, d = p.sigma, math.sqrt(k)
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    exact = phi(d / (2 * s) - epsilon * s / d) - math.exp(epsilon) * phi(
        -d / (2 * s) - epsilon * s / d
    )
    assert exact == pytest.approx(p.delta_noise, rel=1e-4)


def test_dp_accountings_pld_accountant_agrees():
    p = plan(2.0, 309, 10)  # the same mechanism: noise multiplier sigma / sqrt(k)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(dp_accounting.GaussianDpEvent(p.sigma / math.sqrt(10)))
    assert pld.get_epsilon(p.delta_noise) == pytest.approx(2.0, rel=0.02)


def test_a_word_one_phone_holds_passes_the_threshold_with_the_promised_probability():
    p = plan(2.0, 500, 5)
    assert threshold_delta(p.sigma, p.threshold, 5) == pytest.approx(p.delta_threshold, rel=1e-9)
    assert threshold_for(p.sigma, p.delta_threshold, 5) == pytest.approx(p.threshold)
    # By simulation: a phone's 5 words, each held by it alone (count 1), 200,000 times.
    z = np.random.default_rng(0).standard_normal((200_000, 5))
    leaked = ((1 + p.sigma * z) > p.threshold).any(axis=1).mean()
    assert leaked <= 2 * p.delta_threshold  # rare: the mean of Bernoulli(d) over 200k draws
    # Loosen the threshold by one noise std and many would leak.
    assert threshold_delta(p.sigma, p.threshold - p.sigma, 5) > 10 * p.delta_threshold


def test_words_many_phones_type_are_released_and_a_word_of_one_phone_is_not():
    votes = [["lor", "tmr"]] * 200 + [["lah"]] * 150 + [["mysecretname"]] + [[]] * 149
    result = discover(votes, epsilon=2.0, max_words=2, secret=secret())
    assert set(result.added) == {"lor", "tmr", "lah"}
    assert "mysecretname" not in result.added
    counts = dict(result.words)
    assert abs(counts["lor"] - 200) < 6 * result.plan.sigma and counts["lor"] != 200
    assert [c for _, c in result.words] == sorted(counts.values(), reverse=True)
    assert result.plan.phones == 500


def test_the_noise_is_the_secrets_and_a_fresh_secret_draws_anew():
    counts = {"lor": 20, "tmr": 15, "lah": 3}
    same = (
        noisy_counts(counts, 2.0, secret("a")),
        noisy_counts(dict(reversed(counts.items())), 2.0, secret("a")),
    )
    assert same[0] == same[1]  # the key and the words decide the draw, not their order
    assert noisy_counts(counts, 2.0, secret("b")) != same[0]
    fresh = [noisy_counts(counts, 2.0, SecretKey.fresh()) for _ in range(2)]
    assert fresh[0] != fresh[1]
    assert release({"a": 3.0, "b": 9.5, "c": 9.5, "d": 10.0}, 9.0) == [
        ("d", 10.0),
        ("b", 9.5),
        ("c", 9.5),
    ]


@pytest.mark.parametrize(
    ("epsilon", "delta"), [(0.0, None), (-1.0, None), (math.inf, None), (1.0, 1.0)]
)
def test_a_budget_that_is_no_budget_is_refused(epsilon, delta):
    with pytest.raises(ValueError):
        plan(epsilon, 100, 5, delta)
