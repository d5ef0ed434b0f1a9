"""The Chit-Chat Challenge dataset: public chat between crowd workers, text to pretrain on.

The PyPI package ``chitchat-dataset`` 0.9.0 (MIT; github.com/BYU-PCCL/chitchat-dataset), a
dependency of fedkey, ships it as one JSON file, ``chitchat_dataset/dataset.json``: 7,168
conversations, 258,145 messages from 1,315 senders. Its layout is
``{conversation id: {"messages": [[{"text", "timestamp", "sender"}, ...], ...]}}``, a turn being
the list of messages one sender typed in a row. Every message is one item, its sender the
``sender`` id, its time the ISO ``timestamp`` (``2018-05-02T19:38:15Z``, ordered as text), its text
through :func:`fedkey.common.text.normalize_text`, as the other real corpora's.

The senders are split once and for all, by a hash of their id (:func:`is_pretraining`, whatever
the seed): :data:`PRETRAIN_SHARE` of them (about 80%) are the public text ``--data chitchat``
pretrains on (``fedkey pretrain``); the others, ``--data chitchat-heldout``, never pretrain and are
left to federate over. The pretraining part is cut by :mod:`fedkey.corpora.senders`' rules without a
cap and without held-out senders (a server's public text, not phones); the held-out part with the
usual rules, as NUS SMS and Ubuntu IRC are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from fedkey.common.text import normalize_text
from fedkey.corpora.loaders import CHITCHAT_CORPORA, Corpus
from fedkey.corpora.senders import Message, SenderRules, sender_corpus

__all__ = [
    "HELDOUT",
    "PRETRAIN",
    "PRETRAIN_SHARE",
    "dataset_path",
    "is_pretraining",
    "load_chitchat",
    "read_messages",
]

#: The share of the senders (drawn by a hash of their id) whose messages pretrain.
PRETRAIN_SHARE = 0.8

PRETRAIN, HELDOUT = CHITCHAT_CORPORA

#: How each part is cut: the pretraining text whole, the held-out senders as phones.
_RULES = {PRETRAIN: SenderRules(cap=None, held_out=0.0), HELDOUT: SenderRules()}


def dataset_path() -> Path:
    """The JSON file the ``chitchat-dataset`` package installs."""
    return Path(str(resources.files("chitchat_dataset") / "dataset.json"))


def is_pretraining(sender: str) -> bool:
    """Whether `sender` is one of the pretraining senders: the first 8 bytes of the SHA-256 of
    its id, as a fraction of 2^64, below :data:`PRETRAIN_SHARE`."""
    digest = hashlib.sha256(f"fedkey-chitchat/{sender}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < PRETRAIN_SHARE


def read_messages(path: str | Path) -> Iterator[Message]:
    """Every message of the dataset's JSON at `path`, in the file's order, its text normalized."""
    with Path(path).open(encoding="utf-8") as f:
        conversations = json.load(f)
    for conversation in conversations.values():
        for turn in conversation["messages"]:
            for m in turn:
                text = normalize_text(m.get("text") or "")
                if text and m.get("sender"):
                    when = (m["timestamp"],) if m.get("timestamp") else ()
                    yield Message(str(m["sender"]), when, text)


def load_chitchat(name: str, path: str | Path | None = None, seed: int = 0) -> Corpus:
    """The part `name` ("chitchat" or "chitchat-heldout") of the dataset at `path` (default: the
    installed package's), one sender per owner."""
    if name not in CHITCHAT_CORPORA:
        raise ValueError(f"unknown chitchat part {name!r}; choose one of {CHITCHAT_CORPORA}")
    pretraining = name == PRETRAIN
    messages = (
        m for m in read_messages(path or dataset_path()) if is_pretraining(m.sender) == pretraining
    )
    return sender_corpus(name, messages, _RULES[name], seed)
