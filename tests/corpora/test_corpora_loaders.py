"""Corpus loaders: text directories (PTB layout), user corpora, Stack Exchange, dispatch."""

import json
from pathlib import Path

import pytest

from fedkey.corpora.loaders import (
    Corpus,
    load_corpus,
    load_jsonl,
    load_stackexchange_posts,
    load_text_dir,
    load_user_dir,
    normalize_text,
    split_sentences,
    split_user_messages,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
PTB = DATA / "ptb"
WIKI = DATA / "wikitext-2"
POSTS = DATA / "stackexchange_beer_sample" / "Posts.xml"


def _needs(path: Path):
    return pytest.mark.skipif(
        not path.exists(), reason=f"dataset not found at {path} (../shared/data is absent here)"
    )


# --- normalize_text / split_sentences ---------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Hello, world!", "hello , world !"),
        ("Don't panic... OK?", "don't panic ... ok ?"),
        ("It\u2019s a well-known 3.5% thing", "it's a well-known 3.5 % thing"),
        ("  spaced\tout \n text ", "spaced out text"),
        ("wow!!! really?!", "wow !!! really ? !"),
        ("", ""),
    ],
)
def test_normalize_text(raw, expected):
    assert normalize_text(raw) == expected


def test_split_sentences():
    assert split_sentences("hi . how are you ? ok") == ["hi .", "how are you ?", "ok"]
    assert split_sentences("wait ... what ? ! no") == ["wait ...", "what ? !", "no"]
    assert split_sentences(". . hello") == ["hello"]


# --- text directories ---------------------------------------------------------------------------


def _write_text_dir(root: Path) -> Path:
    root.mkdir()
    (root / "train.txt").write_text(
        " = Heading = \n\n The Cat sat . It Ran away . \n a  b   c \n", encoding="utf-8"
    )
    (root / "valid.txt").write_text(" One . Two .\n", encoding="utf-8")
    (root / "test.txt").write_text(" <unk> X \n", encoding="utf-8")
    return root


def test_load_text_dir_standard(tmp_path):
    c = load_text_dir(_write_text_dir(tmp_path / "tiny"))
    assert c.name == "tiny"
    assert c.train == ["= Heading =", "The Cat sat . It Ran away .", "a b c"]
    assert c.valid == ["One . Two ."]
    assert c.test == ["<unk> X"]
    assert c.train_users is None


def test_load_text_dir_drop_headings(tmp_path):
    c = load_text_dir(_write_text_dir(tmp_path / "tiny"), drop_headings=True)
    assert c.train == ["The Cat sat . It Ran away .", "a b c"]


def test_load_text_dir_paper_protocol(tmp_path):
    c = load_text_dir(_write_text_dir(tmp_path / "tiny"), paper_protocol=True)
    assert c.train == ["= heading =", "the cat sat", "it ran away", "a b c"]
    assert c.valid == ["one", "two"]  # the final " ." is split off as well
    assert c.test == ["<unk> x"]


def test_load_text_dir_missing_split(tmp_path):
    root = tmp_path / "broken"
    root.mkdir()
    (root / "train.txt").write_text("a b\n")
    with pytest.raises(FileNotFoundError, match="valid.txt, test.txt"):
        load_text_dir(root)


@pytest.mark.needs_data
@_needs(PTB)
def test_ptb_counts():
    c = load_text_dir(PTB)
    assert (len(c.train), len(c.valid), len(c.test)) == (42068, 3370, 3761)
    assert (c.num_words("train"), c.num_words("valid"), c.num_words("test")) == (
        887521,
        70390,
        78669,
    )
    paper = load_text_dir(PTB, paper_protocol=True)
    assert paper.num_words("train") == 887521  # PTB has no " . ": same words, lowercased
    assert all(s == s.lower() for s in paper.train[:1000])


@pytest.mark.needs_data
@_needs(WIKI)
def test_wikitext2_counts():
    c = load_text_dir(WIKI)
    # words only (the papers' 2,088,628 adds one end token per line, empty lines included)
    assert (c.num_words("train"), c.num_words("valid"), c.num_words("test")) == (
        2051910,
        213886,
        241211,
    )
    paper = load_text_dir(WIKI, paper_protocol=True)
    assert len(paper.train) > 3 * len(c.train)
    assert not any(s.endswith(" .") for s in paper.train[:2000])


# --- user corpora -------------------------------------------------------------------------------


def test_split_user_messages_per_user_fractions():
    msgs = {"a": [f"a{i}" for i in range(20)], "b": [f"b{i}" for i in range(10)], "c": ["c0"]}
    c = split_user_messages(msgs, seed=3)
    assert c.train_users.count("a") == 16 and c.train_users.count("b") == 8
    assert c.train_users.count("c") == 1  # a single message always goes to train
    assert len(c.valid) == len(c.test) == 3
    everything = sorted(c.train + c.valid + c.test)
    assert everything == sorted(m for ms in msgs.values() for m in ms)
    assert all(item.startswith(user) for item, user in zip(c.train, c.train_users, strict=True))
    assert c.train_users[:3] == ["a", "b", "c"]  # round-robin interleaving
    assert split_user_messages(msgs, seed=3) == c
    assert split_user_messages(msgs, seed=4) != c


