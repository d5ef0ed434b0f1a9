import math

import numpy as np
import pytest
import torch
from torch import nn

from fedkey.models.config import ModelConfig
from fedkey.models.metrics import evaluate, keystroke_savings, keystroke_savings_of
from fedkey.models.model import LanguageModel
from fedkey.models.tokenizers import SentencePieceTokenizer, WordTokenizer


class FixedScores(nn.Module):
    """A stand-in model whose next-word scores are the same at every position."""

    def __init__(self, scores: torch.Tensor):
        super().__init__()
        self.scores = scores
        self.decoder = nn.Linear(1, 1)

    def forward(self, tokens, state=None):
        return self.scores.expand(*tokens.shape, -1), state

    def logits_at(self, tokens, keep):
        return self.scores.expand(int(keep.sum()), -1)


def test_uniform_model_has_perplexity_equal_to_vocab_size():
    tok = WordTokenizer.build(["a b c d e f g"])
    model = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, emb_size=4, hidden_size=4))
    nn.init.zeros_(model.decoder.bias)
    with torch.no_grad():
        model.embedding.weight.zero_()  # tied: the decoder weight too, so every logit is 0
    r = evaluate(model, tok, ["a b c", "d e", "f g a b"])
    assert r["words"] == 3 + 1 + 2 + 1 + 4 + 1  # end of sentence counted
    assert r["ppl"] == pytest.approx(tok.vocab_size, rel=1e-6)


def test_topk_accuracy_counts_real_words_only():
    tok = WordTokenizer(["<unk>", "<s>", "</s>", "x", "y", "z"])
    scores = torch.tensor([0.0, 0.0, 0.0, 3.0, 2.0, 1.0])  # always predicts x, then y, then z
    # targets: x y z </s>  and  z <unk> </s>  -> real targets x, y, z, z
    r = evaluate(FixedScores(scores), tok, ["x y z", "z qq"])
    assert r["top1"] == pytest.approx(1 / 4)
    assert r["top3"] == pytest.approx(4 / 4)
    logp = torch.log_softmax(scores, 0)
    expected_nll = -float(logp[3] + logp[4] + logp[5] + logp[2] + logp[5] + logp[0] + logp[2])
    assert r["nll"] == pytest.approx(expected_nll, rel=1e-6)


def test_a_suggestion_bars_top_k_ranks_only_the_words_it_can_show():
    """<unk> and </s> may be a model's likeliest tokens, but a bar never shows them: with
    the bar's ranking (bar_top1, bar_top3) the words below them move up."""
    tok = WordTokenizer(["<unk>", "<s>", "</s>", "x", "y", "z", "w"])
    scores = torch.tensor([5.0, 0.0, 4.0, 3.0, 2.0, 1.0, 0.5])  # <unk>, </s>, then x, y, z
    r = evaluate(FixedScores(scores), tok, ["x y z", "w"])  # real targets x, y, z, w
    assert (r["top1"], r["top3"]) == (0.0, pytest.approx(1 / 4))  # only x, third
    assert (r["bar_top1"], r["bar_top3"]) == (pytest.approx(1 / 4), pytest.approx(3 / 4))


def test_a_perplexity_only_evaluation_scores_the_same_without_the_accuracy():
    """The engine reads the validation set for its perplexity only (accuracy=False)."""
    tok = WordTokenizer(["<unk>", "<s>", "</s>", "x", "y", "z"])
    model = FixedScores(torch.tensor([0.0, 0.0, 0.0, 3.0, 2.0, 1.0]))
    full = evaluate(model, tok, ["x y z", "z qq"])
    quick = evaluate(model, tok, ["x y z", "z qq"], accuracy=False)
    accuracy = ("top1", "top3", "bar_top1", "bar_top3", "all_top1", "all_top3", "oov")
    assert quick == {**full, **dict.fromkeys(accuracy, None)}
    assert None not in [full[k] for k in accuracy]


def test_words_out_of_the_vocabulary_are_misses_over_every_word():
    """bar_top1 counts the words in the vocabulary only; all_top1 counts every real word (not
    </s>), an out-of-vocabulary one (<unk>) a miss; oov is their share."""
    tok = WordTokenizer(["<unk>", "<s>", "</s>", "x", "y", "z"])
    scores = torch.tensor([0.0, 0.0, 0.0, 3.0, 2.0, 1.0])  # the bar shows x, y, z
    sentences = ["x qq y", "zz x"]  # real words x qq y zz x: qq and zz are out of the vocabulary
    r = evaluate(FixedScores(scores), tok, sentences)
    words = [w for s in sentences for w in s.split()]
    oov = sum(w not in tok.stoi for w in words) / len(words)
    assert r["oov"] == oov == 2 / 5
    # x x are first, y second: 2 of the 3 known words are the bar's first, all 3 in its top 3.
    assert (r["bar_top1"], r["bar_top3"]) == (2 / 3, 1.0)
    assert (r["all_top1"], r["all_top3"]) == (2 / 5, 3 / 5)
    assert r["all_top1"] < r["bar_top1"]


