"""What the federation is trained on: the corpus, the server's tokenizer, the phones' shards.

The server and the phones see different parts of it: the server holds the public text it builds
the tokenizer from and the held-out text it evaluates on (`server_data`); each simulated phone
holds only its own private shard (`device_shards`), encoded with the tokenizer the server ships
inside the model. Both cut and partition the corpus the same seeded way, so the in-process
simulation and the HTTP fleet train on identical shards.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from fedkey.common.config import DataConfig
from fedkey.corpora.loaders import Corpus, load_corpus
from fedkey.corpora.partition import by_user, partition
from fedkey.models.base import base_tokenizer
from fedkey.models.canary import check_vocabulary
from fedkey.models.tokenizers import Tokenizer, build_tokenizer


@dataclass
class PreparedData:
    corpus: Corpus
    tokenizer: Tokenizer
    shards: dict[str, list[list[int]]]  # device id -> encoded private sentences


def cut_tokens(sentences: list[str], max_tokens: int | None) -> int:
    """How many leading sentences hold at most max_tokens words."""
    if max_tokens is None:
        return len(sentences)
    total = 0
    for i, s in enumerate(sentences):
        total += len(s.split()) + 1
        if total > max_tokens:
            return i
    return len(sentences)


def tokenizer_text(cfg: DataConfig, corpus: Corpus) -> list[str]:
    """The text the server builds its tokenizer from.

    Word vocabulary: the benchmark protocol (the seed papers build it from all three splits,
    the usual PTB/WikiText protocol from the training split). SentencePiece is never trained on
    the phones' data: on `tokenizer_text` when given, and for the demo on a fresh draw of the demo
    generator (same owners and styles, other messages), which stands for public text the server
    holds.
    """
    if cfg.tokenizer == "word":
        return corpus.train + corpus.valid + corpus.test if cfg.paper_protocol else corpus.train
    if cfg.tokenizer_text:
        path = Path(cfg.tokenizer_text)
        if path.is_file() and path.suffix == ".txt":
            return [line.strip() for line in path.read_text().splitlines() if line.strip()]
        public = load_corpus(cfg.tokenizer_text, paper_protocol=cfg.paper_protocol, seed=cfg.seed)
        return public.train + public.valid + public.test
    if cfg.data == "demo":
        return load_corpus("demo", seed=cfg.seed + 1_000_003).train
    raise ValueError(
        "a SentencePiece tokenizer is trained on public text the server holds, never on the phones' "
        "data: pass --tokenizer-text (a .txt file or a corpus directory, e.g. WikiText-2 for PTB)"
    )


def load_cut(cfg: DataConfig) -> tuple[Corpus, list[str]]:
    """-> (the corpus cut to the configured sizes, the text the server's tokenizer is built from:
    none from a base checkpoint's, `cfg.init`)."""
    corpus = load_corpus(cfg.data, paper_protocol=cfg.paper_protocol, seed=cfg.seed)
    vocab_text = tokenizer_text(cfg, corpus) if cfg.init is None else []
    n = cut_tokens(corpus.train, cfg.max_train_tokens)
    train_users = corpus.train_users[:n] if corpus.train_users else None
    valid, valid_users = _phones_only(cfg, train_users, corpus.valid, corpus.valid_users)
    test, test_users = _phones_only(cfg, train_users, corpus.test, corpus.test_users)
    m = cfg.max_eval_sentences

    def first(items: list[str] | None) -> list[str] | None:
        return items[:m] if m and items is not None else items

    cut = Corpus(
        name=corpus.name,
        train=corpus.train[:n],
        valid=valid[:m] if m else valid,
        test=test[:m] if m else test,
        train_users=train_users,
        train_articles=corpus.train_articles[:n] if corpus.train_articles else None,
        unseen_test=first(corpus.unseen_test),
        unseen_users=first(corpus.unseen_users),
        valid_users=first(valid_users),
        test_users=first(test_users),
    )
    return cut, vocab_text


def _phones_only(
    cfg: DataConfig, train_users: list[str] | None, items: list[str], users: list[str] | None
) -> tuple[list[str], list[str] | None]:
    """The held-out `items` of the senders who have a phone: with ``--partition user``, the
    owners :func:`fedkey.corpora.partition.by_user` makes phones (``--clients K``: the K with the most
    training messages); unchanged where the corpus does not know whose each item is, or for
    another partition (every training sender then trains somewhere)."""
    if cfg.partition != "user" or users is None or train_users is None:
        return items, users
    shards = by_user(train_users, cfg.clients, cfg.seed)
    phones = {train_users[shard[0]] for shard in shards}
    keep = [i for i, u in enumerate(users) if u in phones]
    return [items[i] for i in keep], [users[i] for i in keep]


def server_data(cfg: DataConfig) -> tuple[Corpus, Tokenizer]:
    """The server's side: the (cut) corpus for evaluation and the tokenizer it ships, the base
    checkpoint's with `cfg.init` (public text's, never built from the phones')."""
    corpus, vocab_text = load_cut(cfg)
    if cfg.init is not None:
        return corpus, base_tokenizer(cfg.init)
    return corpus, build_tokenizer(cfg.tokenizer, vocab_text, cfg.vocab_size)


def device_name(index: int, count: int) -> str:
    return f"device-{index:0{len(str(count - 1))}d}"


def device_shards(
    cfg: DataConfig, tokenizer: Tokenizer, corpus: Corpus | None = None
) -> dict[str, list[list[int]]]:
    """The phones' side: device name -> its private training sentences, encoded."""
    if corpus is None:
        corpus, _ = load_cut(cfg)
    parts = partition(corpus, cfg.partition, cfg.clients, cfg.seed, alpha=cfg.alpha)
    shards = {
        device_name(i, len(parts)): [tokenizer.encode(corpus.train[j]) for j in idx]
        for i, idx in enumerate(parts)
    }
    if cfg.canary is not None and cfg.canary_repeats > 0:
        plant_canary(shards, cfg.canary, cfg.canary_repeats, tokenizer, cfg.seed)
    return shards


def plant_canary(
    shards: dict[str, list[list[int]]],
    canary: str,
    repeats: int,
    tokenizer: Tokenizer,
    seed: int,
) -> str:
    """Put `repeats` copies of the sentence `canary` at seeded random places of the first phone's
    shard (a memorization audit, fedkey.models.exposure); -> that phone's name.

    Only the phone's encoded shard changes: the tokenizer was built before (the same vocabulary
    with and without a canary, so runs compare), and valid/test never hold it. Its words must be
    in the vocabulary: as <unk> it would not be the secret the audit ranks.
    """
    check_vocabulary(tokenizer, canary.split(), f"the canary {canary!r}")
    first = next(iter(shards))
    shard, ids = shards[first], tokenizer.encode(canary)
    rng = random.Random(f"fedkey-canary-places-{seed}")
    for _ in range(repeats):
        shard.insert(rng.randint(0, len(shard)), list(ids))
    return first


def prepare(cfg: DataConfig) -> PreparedData:
    """Both sides at once, for the in-process simulation."""
    corpus, tokenizer = server_data(cfg)
    return PreparedData(corpus, tokenizer, device_shards(cfg, tokenizer, corpus))
