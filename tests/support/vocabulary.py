"""A small public base and a small phones' corpus with their own slang, for the tests of
`fedkey vocabulary discover` (fedkey.runners.vocabulary): the base is written directly (no
training: the vocabulary is what matters), the corpus is a jsonl of users."""

from __future__ import annotations

import json
import random
from pathlib import Path

#: The public text the base's vocabulary is built from.
PUBLIC = "i am at home see you later ok , ? where are we going now the movie was good".split()
#: What most phones type that the public text lacks; what one phone alone types.
SLANG, SECRET = ("lor", "tmr"), "zyxsecretname"


def write_base(path: Path, kind: str = "word") -> Path:
    """A tiny GRU base of the public words ("sentencepiece": of their pieces), untrained."""
    import torch

    from fedkey.models.checkpoint import build_model, save_checkpoint
    from fedkey.models.config import ModelConfig
    from fedkey.models.tokenizers import SentencePieceTokenizer, WordTokenizer

    torch.manual_seed(0)
    text = [" ".join(PUBLIC)]
    tok = (
        WordTokenizer.build(text, max_size=None)
        if kind == "word"
        else SentencePieceTokenizer.train(text * 50, vocab_size=40)
    )
    config = ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8)
    state = build_model(config).state_dict()
    state.pop("decoder.weight")  # tied
    meta = {"pretrain": {"corpora": ["public"], "vocabulary": {"max_size": 100}}}
    return save_checkpoint(path, state, config, tok, round_idx=0, strategy="pretrain", extra=meta)


def phones_corpus(path: Path, users: int = 40, messages: int = 12) -> Path:
    """A jsonl corpus: users 0..29 type the slang in every message, user 30 alone its secret
    name, every message otherwise public words."""
    rng = random.Random(0)
    lines = []
    for u in range(users):
        for _ in range(messages):
            words = rng.sample(PUBLIC[:12], 4)
            if u < 30:
                words += list(SLANG)
            if u == 30:
                words.append(SECRET)
            lines.append(json.dumps({"user": f"u{u:02d}", "text": " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")
    return path
