"""The plain configs both the server and the phones read: how a phone trains (`TrainConfig`, sent
inside every round task) and what the federation is trained on (`DataConfig`). Standard library
only, so the command line can build them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

#: "sentences": language modelling. "columns": the batches the seed papers' published code really
#: trained on (token j of each sentence of a batch, fedkey.models.batching.column_batches), to reproduce
#: their numbers.
Batching = Literal["sentences", "columns"]
BATCHINGS: tuple[Batching, ...] = get_args(Batching)

#: The arithmetic of the trainer's and the evaluator's forward pass (fedkey.models.precision resolves it):
#: "bf16": mixed precision, the forward under bfloat16 autocast with fp32 master weights, the loss
#: and the gradients in fp32; "fp32": plain float32; "auto": bf16 where the hardware does bf16
#: natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32.
Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

#: The server's tokenizer (fedkey.models.tokenizers builds it; TOKENIZER_KINDS there lists these).
TokenizerKind = Literal["word", "sentencepiece"]
#: How the training text is cut into the phones' shards (fedkey.corpora.partition does it).
Scheme = Literal["iid", "user", "dirichlet", "articles"]
#: How the server adds DP noise (fedkey.federation.privacy.gaussian, fedkey.federation.privacy.tree, fedkey.federation.privacy.blt): independent
#: Gaussian noise each round on a sampled cohort (DP-FedAvg), or DP-FTRL's noise on the running
#: sum of the rounds' aggregates, correlated across rounds by tree aggregation or by a BLT matrix
#: factorization, with no sampling, only a minimum separation between one phone's participations.
#: Here, below the server, so that an export's privacy facts (fedkey.export.metadata) name the same ones.
DPMechanism = Literal["gaussian", "tree", "blt"]
DP_MECHANISMS: tuple[DPMechanism, ...] = get_args(DPMechanism)
#: The DP-FTRL mechanisms: no sampling, the minimum-separation rule (--dp-min-separation).
FTRL_MECHANISMS: tuple[DPMechanism, ...] = ("tree", "blt")


@dataclass
class TrainConfig:
    """Local training on a phone: SGD with momentum over its private sentences. What each field
    means: the description of the Settings field that sets it (fedkey.server.settings)."""

    epochs: int = 5
    batch_size: int = 10  # sentences per batch, as in the seed papers
    lr: float = 1.0  # the seed papers' 0.01 learns far slower (experiments/results/README.md)
    momentum: float = 0.5
    clip: float = 5.0
    max_len: int = 80
    batching: Batching = "sentences"
    precision: Precision = "auto"

    def __post_init__(self) -> None:
        if self.batching not in BATCHINGS:
            raise ValueError(f"unknown batching {self.batching!r}; choose one of {BATCHINGS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {PRECISIONS}")


@dataclass
class DataConfig:
    """The corpus, the server's tokenizer and how it is cut into the phones' shards (the fields
    Settings has too are described there, fedkey.server.settings)."""

    data: str = "demo"  # "demo" or a directory (see fedkey.corpora.loaders.load_corpus)
    paper_protocol: bool = False
    tokenizer: TokenizerKind = "word"
    vocab_size: int = 10_000
    clients: int = 100
    partition: Scheme = "iid"
    alpha: float = 0.5  # Dirichlet concentration
    max_train_tokens: int | None = None
    max_eval_sentences: int | None = None
    seed: int = 0
    tokenizer_text: str | None = None
    # A base checkpoint (fedkey.models.base): its vocabulary encodes the text, none is built.
    init: str | None = None
    # A memorization audit (fedkey.models.canary): `canary_repeats` copies of the sentence `canary` go
    # into the first phone's training shard, never into valid/test or the tokenizer's text.
    canary: str | None = None
    canary_repeats: int = 0