def test_ties_go_to_the_lower_id_as_in_the_bar():
    tok = WordTokenizer(["<unk>", "<s>", "</s>", "x", "y", "z"])
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # x, y, z tie
    r = evaluate(FixedScores(scores), tok, ["y", "z", "x"])
    assert (r["bar_top1"], r["bar_top3"]) == (1 / 3, 1.0)  # x first


def test_keystroke_savings_by_hand():
    words = ["<unk>", "<s>", "</s>", "apple", "apricot", "banana", "band", "bandit", "cat"]
    tok = WordTokenizer(words)
    scores = torch.tensor([9.0, 9.0, 9.0, 1, 2, 3, 4, 5, 6])  # specials are never suggested
    # "apple": 5 better words before any letter; after "a" only "apricot" beats it -> 1 letter + tap.
    # "band": only cat and bandit beat it -> shown with nothing typed -> 1 tap.
    ksr = keystroke_savings(FixedScores(scores), tok, ["apple band"])
    assert ksr == pytest.approx(1 - 3 / 11)
    # An out-of-vocabulary word is typed in full, space included.
    ksr = keystroke_savings(FixedScores(scores), tok, ["apple zzz"])
    assert ksr == pytest.approx(1 - (2 + 4) / 10)


def _fixed(words: list[str], probs: dict[str, float]):
    """(tokenizer, scores_for) of a model whose next-word probabilities never change."""
    tok = WordTokenizer(["<unk>", "<s>", "</s>", *words])
    row = np.log(np.array([1e-9] * 3 + [probs[w] for w in words]))
    return tok, lambda ids: np.tile(row, (len(ids), 1))


def test_the_bar_ranks_by_keystrokes_saved_not_by_probability():
    """P(w) * (len(w) - typed): "because" (0.10 * 7) leads the bar before a letter is typed,
    though four words are likelier; "i" (0.25, the likeliest) saves 1 keystroke and falls to
    fifth, and once "i" is typed it saves nothing, so it costs its letter and its space."""
    probs = {"i": 0.25, "in": 0.2, "it": 0.15, "is": 0.15, "because": 0.1, "be": 0.1, "bee": 0.05}
    tok, scores_for = _fixed(list(probs), probs)
    # Savings before a letter: because .70, in .40, it .30, is .30, i .25, be .20, bee .15.
    assert keystroke_savings_of(scores_for, tok, ["because"]) == pytest.approx(1 - 1 / 8)
    # By probability "i" would be first (a tap: 1 - 1/2); by savings it is fifth: typed in full.
    assert keystroke_savings_of(scores_for, tok, ["i"]) == 0.0
    # "be" with "b" typed: because .60, be .10, bee .10: in the bar (one letter, one tap).
    assert keystroke_savings_of(scores_for, tok, ["be"]) == pytest.approx(1 - 2 / 3)


def test_a_word_typed_in_full_never_takes_a_slot():
    """With "be" typed, "be" (likelier) saves nothing and leaves the one slot to "bee"; ranked
    by probability among the words starting with "be" it would keep it, and "bee" be typed in
    full."""
    probs = {"be": 0.7, "bee": 0.3}
    tok, scores_for = _fixed(list(probs), probs)
    # one slot: nothing typed be 1.4 > bee 0.9; "b": be 0.7 > bee 0.6; "be": only bee (0.3).
    assert keystroke_savings_of(scores_for, tok, ["bee"], slots=1) == pytest.approx(1 - 3 / 4)


def test_punctuation_is_never_suggested():
    """The keyboard never shows a token without a letter or a digit (fedkey.keyboard_web.suggest),
    so its keystrokes are typed, however likely it is."""
    probs = {",": 0.9, "ok": 0.1}
    tok, scores_for = _fixed(list(probs), probs)
    assert keystroke_savings_of(scores_for, tok, [", ok"]) == pytest.approx(1 - (2 + 1) / 5)


def test_sentencepiece_perplexity_is_per_word():
    corpus = [f"see you {w}" for w in ["later", "soon", "tomorrow", "there"] * 50]
    tok = SentencePieceTokenizer.train(corpus, vocab_size=30)
    model = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, emb_size=4, hidden_size=4))
    r = evaluate(model, tok, ["see you tomorrow"])
    assert r["words"] == 4
    assert r["top1"] is None
    pieces = len(tok.encode("see you tomorrow")) - 1
    assert r["ppl"] == pytest.approx(math.exp(r["nll"] / 4))
    assert pieces >= 4


def test_perplexity_past_the_float_range_is_inf_not_an_error():
    from fedkey.models.metrics import perplexity

    assert perplexity(math.log(50.0)) == pytest.approx(50.0)
    assert perplexity(1000.0) == math.inf  # exp(1000): a model diverged by a x100 update
