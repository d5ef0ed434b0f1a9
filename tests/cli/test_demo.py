"""`fedkey demo`'s corpus: NUS SMS when it is in the data directory or can be fetched, else the
Chit-Chat senders held out of the base's pretraining, said in one line."""

from __future__ import annotations

import pytest

from fedkey.cli import demo
from fedkey.cli.errors import UserError


@pytest.fixture
def empty_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def offline(name, root, **kw):
    raise OSError("download of https://example.invalid failed: no network")


def test_nus_sms_in_the_data_directory_is_used(empty_data_dir, monkeypatch):
    (empty_data_dir / "nus-sms").mkdir(parents=True)
    (empty_data_dir / "nus-sms" / "smsCorpus_en_xml_2015.03.09_all.zip").write_bytes(b"")
    monkeypatch.setattr("fedkey.corpora.datadir.fetch", offline)  # never asked
    said: list[str] = []
    assert demo.demo_corpus("auto", said.append) == "nus-sms"
    assert said == []


def test_nus_sms_is_fetched_when_absent(empty_data_dir, monkeypatch):
    fetched = []
    monkeypatch.setattr(
        "fedkey.corpora.datadir.fetch", lambda name, root, **kw: fetched.append(name)
    )
    said: list[str] = []
    assert demo.demo_corpus("auto", said.append) == "nus-sms"
    assert fetched == ["nus-sms"] and said == [f"fetching NUS SMS (2.4 MB) into {empty_data_dir}"]


def test_offline_federates_over_the_held_out_chitchat_senders_in_one_line(
    empty_data_dir, monkeypatch
):
    monkeypatch.setattr("fedkey.corpora.datadir.fetch", offline)
    said: list[str] = []
    assert demo.demo_corpus("auto", said.append) == "chitchat-heldout"
    fallback = [line for line in said if "held out of the base's pretraining" in line]
    assert len(fallback) == 1 and "\n" not in fallback[0] and "no network" in fallback[0]


def test_asked_for_corpora(empty_data_dir, monkeypatch):
    monkeypatch.setattr("fedkey.corpora.datadir.fetch", offline)
    assert demo.demo_corpus("chitchat", print) == "chitchat-heldout"
    with pytest.raises(UserError, match="NUS SMS could not be fetched"):
        demo.demo_corpus("nus-sms", lambda line: None)


def test_one_phone_per_sender_with_enough_messages():
    """The real corpus (tests/conftest.py points FEDKEY_DATA_DIR at ../shared/data)."""
    from fedkey.corpora.datadir import data_dir, is_present

    if not is_present("nus-sms", data_dir()):
        pytest.skip("NUS SMS is not in the data directory")
    assert demo.senders_with("nus-sms", demo.NUS_MIN_MESSAGES) == 30
    assert demo.senders_with("nus-sms", 1) > demo.senders_with("nus-sms", demo.NUS_MIN_MESSAGES)


def test_offline_phones_are_the_held_out_chitchat_senders():
    assert demo.senders_with("chitchat-heldout", demo.NUS_MIN_MESSAGES) == 21
