import math

import pytest

from fedkey.models.tokenizers import (
    SentencePieceTokenizer,
    WordTokenizer,
    build_tokenizer,
    tokenizer_from_config,
)

TEXT = ["see you later", "see you soon", "on my way", "see you at the station", "thank you so much"]


def test_word_vocab_order_size_and_unknowns():
    tok = WordTokenizer.build(TEXT, max_size=6)
    assert tok.itos[:3] == ["<unk>", "<s>", "</s>"]
    assert tok.itos[3:6] == ["you", "see", "at"]  # by frequency, ties alphabetical
    assert tok.vocab_size == 6
    ids = tok.encode("see you tomorrow")
    assert ids == [tok.bos_id, tok.stoi["see"], tok.stoi["you"], tok.unk_id, tok.eos_id]
    assert tok.decode(ids) == "see you <unk>"


def test_word_vocab_keeps_corpus_unk_as_the_unk_id():
    tok = WordTokenizer.build(["a <unk> b", "a"], max_size=None)
    assert tok.encode("<unk>")[1] == tok.unk_id
    assert tok.itos.count("<unk>") == 1


def test_sentencepiece_round_trip_and_config():
    corpus = [
        f"{a} {b} message number {i}"
        for i in range(300)
        for a, b in [("see", "you"), ("on", "way")]
    ]
    tok = SentencePieceTokenizer.train(corpus, vocab_size=60)
    ids = tok.encode("see you message")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "see you message"
    assert tok.num_words("see you message") == 3
    again = tokenizer_from_config(tok.to_config())
    assert again.encode("on way 12") == tok.encode("on way 12")


def test_build_and_config_errors():
    tok = build_tokenizer("word", TEXT, 100)
    assert tokenizer_from_config(tok.to_config()).itos == tok.itos
    with pytest.raises(ValueError, match="unknown tokenizer"):
        build_tokenizer("bpe", TEXT)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tokenizer_from_config({"kind": "char"})
    assert not math.isnan(tok.vocab_size)
