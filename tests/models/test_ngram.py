"""The Kneser-Ney baseline: a proper distribution, the counts it is built from, its metrics."""

import math

import numpy as np
import pytest

from models.ngram import KneserNey
from models.tokenizers import WordTokenizer

TRAIN = ["the cat sat on the mat", "the dog sat on the log", "a cat ate the fish"] * 3


@pytest.fixture
def lm():
    tok = WordTokenizer.build(TRAIN + ["zebra"], max_size=None)
    return KneserNey(tok, order=3).fit(tok.encode(s) for s in TRAIN)


def test_every_distribution_sums_to_one_and_never_gives_zero(lm):
    tok = lm.tokenizer
    for context in (["the", "cat"], ["sat", "on"], ["zebra", "zebra"], ["fish"]):
        p = lm.distribution([tok.bos_id] + [tok.stoi[w] for w in context])
        assert p.shape == (tok.vocab_size,)
        assert math.isclose(p.sum(), 1.0, rel_tol=1e-9)
        assert (p > 0).all()  # "zebra", never seen in training, still has some mass


def test_seen_continuations_win_and_trigrams_beat_bigrams(lm):
    tok = lm.tokenizer
    ids = [tok.stoi[w] for w in ("sat", "on")]
    p = lm.distribution([tok.bos_id, *ids])
    assert int(np.argmax(p)) == tok.stoi["the"]  # "sat on" is always followed by "the"
    # After "on the", "mat" and "log" are likely; after "ate the", "fish" is.
    on_the = lm.distribution([tok.stoi["on"], tok.stoi["the"]])
    ate_the = lm.distribution([tok.stoi["ate"], tok.stoi["the"]])
    assert on_the[tok.stoi["mat"]] > on_the[tok.stoi["fish"]]
    assert ate_the[tok.stoi["fish"]] > ate_the[tok.stoi["mat"]]


def test_evaluate_counts_the_end_of_sentence_and_scores_top_k(lm):
    seen = lm.evaluate(["the cat sat on the mat"])
    unseen = lm.evaluate(["zebra fish mat dog"])
    assert seen["words"] == 7  # six words and </s>
    assert seen["ppl"] < unseen["ppl"] < lm.tokenizer.vocab_size * 10
    assert 0 < seen["top1"] <= seen["top3"] <= 1


def test_order_below_two_is_refused():
    with pytest.raises(ValueError, match="order"):
        KneserNey(WordTokenizer.build(TRAIN), order=1)
