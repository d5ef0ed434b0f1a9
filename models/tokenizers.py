"""Tokenizers behind one interface: a word vocabulary and SentencePiece.

Every sentence is encoded as  <s> w_1 ... w_n </s> : <s> is input only, so the model predicts
every word and the end of the sentence (the seed papers count the end-of-sentence prediction).
`num_words(sentence) + 1` is the number of predicted units, which makes perplexity per *word*
comparable between a word model and a SentencePiece model (whose piece log-probs are summed).
"""

from __future__ import annotations

import base64
import io
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, get_args

from fedkey.common.config import TokenizerKind as TokenizerKind  # defined there, re-exported here

UNK, BOS, EOS = "<unk>", "<s>", "</s>"


class _Specials:
    """The special tokens' ids, which both tokenizers set."""

    unk_id: int
    bos_id: int
    eos_id: int

    @property
    def special_ids(self) -> list[int]:
        """<unk>, <s>, </s>: the ids a suggestion bar never shows."""
        return [self.unk_id, self.bos_id, self.eos_id]


class WordTokenizer(_Specials):
    """Word vocabulary: ids 0..2 are <unk>, <s>, </s>; then words by frequency (ties alphabetical)."""

    kind = "word"

    def __init__(self, words: list[str]):
        if words[:3] != [UNK, BOS, EOS]:
            raise ValueError("a word vocabulary starts with <unk>, <s>, </s>")
        self.itos = list(words)
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.unk_id, self.bos_id, self.eos_id = 0, 1, 2

    @classmethod
    def build(cls, sentences: Iterable[str], max_size: int | None = 10_000) -> WordTokenizer:
        """Most frequent words of `sentences`; `max_size` counts the three special tokens."""
        counts = Counter(w for s in sentences for w in s.split())
        for special in (UNK, BOS, EOS):
            counts.pop(special, None)
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
        if max_size is not None:
            ranked = ranked[: max(0, max_size - 3)]
        return cls([UNK, BOS, EOS, *ranked])

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, sentence: str) -> list[int]:
        unk = self.unk_id
        return [self.bos_id, *(self.stoi.get(w, unk) for w in sentence.split()), self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.itos[i] for i in ids if i not in (self.bos_id, self.eos_id))

    def num_words(self, sentence: str) -> int:
        return len(sentence.split())

    def to_config(self) -> dict[str, str | list[str]]:
        return {"kind": self.kind, "words": self.itos}


class SentencePieceTokenizer(_Specials):
    """Subword pieces from the sentencepiece library, trained on text the server holds.

    It is never trained on device data: the server trains it on public text (for the demo, the
    server's copy of the public demo corpus) and ships it inside every checkpoint.
    """

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.unk_id, self.bos_id, self.eos_id = self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()
        self.itos = [self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())]

    @classmethod
    def train(
        cls, sentences: Iterable[str], vocab_size: int = 8000, model_type: str = "unigram"
    ) -> SentencePieceTokenizer:
        import sentencepiece as spm

        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(list(sentences)),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type=model_type,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            hard_vocab_limit=False,  # a small corpus may not support the requested size
            minloglevel=2,
        )
        return cls(buf.getvalue())

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, sentence: str) -> list[int]:
        return [self.bos_id, *self.sp.encode(sentence), self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        text: str = self.sp.decode([i for i in ids if i not in (self.bos_id, self.eos_id)])
        return text

    def num_words(self, sentence: str) -> int:
        return len(sentence.split())

    def to_config(self) -> dict[str, str]:
        return {"kind": self.kind, "model": base64.b64encode(self.model_proto).decode("ascii")}


Tokenizer = WordTokenizer | SentencePieceTokenizer
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = get_args(TokenizerKind)


def build_tokenizer(kind: str, sentences: list[str], vocab_size: int = 10_000) -> Tokenizer:
    """Build the tokenizer the server ships with the model, from text the server holds."""
    if kind == "word":
        return WordTokenizer.build(sentences, max_size=vocab_size)
    if kind == "sentencepiece":
        return SentencePieceTokenizer.train(sentences, vocab_size=vocab_size)
    raise ValueError(f"unknown tokenizer {kind!r}; choose one of {TOKENIZER_KINDS}")


def tokenizer_from_config(config: Mapping[str, Any]) -> Tokenizer:
    kind = config.get("kind")
    if kind == "word":
        return WordTokenizer(config["words"])
    if kind == "sentencepiece":
        return SentencePieceTokenizer(base64.b64decode(config["model"]))
    raise ValueError(
        f"unknown tokenizer kind {kind!r} in config; expected one of {TOKENIZER_KINDS}"
    )
