"""The Chit-Chat loader (fedkey.corpora.chitchat) on a small dataset written here in the package's
layout; one test reads the installed dataset."""

import json

import pytest

from fedkey.corpora import chitchat
from fedkey.corpora.chitchat import is_pretraining, load_chitchat, read_messages
from fedkey.corpora.loaders import CHITCHAT_CORPORA, load_corpus
from fedkey.testing.pretrain import chitchat_json


def senders_of(corpus):
    return set(corpus.train_users) | set(corpus.unseen_users or [])


def test_messages_are_read_in_order_normalized_with_their_sender_and_time(tmp_path):
    path = tmp_path / "dataset.json"
    turn = [
        {"text": "Hello", "timestamp": "2018-05-02T19:38:15Z", "sender": "a"},
        {"text": "How are you doing today?", "timestamp": "2018-05-02T19:38:20Z", "sender": "a"},
    ]
    blank = [{"text": "  ", "timestamp": "2018-05-02T19:39:00Z", "sender": "b"}]
    answer = [{"text": "Im doing good", "sender": "b"}]
    path.write_text(json.dumps({"c1": {"messages": [turn, blank, answer]}}))
    got = [(m.sender, m.time, m.text) for m in read_messages(path)]
    assert got == [
        ("a", ("2018-05-02T19:38:15Z",), "hello"),
        ("a", ("2018-05-02T19:38:20Z",), "how are you doing today ?"),
        ("b", (), "im doing good"),  # the blank message is dropped; no time is ()
    ]


def test_the_sender_split_is_disjoint_covers_everyone_and_ignores_the_seed(tmp_path):
    path = chitchat_json(tmp_path / "dataset.json", senders=200, conversations=400)
    everyone = {m.sender for m in read_messages(path)}
    public = load_chitchat("chitchat", path, seed=0)
    held = load_chitchat("chitchat-heldout", path, seed=0)
    assert not public.unseen_test  # the pretraining text holds no held-out senders of its own
    assert senders_of(public).isdisjoint(senders_of(held))
    assert senders_of(public) | senders_of(held) == everyone
    assert senders_of(public) == {s for s in everyone if is_pretraining(s)}
    assert 0.7 < len(senders_of(public)) / len(everyone) < 0.9  # PRETRAIN_SHARE, 0.8
    again = load_chitchat("chitchat", path, seed=7)  # another run's seed: the same senders
    assert senders_of(again) == senders_of(public)
    assert load_chitchat("chitchat", path, seed=0).train == public.train


def test_the_corpus_names_load_the_installed_dataset(tmp_path, monkeypatch):
    path = chitchat_json(tmp_path / "dataset.json")
    monkeypatch.setattr(chitchat, "dataset_path", lambda: path)
    for name in CHITCHAT_CORPORA:
        corpus = load_corpus(name)
        assert corpus.name == name and corpus.train
    with pytest.raises(ValueError, match="unknown chitchat part"):
        load_chitchat("chitchat-all", path)


@pytest.mark.slow
def test_the_installed_dataset_splits_its_1315_senders_about_80_20():
    messages = list(read_messages(chitchat.dataset_path()))
    everyone = {m.sender for m in messages}
    public = {s for s in everyone if is_pretraining(s)}
    assert len(everyone) == 1315 and len(messages) > 250_000
    assert 0.75 < len(public) / len(everyone) < 0.85
