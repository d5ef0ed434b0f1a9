"""The Ubuntu IRC loader (fedkey.corpora.ubuntu_irc) on log files written here in the upstream format;
one test reads the real logs."""

from collections import Counter
from pathlib import Path

import pytest

from fedkey.corpora.loaders import load_corpus
from fedkey.corpora.partition import partition
from fedkey.corpora.senders import SenderRules
from fedkey.corpora.ubuntu_irc import NAME, is_bot, load_ubuntu_irc, log_files, read_messages

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

DAY_ONE = """\
=== topyli [~juha@dsl.inet.fi]  has joined #ubuntu
[12:18] <alice> Hi all, anyone using Grub?
[12:18] <bob2> alice: yes, what's wrong?
[12:19]  * alice waves
[12:19] <ubottu> Grub is the boot loader, see https://help.ubuntu.com/community/Grub2
[12:19] <FloodBot1> alice: Please don't flood, use http://paste.ubuntu.com to paste
[12:20] <alice> !grub
[12:20] <alice> bob2, it hangs at boot
[12:20] <alice> Note: it worked yesterday
[12:21] <bob2> alice:
[12:21] <bob2> try grub-install again
[12:21] <bob2> try grub-install again
=== bob2 is now known as bob3
"""

DAY_TWO = """\
[09:00] <alice> it works now, thanks
[09:01] <carol> hello
"""


def write_logs(root: Path) -> Path:
    """Two days of #ubuntu in the disentanglement data's layout (train/ and dev/)."""
    (root / "train").mkdir(parents=True)
    (root / "dev").mkdir()
    (root / "train" / "2005-02-08.train-a.raw.txt").write_text(DAY_ONE)
    (root / "dev" / "2005-02-09_03.raw.txt").write_text(DAY_TWO)
    return root


def test_only_people_s_messages_are_kept_with_addresses_replaced(tmp_path):
    got = [(m.sender, m.text) for m in read_messages(write_logs(tmp_path))]
    assert got == [
        ("alice", "hi all , anyone using grub ?"),
        ("bob2", f"{NAME} yes , what's wrong ?"),  # "alice: " -> the name token
        ("alice", f"{NAME} it hangs at boot"),  # "bob2, " too: bob2 speaks in this log
        ("alice", "note : it worked yesterday"),  # "Note" is nobody here
        ("bob2", "try grub-install again"),  # a bare "alice:" is no message
        ("bob2", "try grub-install again"),  # (repeats go later, in fedkey.corpora.senders)
        ("alice", "it works now , thanks"),
        ("carol", "hello"),
    ]


def test_bots():
    assert all(map(is_bot, ["ubottu", "ubotu", "ubot3", "FloodBot1", "floodbot4", "lubotu"]))
    assert not any(map(is_bot, ["mikebot", "shazbotmcnasty", "bottiger", "alice"]))


def test_logs_are_taken_in_date_order_across_folders(tmp_path):
    write_logs(tmp_path)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "2004-11-15_03.raw.txt").write_text("[01:00] <dave> first\n")
    assert [p.name[:10] for p in log_files(tmp_path)] == ["2004-11-15", "2005-02-08", "2005-02-09"]


def test_the_corpus_drops_repeats_and_splits_by_time(tmp_path):
    write_logs(tmp_path)
    lines = [f"[10:{k:02d}] <erin> message number {k}" for k in range(20)]
    (tmp_path / "train" / "2006-01-01.train-c.raw.txt").write_text("\n".join(lines) + "\n")
    c = load_ubuntu_irc(tmp_path, rules=SenderRules(cap=None, held_out=0.0))
    assert Counter(c.train_users)["bob2"] == 2  # three messages, one a repeat; one sender: no test
    erin = [t for t, u in zip(c.train, c.train_users, strict=True) if u == "erin"]
    assert erin == [f"message number {k}" for k in range(16)]
    assert [t for t in c.test if t.startswith("message")] == [
        "message number 18",
        "message number 19",
    ]
    capped = load_ubuntu_irc(tmp_path, rules=SenderRules(cap=5, held_out=0.0))
    assert [t for t in capped.train + capped.valid + capped.test if t.startswith("message")] == [
        f"message number {k}" for k in (15, 16, 17, 18, 19)
    ]


def test_held_out_nicks_never_train_and_clients_k_keeps_the_top_k(tmp_path):
    (tmp_path / "train").mkdir()
    sizes = {f"nick{j}": 2 + 3 * j for j in range(10)}
    lines = [f"[10:00] <{n}> {n} says {k}" for n, size in sizes.items() for k in range(size)]
    (tmp_path / "train" / "2006-01-01.train-c.raw.txt").write_text("\n".join(lines) + "\n")
    c = load_ubuntu_irc(tmp_path, seed=1, rules=SenderRules(held_out=0.3))
    unseen = set(c.unseen_users or [])
    assert len(unseen) == 3 and not unseen & set(c.train_users or [])
    assert all(t.split()[0] in unseen for t in c.unseen_test or [])
    assert not any(t.split()[0] in unseen for t in c.train + c.valid + c.test)
    shards = partition(c, "user", 2, seed=0)
    trained = Counter(c.train_users)
    assert [c.train_users[s[0]] for s in shards] == [n for n, _ in trained.most_common(2)]


def test_load_corpus_by_name(tmp_path, monkeypatch):
    write_logs(tmp_path / "ubuntu-irc")
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path))
    c = load_corpus("ubuntu-irc")
    assert c.name == "ubuntu-irc" and set(c.users) | set(c.unseen_users or []) == {
        "alice",
        "bob2",
        "carol",
    }


@pytest.mark.needs_data
@pytest.mark.skipif(
    not (DATA / "ubuntu-irc" / "train").exists(), reason="../shared/data/ubuntu-irc absent"
)
def test_the_real_logs_counts_match_their_readme():
    msgs = list(read_messages(DATA / "ubuntu-irc"))
    assert len(log_files(DATA / "ubuntu-irc")) == 173
    assert len(msgs) == pytest.approx(213_000, rel=0.02)
    per_nick = Counter(m.sender for m in msgs)
    assert len(per_nick) == pytest.approx(17_780, rel=0.02)
    assert sum(n >= 100 for n in per_nick.values()) == pytest.approx(230, rel=0.05)
    assert sum(m.text.startswith(NAME) for m in msgs) / len(msgs) == pytest.approx(0.42, abs=0.05)
