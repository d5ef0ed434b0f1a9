"""The rules every real per-sender corpus shares (NUS SMS, Ubuntu IRC): one phone per sender.

A loader (:mod:`fedkey.corpora.nus_sms`, :mod:`fedkey.corpora.ubuntu_irc`) reads its upstream files into
:class:`Message` s (sender, a time to order them by, normalized text) and hands them to
:func:`sender_corpus`, which applies, in this order:

1. **Time order**: each sender's messages sorted by their time (ties and messages without a time
   keep the order of the files).
2. **Exact repeats dropped**: a sender's message whose text that sender already sent.
3. **Cap**: a sender keeps at most ``cap`` messages, their most recent (a keyboard's on-phone
   history); in both corpora a few senders hold a large share of the text.
4. **Held-out senders**: ``held_out`` of the senders (a seeded draw) never train; all their
   messages go to ``Corpus.unseen_test`` (owners in ``Corpus.unseen_users``): how the model does
   for people who were never in the federation.
5. **Time split**: every other sender's first messages train, the next ``valid_frac`` of them
   validate and the last ``test_frac`` test (at least one message always trains), so the model is
   scored on what its phones typed later.

The splits interleave the senders round-robin, as :func:`fedkey.corpora.loaders.split_user_messages`
does, so a prefix of the training split still holds every sender. With ``--partition user``,
``--clients K`` keeps the K senders with the most training messages
(:func:`fedkey.corpora.partition.by_user`), and the validation and test sets then hold only those K
senders' later messages (:func:`fedkey.corpora.dataset.load_cut`): the phones' own held-out text. The
other senders' messages are unused; the held-out senders stay the same whatever K is, so
``unseen_test`` compares across K.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from fedkey.corpora.loaders import Corpus

__all__ = ["Message", "SenderRules", "sender_corpus"]


@dataclass(frozen=True)
class Message:
    """One message: its sender, a sort key giving its time (any tuple, compared per sender;
    ``()`` when unknown) and its normalized text."""

    sender: str
    time: tuple
    text: str


@dataclass(frozen=True)
class SenderRules:
    """How a per-sender corpus is cut (see the module's docstring)."""

    cap: int | None = 1000  # messages per sender at most (None: no cap)
    held_out: float = 0.1  # share of the senders who never train
    valid_frac: float = 0.1
    test_frac: float = 0.1

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"cap must be >= 1 or None, got {self.cap}")
        if not 0 <= self.held_out < 1:
            raise ValueError(f"held_out must be in [0, 1), got {self.held_out}")
        fracs = (self.valid_frac, self.test_frac)
        if not (all(0 <= f < 1 for f in fracs) and sum(fracs) < 1):
            raise ValueError(
                f"valid_frac={self.valid_frac} and test_frac={self.test_frac} must be in [0, 1) "
                "with a sum below 1"
            )


def _by_sender(messages: Iterable[Message], cap: int | None) -> dict[str, list[str]]:
    """Rules 1-3: each sender's texts in time order, without repeats, the last ``cap``."""
    timed: dict[str, list[tuple[tuple, int, str]]] = {}
    for i, m in enumerate(messages):
        if m.text:
            timed.setdefault(m.sender, []).append((m.time, i, m.text))
    out: dict[str, list[str]] = {}
    for sender, items in timed.items():
        items.sort(key=lambda t: (t[0], t[1]))
        seen: set[str] = set()
        texts = []
        for _, _, text in items:
            if text not in seen:
                seen.add(text)
                texts.append(text)
        out[sender] = texts[-cap:] if cap is not None else texts
    return out


def _held_out(senders: list[str], share: float, seed: int) -> set[str]:
    """Rule 4: round(share * senders) senders, drawn by a shuffle seeded with ``seed``."""
    order = sorted(senders)
    random.Random(f"fedkey-held-out-{seed}").shuffle(order)
    return set(order[: round(share * len(order))])


def _time_split(texts: list[str], valid_frac: float, test_frac: float) -> dict[str, list[str]]:
    """Rule 5: the first messages train, then valid, then test; one message always trains."""
    n = len(texts)
    n_valid, n_test = int(n * valid_frac + 1e-9), int(n * test_frac + 1e-9)
    while n_valid + n_test > n - 1:
        if n_test >= n_valid:
            n_test -= 1
        else:
            n_valid -= 1
    n_train = n - n_valid - n_test
    return {
        "train": texts[:n_train],
        "valid": texts[n_train : n_train + n_valid],
        "test": texts[n_train + n_valid :],
    }


def _interleave(groups: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """Round-robin over the senders: message 0 of every sender, then message 1, ..."""
    items: list[str] = []
    owners: list[str] = []
    longest = max((len(g) for g in groups.values()), default=0)
    for i in range(longest):
        for sender, group in groups.items():
            if i < len(group):
                items.append(group[i])
                owners.append(sender)
    return items, owners


def sender_corpus(
    name: str, messages: Iterable[Message], rules: SenderRules = SenderRules(), seed: int = 0
) -> Corpus:
    """A :class:`Corpus` of ``messages`` cut by ``rules`` (see the module's docstring);
    ``seed`` draws the held-out senders."""
    by_sender = _by_sender(messages, rules.cap)
    if not by_sender:
        raise ValueError(f"corpus {name!r} holds no messages")
    unseen = _held_out(list(by_sender), rules.held_out, seed)
    parts: dict[str, dict[str, list[str]]] = {"train": {}, "valid": {}, "test": {}}
    for sender, texts in by_sender.items():
        if sender in unseen:
            continue
        for split, chosen in _time_split(texts, rules.valid_frac, rules.test_frac).items():
            parts[split][sender] = chosen
    train, train_users = _interleave(parts["train"])
    valid, valid_users = _interleave(parts["valid"])
    test, test_users = _interleave(parts["test"])
    unseen_test, unseen_users = _interleave({s: t for s, t in by_sender.items() if s in unseen})
    return Corpus(
        name=name,
        train=train,
        valid=valid,
        test=test,
        train_users=train_users,
        unseen_test=unseen_test,
        unseen_users=unseen_users,
        valid_users=valid_users,
        test_users=test_users,
    )
