"""`fedkey vocabulary discover`: the base vocabulary extended with the words many phones type, found
by a differentially private federated count, in simulation.

The base (``--init``) was built from public text; the phones' text (NUS SMS, say) is never read
into the vocabulary except through this count. Each simulated phone (the shards of
fedkey.corpora.partition, as a federation cuts them: ``--partition user`` is one phone per sender)
votes for the at most k out-of-vocabulary words it typed most
(fedkey.federation.heavy_hitters.phone_vote); the server counts the votes with Gaussian noise
and releases the words above the threshold, ``(epsilon, delta)``-DP for each phone
(fedkey.federation.heavy_hitters); the base is extended with them (fedkey.models.vocab_extend)
and written as a new base, which ``--init`` takes as it takes any other. The out-of-vocabulary
rate of the held-out text (the phones' later messages, and the senders never in the federation)
is measured with the base's vocabulary and with the extended one.

The release spends privacy of the same phones a federation then trains on: the two guarantees
compose (the epsilons add, at worst; so do the deltas).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fedkey.common.config import DataConfig
from fedkey.corpora.dataset import load_cut
from fedkey.corpora.loaders import Corpus
from fedkey.corpora.partition import partition
from fedkey.federation.heavy_hitters import Release, discover, phone_vote, plan
from fedkey.models.base import base_path, read_base
from fedkey.models.vocab_extend import extend_base, extend_tokenizer, oov_rate, word_tokenizer

__all__ = [
    "DEFAULT_MAX_WORDS",
    "DiscoverConfig",
    "Discovery",
    "check",
    "discover_vocabulary",
    "phone_votes",
]

#: Words a phone votes for at most (k): chosen on the validation text of NUS SMS
#: (docs/how-to/vocabulary.md has the measurement).
DEFAULT_MAX_WORDS = 10

#: The held-out text the out-of-vocabulary rate is measured on: the phones' later messages
#: (validation, test) and the senders held out of the federation.
SPLITS = {"valid": "valid", "test": "test", "unseen": "unseen_test"}


@dataclass
class DiscoverConfig:
    """Discover on the phones of `data` (its `init`: the base) at `epsilon`, each phone voting
    for at most `max_words` words; `delta` None: 1 / phones^1.1. The extended base goes to `out`."""

    data: DataConfig
    epsilon: float
    out: str | Path
    max_words: int = DEFAULT_MAX_WORDS
    delta: float | None = None
    progress: bool = True


@dataclass
class Discovery:
    """What a discovery released and what it changed: `oov` maps a held-out split to its
    out-of-vocabulary rate (before, after), `sentences` to its size."""

    release: Release
    out: Path
    size_before: int
    oov: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    sentences: dict[str, int] = field(default_factory=dict)


def check(config: DiscoverConfig) -> None:
    """A ValueError, in one line, for what can be refused before the corpus is read."""
    init = config.data.init
    if init is None:
        raise ValueError(
            "--init is required: the base model whose vocabulary to extend (a checkpoint of "
            "fedkey pretrain, or 'base' for the shipped one)"
        )
    word_tokenizer(read_base(init), init)
    if not config.epsilon > 0:
        raise ValueError(f"--epsilon {config.epsilon}: must be > 0 (the privacy budget to spend)")
    if config.delta is not None and not 0 < config.delta < 1:
        raise ValueError(f"--delta {config.delta}: must be in (0, 1)")
    if config.max_words < 1:
        raise ValueError(f"--max-words-per-phone {config.max_words}: must be >= 1")
    out = Path(config.out).expanduser().resolve()
    if out == base_path(init).resolve():
        raise ValueError(f"--out {config.out}: that is the base itself; write a new file")
    plan(config.epsilon, 2, config.max_words, config.delta)  # any other refusal of the numbers


def phone_votes(
    data: DataConfig, corpus: Corpus, vocabulary: Container[str], max_words: int, progress: bool
) -> list[list[str]]:
    """Every phone's vote, the phones cut from `corpus` as a federation cuts them."""
    shards = partition(corpus, data.partition, data.clients, data.seed, alpha=data.alpha)
    return [
        phone_vote((corpus.train[j] for j in shard), vocabulary, max_words)
        for shard in tqdm(shards, desc="phones vote", unit="phone", disable=not progress)
    ]


def discover_vocabulary(config: DiscoverConfig) -> Discovery:
    """Count, release, extend the base, write it to `config.out`, and measure the
    out-of-vocabulary rates before and after."""
    check(config)
    data = config.data
    assert data.init is not None  # check() refused it
    base = word_tokenizer(read_base(data.init), data.init)
    corpus, _ = load_cut(data)
    votes = phone_votes(data, corpus, base.stoi, config.max_words, config.progress)
    released = discover(votes, config.epsilon, config.max_words, config.delta)
    out = extend_base(data.init, config.out, released.added, note(released, data))
    extended = extend_tokenizer(base, released.added)
    result = Discovery(released, out, base.vocab_size)
    for name, attr in SPLITS.items():
        sentences = getattr(corpus, attr) or []
        if sentences:
            result.oov[name] = (oov_rate(base, sentences), oov_rate(extended, sentences))
            result.sentences[name] = len(sentences)
    return result


def note(released: Release, data: DataConfig) -> dict[str, Any]:
    """The extended base's record of this extension (the words are added by extend_base)."""
    p = released.plan
    return {
        "mechanism": "thresholded Gaussian histogram (DP set union)",
        "epsilon": p.epsilon,
        "delta": p.delta,
        "delta_noise": p.delta_noise,
        "delta_threshold": p.delta_threshold,
        "adjacency": "add or remove one phone",
        "phones": p.phones,
        "max_words_per_phone": p.max_words,
        "noise_std": p.sigma,
        "threshold": p.threshold,
        "noisy_counts": dict(released.words),
        "corpus": data.data,
        "partition": data.partition,
    }
