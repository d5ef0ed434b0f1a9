"""Seeded partitions of a corpus's training items into private client shards.

A partition is a ``list[list[int]]``: shard k holds the indices (into ``corpus.train``) of the
items client k owns. Shards are disjoint, sorted, non-empty, and depend only on the inputs and
the seed (numpy ``default_rng(seed)``), so every run and every process rebuilds the same shards.

Schemes:

* ``iid``: the seed papers' protocol (shuffle, cut into equal shards without replacement).
* ``user``: one shard per natural owner (demo corpus, jsonl, user directories, Stack Exchange).
* ``dirichlet``: label-skewed non-IID shards, Dir(alpha) proportions per label (Hsu et al. 2019);
  labels are the owners when the corpus has them, else consecutive-block "topic proxies".
* ``articles``: each phone holds whole articles (WikiText-2's, ``Corpus.train_articles``): natural
  topics and unequal sizes, every article on exactly one phone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from fedkey.common.config import Scheme
from fedkey.corpora.loaders import Corpus

__all__ = [
    "SCHEMES",
    "Scheme",
    "block_labels",
    "by_article",
    "by_user",
    "dirichlet",
    "iid_shards",
    "partition",
    "shard_sizes",
]

SCHEMES: tuple[Scheme, ...] = get_args(Scheme)


def _check_clients(num_clients: int, n_items: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > n_items:
        raise ValueError(
            f"num_clients={num_clients} exceeds the {n_items} training items: "
            "every client needs at least one item"
        )


def iid_shards(
    n_items: int, num_clients: int, seed: int, *, drop_remainder: bool = True
) -> list[list[int]]:
    """Shuffle ``range(n_items)`` and cut it into ``num_clients`` equal shards.

    As in the seed papers' code, each shard holds ``n_items // num_clients`` items and the
    ``n_items % num_clients`` items left over are not given to anyone (``drop_remainder=True``;
    e.g. PTB's 42,068 lines over 100 clients leave 68 lines out). With ``drop_remainder=False``
    the leftovers go one each to the first shards, so sizes differ by at most one.
    """
    _check_clients(num_clients, n_items)
    perm = np.random.default_rng(seed).permutation(n_items)
    size, rest = divmod(n_items, num_clients)
    shards: list[list[int]] = []
    start = 0
    for k in range(num_clients):
        stop = start + size + (1 if (not drop_remainder and k < rest) else 0)
        shards.append(sorted(int(i) for i in perm[start:stop]))
        start = stop
    return shards


def by_user(users: Sequence[str], num_clients: int | None = None, seed: int = 0) -> list[list[int]]:
    """Natural shards: client k holds all items of one owner.

    Clients are ordered by item count, largest first. With ``num_clients`` below the number of
    owners only the ``num_clients`` largest owners become clients (their items only; the other
    owners' items are unused). Owners with equal counts are ordered by a shuffle seeded with
    ``seed``, so ties are broken deterministically. The owner of shard k is
    ``users[shards[k][0]]``.
    """
    groups: dict[str, list[int]] = {}
    for i, u in enumerate(users):
        groups.setdefault(u, []).append(i)
    if not groups:
        raise ValueError("by_user needs at least one item with an owner")
    names = list(groups)
    tie = np.random.default_rng(seed).permutation(len(names))
    order = sorted(range(len(names)), key=lambda j: (-len(groups[names[j]]), int(tie[j])))
    if num_clients is None:
        num_clients = len(names)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1 or None, got {num_clients}")
    if num_clients > len(names):
        raise ValueError(
            f"num_clients={num_clients} but the corpus has only {len(names)} users; "
            f"use num_clients <= {len(names)} (or None for one client per user), "
            "or the 'iid' or 'dirichlet' scheme for more clients"
        )
    return [groups[names[j]] for j in order[:num_clients]]


def by_article(articles: Sequence[str], num_clients: int, seed: int) -> list[list[int]]:
    """Whole-article shards: the articles, shuffled with ``seed``, are dealt to the clients in
    turn (article j of the shuffle to client ``j mod num_clients``), each with all its items.

    Every article lands on exactly one client and every client gets at least one (needs at least
    ``num_clients`` articles); a client's size is the sum of its articles' sizes, so sizes
    differ as articles do (WikiText-2 over 100 phones: 6 articles each, of unequal length). The
    text of one phone is a few topics, and phones differ in topic and size: the non-IID users
    a realistic federation wants, with no synthetic skew parameter.
    """
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(articles):
        groups.setdefault(a, []).append(i)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(groups):
        raise ValueError(
            f"num_clients={num_clients} but the training text has only {len(groups)} articles; "
            f"use --clients <= {len(groups)} so every phone holds at least one whole article"
        )
    names = list(groups)
    order = np.random.default_rng(seed).permutation(len(names))
    shards: list[list[int]] = [[] for _ in range(num_clients)]
    for j, k in enumerate(order):
        shards[j % num_clients].extend(groups[names[int(k)]])
    return [sorted(s) for s in shards]


def block_labels(n_items: int, block_size: int = 100) -> list[str]:
    """Topic proxies for corpora without owners: item i gets label ``str(i // block_size)``.

    PTB and WikiText-2 lines are in article order, so a block of consecutive lines mostly comes
    from one article or a few neighbouring ones and stands in for a topic.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return [str(i // block_size) for i in range(n_items)]


def dirichlet(labels: Sequence[str], num_clients: int, alpha: float, seed: int) -> list[list[int]]:
    """Label-skewed non-IID shards with Dirichlet(alpha) proportions.

    For each label (in first-appearance order) draw ``p ~ Dir(alpha * 1_K)`` over the K clients,
    shuffle that label's items and cut them at the cumulative proportions. Small alpha gives
    each label to few clients (strong skew); large alpha approaches IID. Every item is assigned.
    Empty clients are then filled one at a time by moving one random item from the currently
    largest shard, so every client holds at least one item while the skew barely changes
    (needs ``len(labels) >= num_clients``).
    """
    n = len(labels)
    _check_clients(num_clients, n)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    by_label: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        by_label.setdefault(lab, []).append(i)
    shards: list[list[int]] = [[] for _ in range(num_clients)]
    for items in by_label.values():
        idx = rng.permutation(np.asarray(items))
        p = rng.dirichlet(np.full(num_clients, float(alpha)))
        cuts = np.floor(np.cumsum(p)[:-1] * len(idx) + 0.5).astype(int)
        for k, part in enumerate(np.split(idx, cuts)):
            shards[k].extend(int(i) for i in part)
    for k in range(num_clients):
        if not shards[k]:
            donor = max(range(num_clients), key=lambda j: (len(shards[j]), -j))
            j = int(rng.integers(len(shards[donor])))
            shards[k].append(shards[donor].pop(j))
    return [sorted(s) for s in shards]


def partition(
    corpus: Corpus,
    scheme: str,
    num_clients: int | None,
    seed: int,
    alpha: float = 0.5,
    *,
    block_size: int = 100,
) -> list[list[int]]:
    """Partition ``corpus.train`` into client shards with one of ``SCHEMES``.

    ``"iid"``: :func:`iid_shards`. ``"user"``: :func:`by_user` over ``corpus.train_users``
    (``num_clients=None`` means one client per user). ``"articles"``: :func:`by_article` over
    ``corpus.train_articles``. ``"dirichlet"``: :func:`dirichlet` with the
    owners as labels when the corpus has them, else :func:`block_labels` with ``block_size``.
    """
    n = len(corpus.train)
    if scheme == "iid":
        return iid_shards(n, _required(num_clients, scheme), seed)
    if scheme == "user":
        if corpus.train_users is None:
            raise ValueError(
                f"scheme 'user' needs a corpus with users, and {corpus.name!r} has none "
                "(PTB/WikiText-2 are plain text); use 'iid' or 'dirichlet' instead"
            )
        return by_user(corpus.train_users, num_clients, seed)
    if scheme == "articles":
        if corpus.train_articles is None:
            raise ValueError(
                f"scheme 'articles' needs a corpus whose training text has article titles "
                f"(WikiText-2's ' = Title = ' lines), and {corpus.name!r} has none; use 'iid', "
                "'dirichlet', or 'user' for a corpus with owners"
            )
        return by_article(corpus.train_articles, _required(num_clients, scheme), seed)
    if scheme == "dirichlet":
        labels = corpus.train_users or block_labels(n, block_size)
        return dirichlet(labels, _required(num_clients, scheme), alpha, seed)
    raise ValueError(f"unknown partition scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def _required(num_clients: int | None, scheme: str) -> int:
    if num_clients is None:
        raise ValueError(f"scheme {scheme!r} needs num_clients")
    return num_clients


def shard_sizes(shards: Sequence[Sequence[int]]) -> list[int]:
    """Number of items per shard (handy for FedAvg weights n_k and for logging)."""
    return [len(s) for s in shards]
