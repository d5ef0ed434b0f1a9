"""WikiText split by article: the loader finds the articles, the partition gives
each phone whole articles, every article once, of unequal sizes."""

from pathlib import Path

import pytest

from fedkey.common.config import DataConfig
from fedkey.corpora.dataset import load_cut
from fedkey.corpora.loaders import article_starts, load_corpus, load_text_dir
from fedkey.corpora.partition import by_article, partition

#: Three articles; the second holds a table whose legend renders as level-1 lines between text
#: lines (as WikiText-2's hockey articles do), which are not titles.
WIKI = """
 = Alpha Bird =

 The alpha bird sings . It flies far .

 = = Range = =

 It lives in the north .

 = Beta Team =

 The team plays hockey .
 Note : a
 = Goals ; A =
 b ; Pts
 = Points ; c =
 The season ended .

 = Gamma Road =

 The road is long . It is old . It is paved .
"""


def _wiki(tmp_path: Path, train: str = WIKI) -> Path:
    for split, text in (("train", train), ("valid", " = V =\n\n v w .\n"),
                        ("test", " = T =\n\n t u .\n")):  # fmt: skip
        (tmp_path / f"{split}.txt").write_text(text)
    return tmp_path


def test_titles_are_level_one_headings_between_blank_lines():
    lines = WIKI.split("\n")
    starts = article_starts(lines)
    assert [lines[i].strip() for i in starts] == ["= Alpha Bird =", "= Beta Team =",
                                                  "= Gamma Road ="]  # fmt: skip


def test_every_training_item_names_its_article(tmp_path):
    corpus = load_text_dir(_wiki(tmp_path), paper_protocol=True)
    assert corpus.train_articles is not None and len(corpus.train_articles) == len(corpus.train)
    by = dict(zip(corpus.train, corpus.train_articles, strict=True))
    assert by["= alpha bird ="] == by["it lives in the north"] == "0000 Alpha Bird"
    assert by["= goals ; a ="] == by["the season ended"] == "0001 Beta Team"
    assert by["it is paved"] == "0002 Gamma Road"
    assert load_text_dir(tmp_path).train_articles[0] == "0000 Alpha Bird"  # standard protocol too


def test_text_without_titles_has_no_articles_and_the_scheme_says_so(tmp_path):
    corpus = load_text_dir(_wiki(tmp_path, " a b c\n d e f\n"))
    assert corpus.train_articles is None
    with pytest.raises(ValueError, match="needs a corpus whose training text has article titles"):
        partition(corpus, "articles", 2, seed=0)


def test_each_phone_holds_whole_articles_every_article_once():
    sizes = [3, 9, 1, 4, 4, 7, 2, 5]  # items per article
    articles = [f"a{j}" for j, n in enumerate(sizes) for _ in range(n)]
    shards = by_article(articles, 3, seed=1)
    assert sorted(i for s in shards for i in s) == list(range(len(articles)))  # each item once
    owners = [{articles[i] for i in s} for s in shards]
    assert all(owners) and set().union(*owners) == set(articles)
    assert sum(len(o) for o in owners) == len(sizes)  # no article on two phones
    for s, o in zip(shards, owners, strict=True):  # whole: all of an article's items
        assert len(s) == sum(sizes[int(a[1:])] for a in o)
    assert len({len(s) for s in shards}) > 1  # unequal sizes, as articles are
    assert by_article(articles, 3, seed=1) == shards and by_article(articles, 3, 2) != shards
    with pytest.raises(ValueError, match="only 8 articles"):
        by_article(articles, 9, seed=0)


def test_the_cut_keeps_the_articles_beside_the_items(tmp_path):
    cfg = DataConfig(data=str(_wiki(tmp_path)), paper_protocol=True, max_train_tokens=12)
    corpus, _ = load_cut(cfg)
    assert 0 < len(corpus.train) < 11 and len(corpus.train_articles) == len(corpus.train)


@pytest.mark.needs_data
def test_wikitext2_has_600_training_articles(data_dir):
    corpus = load_corpus(data_dir / "wikitext-2", paper_protocol=True)
    assert len(set(corpus.train_articles)) == 600
    shards = partition(corpus, "articles", 100, seed=0)
    words = [sum(len(corpus.train[i].split()) for i in s) for s in shards]
    assert sum(len(s) for s in shards) == len(corpus.train) and min(words) < max(words) / 2