def test_split_user_messages_bad_fracs():
    with pytest.raises(ValueError, match="valid_frac"):
        split_user_messages({"a": ["x"]}, seed=0, valid_frac=0.6, test_frac=0.5)


def test_load_user_dir(tmp_path):
    root = tmp_path / "phones"
    root.mkdir()
    (root / "alice.txt").write_text(
        "\n".join(f"Hello, Bob! Message {i}." for i in range(10)) + "\n\n", encoding="utf-8"
    )
    (root / "bob.txt").write_text("Don't forget the milk\nSee you later!\n", encoding="utf-8")
    c = load_user_dir(root, seed=1)
    assert c.name == "phones"
    assert set(c.train_users) == {"alice", "bob"}
    assert c.train_users.count("alice") == 8 and len(c.valid) == len(c.test) == 1
    assert "don't forget the milk" in c.train and "see you later !" in c.train
    assert all(s == normalize_text(s) for s in c.train + c.valid + c.test)


def test_load_jsonl(tmp_path):
    p = tmp_path / "msgs.jsonl"
    rows = [{"user": 7, "text": f"Hi THERE number {i}"} for i in range(10)]
    rows += [{"user": "z", "text": "Only one, message."}, {"user": "z", "text": "   "}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    c = load_jsonl(p, seed=0)
    assert c.name == "msgs"
    assert c.users == ["7", "z"]
    assert c.train_users.count("7") == 8 and c.train_users.count("z") == 1
    assert "only one , message ." in c.train
    assert load_jsonl(p, seed=0) == c


def test_load_jsonl_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"user": "a", "text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_jsonl(p)
    p.write_text('{"who": "a", "text": "ok"}\n')
    with pytest.raises(ValueError, match="expected an object"):
        load_jsonl(p)


@pytest.mark.needs_data
@_needs(POSTS)
def test_stackexchange_posts():
    c = load_stackexchange_posts(POSTS, seed=0)
    assert len(c.users) == 554
    assert len(c.train) > 5000 and len(c.valid) > 500 and len(c.test) > 500
    text = " ".join(c.train[:2000])
    assert "<p>" not in text and "< p >" not in text and "&amp;" not in text
    assert "http : //" not in text  # URLs removed
    assert not any(t.startswith("www.") for t in text.split())
    assert all(s == s.lower() for s in c.train[:2000])
    assert load_stackexchange_posts(POSTS.parent, seed=0) == c


# --- dispatch and slicing -----------------------------------------------------------------------


def test_load_corpus_dispatch(tmp_path):
    text_dir = _write_text_dir(tmp_path / "tiny")
    assert load_corpus(str(text_dir)).train == load_text_dir(text_dir).train
    assert load_corpus(str(text_dir), paper_protocol=True).train[1] == "the cat sat"

    users = tmp_path / "users"
    users.mkdir()
    (users / "u1.txt").write_text("hello there friend\n")
    assert load_corpus(str(users)).train_users == ["u1"]

    jl = tmp_path / "m.jsonl"
    jl.write_text('{"user": "x", "text": "hi you"}\n')
    assert load_corpus(str(jl)).train == ["hi you"]

    se = tmp_path / "se"
    se.mkdir()
    (se / "Posts.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?>\n<posts>\n'
        '  <row Id="1" PostTypeId="1" OwnerUserId="5" Title="Best IPA?" '
        'Body="&lt;p&gt;Which IPA is best? I like &lt;a href=&quot;http://x.y&quot;&gt;hops'
        '&lt;/a&gt; &amp;amp; malt.&lt;/p&gt;" />\n'
        '  <row Id="2" PostTypeId="2" Body="&lt;p&gt;no owner&lt;/p&gt;" />\n</posts>\n'
    )
    c = load_corpus(str(se))
    assert c.train_users == ["5"] * 3
    assert c.train == ["best ipa ?", "which ipa is best ?", "i like hops & malt ."]
    assert load_corpus(str(se / "Posts.xml")) == c


def test_load_corpus_demo():
    c = load_corpus("demo")
    assert c.name == "demo" and c.train_users is not None


def test_load_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="accepted corpus specs"):
        load_corpus(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="train.txt, valid.txt and test.txt"):
        load_corpus(str(empty))
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"\.jsonl file"):
        load_corpus(str(other))


def test_a_prefix_of_a_user_corpus_holds_every_user():
    """The splits interleave the users, so the caps of fedkey.corpora.dataset.load_cut (a prefix of
    each split) keep every user."""
    c = split_user_messages({u: [f"{u}{i}" for i in range(10)] for u in "abc"}, seed=0)
    assert set(c.train_users[:6]) == {"a", "b", "c"}  # type: ignore[index]


def test_corpus_checks_user_alignment():
    with pytest.raises(ValueError, match="train_users"):
        Corpus("x", ["a", "b"], [], [], train_users=["u"])
