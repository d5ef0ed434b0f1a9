"""The NUS SMS loader (fedkey.corpora.nus_sms) on a small zip written here in the upstream format, and the
per-sender rules it shares with the IRC loader (fedkey.corpora.senders); one test reads the real zip."""

import zipfile
from collections import Counter
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from fedkey.corpora.datadir import MissingCorpus
from fedkey.corpora.loaders import load_corpus
from fedkey.corpora.nus_sms import ZIP_NAME, load_nus_sms, parse_time, read_messages
from fedkey.corpora.partition import partition
from fedkey.corpora.senders import SenderRules

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _message(i: int, sender: str, text: str, time: str) -> str:
    return (
        f'<message id="{i}"><text>{escape(text)}</text><source><srcNumber>{sender}</srcNumber>'
        '<phoneModel manufactuer="unknown" smartphone="unknown"/><userProfile>'
        f"<userID>{sender}</userID><age>unknown</age><country>SG</country></userProfile>"
        '</source><destination country="unknown"><destNumber>unknown</destNumber></destination>'
        f'<messageProfile language="en" time="{time}" type="unknown"/>'
        '<collectionMethod collector="x" method="unknown" time="2011/3"/></message>'
    )


def write_zip(folder: Path, messages: list[tuple[str, str, str]]) -> Path:
    """The release's zip: one XML file of (sender, text, time) messages, in the given order."""
    body = "\n".join(_message(i, *m) for i, m in enumerate(messages))
    xml = (
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>'
        f'<smsCorpus date="2015.03.09" version="1.2">\n{body}\n</smsCorpus>'
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ZIP_NAME
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("smsCorpus_en_2015.03.09_all.xml", xml)
    return path


def _timed(sender: str, n: int, start_day: int = 1) -> list[tuple[str, str, str]]:
    """n distinct messages of one sender, one a day (2010.10.<day>), written newest first."""
    return [
        (sender, f"Msg {k} from {sender}!", f"2010.10.{start_day + k:02d} 09:00:00")
        for k in reversed(range(n))
    ]


def test_times_in_every_spelling_the_release_uses():
    assert parse_time("2010.10.24 11:59") == (2010, 10, 24, 11, 59, 0)
    assert parse_time("2010.10.29 09:43:06") == (2010, 10, 29, 9, 43, 6)
    assert parse_time("2010.12.2512:01:45") == (2010, 12, 25, 12, 1, 45)
    assert parse_time("1/18/2011 8:23:20 PM") == (2011, 1, 18, 20, 23, 20)
    assert parse_time("1/19/2011 12:05:00 AM") == (2011, 1, 19, 0, 5, 0)
    assert parse_time("unknown") == () == parse_time(None)


def test_messages_are_read_from_the_zip_and_normalized(tmp_path):
    write_zip(
        tmp_path, [("51", "Bugis oso near wat...", "unknown"), ("7", "Hi, U there?", "unknown")]
    )
    got = list(read_messages(tmp_path))
    assert [(m.sender, m.text) for m in got] == [
        ("51", "bugis oso near wat ..."),
        ("7", "hi , u there ?"),
    ]


def test_time_split_repeats_and_cap(tmp_path):
    # Sender a: 20 messages written newest first, plus a repeat; b: 10 with unknown times.
    msgs = _timed("a", 20) + [("a", "Msg 3 from a!", "2010.11.30 10:00")]
    msgs += [("b", f"untimed {k}", "unknown") for k in range(10)]
    write_zip(tmp_path, msgs)
    rules = SenderRules(cap=None, held_out=0.0)
    c = load_nus_sms(tmp_path, rules=rules)
    a_train = [t for t, u in zip(c.train, c.train_users, strict=True) if u == "a"]
    # Time order, the repeat gone: days 0..15 train, 16, 17 valid, 18, 19 test.
    assert a_train == [f"msg {k} from a !" for k in range(16)]
    assert [t for t in c.valid if "from a" in t] == ["msg 16 from a !", "msg 17 from a !"]
    assert [t for t in c.test if "from a" in t] == ["msg 18 from a !", "msg 19 from a !"]
    # Without times, the file's order: the last ones test.
    assert [t for t in c.test if t.startswith("untimed")] == ["untimed 9"]
    # The cap keeps each sender's most recent messages.
    capped = load_nus_sms(tmp_path, rules=SenderRules(cap=10, held_out=0.0))
    kept = [t for t in capped.train + capped.valid + capped.test if "from a" in t]
    assert sorted(kept) == sorted(f"msg {k} from a !" for k in range(10, 20))


def test_held_out_senders_never_train(tmp_path):
    msgs = [m for s in range(20) for m in _timed(f"s{s}", 5)]
    write_zip(tmp_path, msgs)
    c = load_nus_sms(tmp_path, seed=3, rules=SenderRules(held_out=0.2))
    unseen = set(c.unseen_users or [])
    assert len(unseen) == 4 and not unseen & set(c.train_users or [])
    assert len(c.unseen_test or []) == 4 * 5
    assert not any(f"from {s} " in t for s in unseen for t in c.train + c.valid + c.test)
    again = load_nus_sms(tmp_path, seed=3, rules=SenderRules(held_out=0.2))
    assert set(again.unseen_users or []) == unseen  # seeded


def test_clients_k_keeps_the_k_senders_with_most_training_messages(tmp_path):
    sizes = {"s0": 3, "s1": 30, "s2": 12, "s3": 7, "s4": 20}
    write_zip(tmp_path, [m for s, n in sizes.items() for m in _timed(s, n)])
    c = load_nus_sms(tmp_path, rules=SenderRules(held_out=0.0))
    shards = partition(c, "user", 3, seed=0)
    owners = [c.train_users[s[0]] for s in shards]
    assert owners == ["s1", "s4", "s2"]
    assert [len(s) for s in shards] == [24, 16, 10]  # 80% of each sender's messages train
    assert Counter(c.train_users)["s0"] == 3  # too few to validate or test: all train


def test_load_corpus_by_name_and_by_folder(tmp_path, monkeypatch):
    write_zip(tmp_path / "nus-sms", _timed("a", 10) + _timed("b", 10))
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path))
    by_name = load_corpus("nus-sms")
    assert by_name.name == "nus-sms" and len(by_name.train) + len(by_name.unseen_test or []) > 0
    assert load_corpus(str(tmp_path / "nus-sms")).train == by_name.train
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(
        MissingCorpus,
        match=r"nus-sms is not in .*elsewhere: run `fedkey data fetch nus-sms` or set FEDKEY_DATA_DIR",
    ):
        load_corpus("nus-sms")


@pytest.mark.needs_data
@pytest.mark.skipif(
    not (DATA / "nus-sms" / ZIP_NAME).exists(), reason="../shared/data/nus-sms absent"
)
def test_the_real_corpus_counts_match_its_readme():
    msgs = list(read_messages(DATA / "nus-sms"))
    assert len(msgs) == 55_835 and len({m.sender for m in msgs}) == 343
    assert len({(m.sender, m.text) for m in msgs}) == pytest.approx(51_914, rel=0.01)
    c = load_nus_sms(DATA / "nus-sms")
    senders = set(c.users) | set(c.unseen_users or [])
    assert len(senders) == 343 and len(set(c.unseen_users or [])) == 34
    assert max(Counter(c.train_users).values()) <= 800  # the cap of 1000, 80% of it trains
