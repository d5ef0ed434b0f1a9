import pytest

from fedkey.models import metrics
from fedkey.models.batching import IGNORE, batches
from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel
from fedkey.models.tokenizers import WordTokenizer


def words_per_sentence(batch_list):
    return [(targets != IGNORE).sum(1).tolist() for _, targets in batch_list]


def test_batches_end_before_max_words_and_keep_every_sentence():
    seqs = [[1, *[5] * n, 2] for n in (1, 3, 8, 2, 2)]  # predicted words: 2, 4, 9, 3, 3
    assert words_per_sentence(batches(seqs, 3)) == [[2, 4, 9], [3, 3]]
    # 2 + 4 + 9 > 6 ends the first batch; 9 > 6 alone is a batch of its own
    assert words_per_sentence(batches(seqs, 3, max_words=6)) == [[2, 4], [9], [3, 3]]
    assert words_per_sentence(batches(seqs, 3, [4, 0, 1], max_words=6)) == [[3, 2], [4]]


def test_scores_do_not_depend_on_the_batching(monkeypatch):
    text = ["see you later", "on my way home now", "see you", "at the station at nine"]
    tok = WordTokenizer.build(text)
    model = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8))
    one = metrics.evaluate(model, tok, text, batch_size=1)
    monkeypatch.setattr(metrics, "SCORES", 6 * tok.vocab_size)  # 6 words a batch
    capped = metrics.evaluate(model, tok, text, batch_size=64)
    assert capped["nll"] == pytest.approx(one["nll"], rel=1e-5)
    assert (capped["top1"], capped["top3"], capped["words"]) == (
        one["top1"],
        one["top3"],
        one["words"],
    )
