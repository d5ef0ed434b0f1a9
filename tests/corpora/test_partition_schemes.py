"""Client partitions: disjoint, deterministic, the right coverage and the right skew."""

import math
from collections import Counter

import pytest

from fedkey.corpora.loaders import Corpus, split_user_messages
from fedkey.corpora.partition import (
    block_labels,
    by_user,
    dirichlet,
    iid_shards,
    partition,
    shard_sizes,
)


def _flat(shards):
    return [i for s in shards for i in s]


def _assert_disjoint_nonempty(shards):
    flat = _flat(shards)
    assert len(flat) == len(set(flat))
    assert all(len(s) > 0 for s in shards)
    assert all(s == sorted(s) for s in shards)
    assert all(type(i) is int for i in flat)


def test_iid_equal_shards_drop_remainder():
    shards = iid_shards(1003, 10, seed=0)
    _assert_disjoint_nonempty(shards)
    assert shard_sizes(shards) == [100] * 10
    assert len(_flat(shards)) == 1000
    assert iid_shards(1003, 10, seed=0) == shards
    assert iid_shards(1003, 10, seed=1) != shards


def test_iid_keep_remainder():
    shards = iid_shards(1003, 10, seed=0, drop_remainder=False)
    assert sorted(_flat(shards)) == list(range(1003))
    assert shard_sizes(shards) == [101, 101, 101] + [100] * 7


def test_iid_too_many_clients():
    with pytest.raises(ValueError, match="at least one item"):
        iid_shards(5, 6, seed=0)


def test_by_user_all_and_largest():
    users = ["a"] * 5 + ["b"] * 9 + ["c"] * 2 + ["d"] * 9 + ["e"]
    users = [users[i] for i in (list(range(0, 26, 2)) + list(range(1, 26, 2)))]  # mix order
    shards = by_user(users)
    _assert_disjoint_nonempty(shards)
    assert sorted(_flat(shards)) == list(range(len(users)))
    assert shard_sizes(shards) == [9, 9, 5, 2, 1]
    assert all(len({users[i] for i in s}) == 1 for s in shards)
    top3 = by_user(users, num_clients=3, seed=0)
    assert {users[s[0]] for s in top3} == {"b", "d", "a"}
    assert by_user(users, num_clients=3, seed=0) == top3


def test_by_user_ties_depend_on_seed_only():
    users = [u for u in "abcdef" for _ in range(3)]
    picks = {tuple(users[s[0]] for s in by_user(users, 2, seed=s)) for s in range(20)}
    assert len(picks) > 1  # the seed breaks ties
    assert by_user(users, 2, seed=7) == by_user(users, 2, seed=7)


def test_by_user_too_many_clients():
    with pytest.raises(ValueError, match="only 2 users"):
        by_user(["a", "b", "a"], num_clients=3)


def _entropy(labels, shard):
    counts = Counter(labels[i] for i in shard)
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_dirichlet_skew_and_coverage():
    labels = block_labels(4000, block_size=100)  # 40 labels
    assert labels[99] == "0" and labels[100] == "1"
    skewed = dirichlet(labels, num_clients=20, alpha=0.1, seed=0)
    _assert_disjoint_nonempty(skewed)
    assert sorted(_flat(skewed)) == list(range(4000))
    assert dirichlet(labels, 20, 0.1, seed=0) == skewed
    assert dirichlet(labels, 20, 0.1, seed=1) != skewed
    iid = iid_shards(4000, 20, seed=0)
    mean_h = lambda shards: sum(_entropy(labels, s) for s in shards) / len(shards)  # noqa: E731
    assert mean_h(skewed) < 0.6 * mean_h(iid)
    assert mean_h(dirichlet(labels, 20, alpha=100.0, seed=0)) > 0.9 * mean_h(iid)


def test_dirichlet_every_client_nonempty_even_when_extreme():
    labels = ["x"] * 30 + ["y"] * 30
    shards = dirichlet(labels, num_clients=25, alpha=0.01, seed=3)
    _assert_disjoint_nonempty(shards)
    assert len(shards) == 25 and sorted(_flat(shards)) == list(range(60))


def test_partition_dispatch():
    users_corpus = split_user_messages({u: [f"{u} {i}" for i in range(20)] for u in "abcde"}, 0)
    plain = Corpus("plain", [f"line {i}" for i in range(500)], [], [])
    assert partition(plain, "iid", 10, seed=0) == iid_shards(500, 10, seed=0)
    assert len(partition(users_corpus, "user", None, seed=0)) == 5
    assert partition(users_corpus, "user", 3, seed=0) == by_user(users_corpus.train_users, 3, 0)
    assert partition(users_corpus, "dirichlet", 4, seed=0, alpha=0.3) == dirichlet(
        users_corpus.train_users, 4, 0.3, 0
    )
    assert partition(plain, "dirichlet", 4, seed=0) == dirichlet(block_labels(500), 4, 0.5, 0)
    with pytest.raises(ValueError, match="needs a corpus with users"):
        partition(plain, "user", 3, seed=0)
    with pytest.raises(ValueError, match="choose one of iid, user, dirichlet"):
        partition(plain, "random", 3, seed=0)
    with pytest.raises(ValueError, match="needs num_clients"):
        partition(plain, "iid", None, seed=0)
