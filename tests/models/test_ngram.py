"""The n-gram baselines: Kneser-Ney (a proper distribution, the counts it is built from, its
metrics) and the unigram by position (the seed papers' column measure)."""

import math

import numpy as np
import pytest

from fedkey.models.ngram import KneserNey
from fedkey.models.positional import PositionalUnigram
from fedkey.models.tokenizers import WordTokenizer

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
        assert math.isclose(p.sum(), 1.0, rel_tol=1e-6)  # stored as float32
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


def test_a_suggestion_bars_top_1_skips_the_unknown_word_the_ngram_likes_best():
    """After "a", <unk> (three rare words) is likelier than "b", which a bar would show first."""
    train = ["a b", "a q", "a r", "a s", "c b", "c b"]
    tok = WordTokenizer.build(train, max_size=6)  # <unk> <s> </s> a b c: q r s are <unk>
    lm = KneserNey(tok, order=2).fit(tok.encode(s) for s in train)
    # targets a (after <s>: the likeliest) and b (after a: <unk> is likelier), then </s>
    scores = lm.evaluate(["a b"])
    assert (scores["top1"], scores["bar_top1"]) == (0.5, 1.0)


def test_out_of_vocabulary_words_count_as_misses_over_every_word():
    """bar_top1 is over the words in the vocabulary; all_top1 over every real word (not </s>),
    an out-of-vocabulary one a miss; oov is their share, as fedkey.models.metrics.evaluate."""
    train = ["a b", "a b", "a c", "c b"]
    tok = WordTokenizer.build(train, max_size=6)  # <unk> <s> </s> a b c
    lm = KneserNey(tok, order=2).fit(tok.encode(s) for s in train)
    held = ["a b zz", "a qq c"]  # real words: a b zz a qq c
    words = [w for s in held for w in s.split()]
    r = lm.evaluate(held)
    assert r["oov"] == sum(w not in tok.stoi for w in words) / len(words) == 2 / 6
    # The bar's first guess after <s> is "a" (two hits), after "a" "b" (a hit); after <unk> (qq)
    # the unigram's, "b" (c misses).
    assert r["bar_top1"] == 3 / 4
    assert r["all_top1"] == 3 / 6 < r["bar_top1"]
    assert r["all_top3"] == r["bar_top3"] * 4 / 6


def test_order_below_two_is_refused():
    with pytest.raises(ValueError, match="order"):
        KneserNey(WordTokenizer.build(TRAIN), order=1)


def test_positional_unigram_is_a_distribution_per_position_that_knows_the_position():
    tok = WordTokenizer.build(TRAIN + ["zebra"], max_size=None)
    lm = PositionalUnigram(tok, max_position=4, prior=1.0).fit(tok.encode(s) for s in TRAIN)
    assert np.allclose(np.exp(lm.log_probs).sum(1), 1.0) and np.isfinite(lm.log_probs).all()
    assert lm.position_log_probs(1).argmax() == tok.stoi["the"]  # 2 of 3 sentences start so
    assert lm.position_log_probs(2).argmax() in (tok.stoi["cat"], tok.stoi["dog"])
    assert (lm.position_log_probs(9) == lm.position_log_probs(4)).all()  # capped


def test_positional_unigram_scores_the_seeds_columns_far_better_than_sentences():
    text = [f"{a} {b} {c}" for a in ("i", "we") for b in ("like", "love", "want") for c in "xyz"]
    tok = WordTokenizer.build(text, max_size=None)
    lm = PositionalUnigram(tok).fit(tok.encode(s) for s in text).choose_prior(text)
    # Column 0 is all <s> and column j only holds words seen at position j.
    assert lm.column_perplexity(text) < 2.5 < lm.evaluate(text)["ppl"]
    chosen = lm.column_perplexity(text)
    for prior in (10.0, 1e5):
        assert chosen <= lm.set_prior(prior).column_perplexity(text)


def test_fedkey_ngram_positional_reports_the_column_measure(tmp_path):
    import json

    from typer.testing import CliRunner

    from fedkey.cli import app

    out = tmp_path / "pos"
    args = ["ngram", "--data", "demo", "--positional", "--ksr-sentences", "0", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["strategy"].startswith("positional-unigram-prior-")
    assert 1 < row["col_test_ppl"] < row["test_ppl"]
    assert row["best_col_test_ppl"] == row["col_test_ppl"]
