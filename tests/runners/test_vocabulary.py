"""`fedkey vocabulary discover` in simulation (fedkey.runners.vocabulary): the slang many phones
type joins the vocabulary, a word of one phone does not, the held-out text has fewer unknown
words, and the new base encodes the phones' text as `--init` reads it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedkey.common.config import DataConfig
from fedkey.corpora.dataset import server_data
from fedkey.corpora.loaders import load_corpus
from fedkey.models.base import read_base
from fedkey.runners.vocabulary import DiscoverConfig, check, discover_vocabulary
from fedkey.testing.vocabulary import SECRET, SLANG, phones_corpus, write_base


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return write_base(root / "base.safetensors"), phones_corpus(root / "phones.jsonl")


def config(setup, tmp_path, **changes) -> DiscoverConfig:
    base, corpus = setup
    data = DataConfig(data=str(corpus), partition="user", clients=40, init=str(base))
    # delta 1e-9: a word of one phone leaks with probability 1e-9 at most (the test never flakes).
    found = DiscoverConfig(data, 8.0, tmp_path / "new.safetensors", 2, 1e-9, progress=False)
    return replace(found, **changes)


def test_the_slang_of_many_phones_joins_and_a_word_of_one_phone_does_not(setup, tmp_path):
    result = discover_vocabulary(config(setup, tmp_path))
    assert set(result.release.added) == set(SLANG)  # 30 phones each; the secret: one phone
    assert SECRET not in read_base(result.out)["tokenizer"]["words"]
    # The slang was what the test text did not know, and the secret name, which it still does not.
    test = load_corpus(str(setup[1])).test
    words = [w for s in test for w in s.split()]
    unknown = sum(w in (*SLANG, SECRET) for w in words), words.count(SECRET)
    assert result.oov["test"] == pytest.approx((unknown[0] / len(words), unknown[1] / len(words)))
    note = read_base(result.out)["vocabulary"][-1]
    assert (note["phones"], note["max_words_per_phone"]) == (40, 2)
    assert note["epsilon"] == pytest.approx(8.0) and note["delta"] == pytest.approx(1e-9)
    assert set(note["noisy_counts"]) == set(SLANG) and note["added"] == result.release.added
    # --init NEW_BASE: the phones' text is encoded with the extended vocabulary.
    data = config(setup, tmp_path).data
    _, tokenizer = server_data(replace(data, init=str(result.out)))
    assert all(tokenizer.stoi[w] >= result.size_before for w in SLANG)
    assert tokenizer.encode("ok lor")[2] == tokenizer.stoi["lor"]


def test_a_small_budget_releases_less(setup, tmp_path):
    # At epsilon 0.05 and delta 1e-9 the threshold is past 40 phones: nothing can pass it.
    result = discover_vocabulary(config(setup, tmp_path, epsilon=0.05))
    assert result.release.plan.threshold > 40 and result.release.added == []
    assert result.oov["test"][0] == result.oov["test"][1]
    assert read_base(result.out)["vocabulary"][-1]["added"] == []


def test_what_cannot_run_is_refused_in_one_line_before_the_corpus_is_read(setup, tmp_path):
    base, _ = setup
    sp = write_base(tmp_path / "sp.safetensors", kind="sentencepiece")
    cases = [
        (config(setup, tmp_path, data=DataConfig(data="nowhere", init=None)), "--init is required"),
        (config(setup, tmp_path, data=DataConfig(data="nowhere", init=str(sp))), "SentencePiece"),
        (config(setup, tmp_path, epsilon=0.0), "--epsilon 0.0: must be > 0"),
        (config(setup, tmp_path, delta=1.5), "--delta 1.5"),
        (config(setup, tmp_path, out=base), "the base itself"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            check(bad)
        assert "\n" not in str(e.value)
