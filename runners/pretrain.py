"""`fedkey pretrain`: the base model a federation starts from (``--init``), trained centrally on
public text only, as production keyboards start from a model of public text and fine-tune it on
the phones.

It is `fedkey train-central` (fedkey.runners.baselines.train_central) on one pool of public text:
the same epochs, progress bar, checkpoints and ``--resume``, in the run directory ``OUT``
(``OUT/checkpoints``, ``OUT/metrics.jsonl``, ``OUT/perplexity.png``). The vocabulary is built from
that public text's training split. The last epoch's model becomes ``OUT/base.safetensors``: a
checkpoint without the run's server memory whose metadata's ``"pretrain"`` object names its
corpora, its vocabulary and its recipe (:func:`base_metadata`). The phones' private corpus
(NUS SMS) and the Chit-Chat senders held out for federating (``chitchat-heldout``) are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.common.files import atomic_write
from fedkey.federation.storage import RunStorage
from fedkey.models.base import header_metadata
from fedkey.models.checkpoint import read_metadata
from fedkey.models.config import ModelConfig
from fedkey.runners.baselines import train_central
from fedkey.runners.source import git

__all__ = [
    "BASE_FILE",
    "NGRAM_FILE",
    "SHIPPED_EPOCHS",
    "SHIPPED_RECIPE",
    "PretrainConfig",
    "base_metadata",
    "check_public",
    "pretrain",
    "ship",
]

#: The base model's file in the run directory, and the n-gram of the same public text beside it.
BASE_FILE = "base.safetensors"
NGRAM_FILE = "ngram.safetensors"
#: The base's Kneser-Ney n-gram (the keyboard mixes it with the model, --ngram): a 3-gram whose
#: trigrams seen once are pruned. On the Chit-Chat pretraining text and its 10k words: 5.1 MB and
#: validation perplexity 87.6, against 15.5 MB and 85.7 unpruned.
NGRAM_ORDER, NGRAM_MIN_COUNT = 3, 2

#: The base that ships with fedkey (`--init base`): `fedkey pretrain --shipped` trains it with these
#: Settings (and SHIPPED_EPOCHS) and writes it, in fp16, to fedkey.models.base.SHIPPED. A GRU of 128
#: units and the 10,000 most frequent words of the Chit-Chat pretraining senders: 1.4M weights, 2.8
#: MB in fp16, small enough to ship in the wheel and to fine-tune on a CPU in the demo; two epochs
#: of its 2.1M words, the second at half the learning rate (docs/how-to/pretrain.md).
SHIPPED_RECIPE: dict[str, Any] = {
    "data": "chitchat",
    "vocab_size": 10_000,
    "hidden_size": 128,
    "batch_size": 32,
    "lr": 1.0,
    "lr_decay": 0.5,
    "max_eval_sentences": 2_000,
}
SHIPPED_EPOCHS = 2

#: What a base is never trained on: the phones' text, and the Chit-Chat senders kept for them.
PRIVATE_CORPORA = ("nus-sms", "chitchat-heldout")


@dataclass
class PretrainConfig:
    """`epochs` passes over the training text of `data` (all of it in one pool) with `train`'s
    SGD, the model `model_config_for(vocab size)`, the run in `out_dir`."""

    data: DataConfig
    train: TrainConfig
    model_config_for: Callable[[int], ModelConfig]
    out_dir: str
    epochs: int
    device: str = "auto"
    resume: bool = False
    lr_decay: float = 1.0
    ksr_sentences: int = 100
    progress: bool = True


def check_public(spec: str) -> None:
    """A ValueError, in one line, for a corpus a base must not learn from: NUS SMS (by name or
    as its directory) or the Chit-Chat senders held out of pretraining."""
    path = Path(spec).expanduser()
    nus_dir = path.is_dir() and any(path.glob("smsCorpus_en_xml_*.zip"))
    if spec.strip() in PRIVATE_CORPORA or nus_dir or path.name.startswith("smsCorpus_en_xml_"):
        raise ValueError(
            f"{spec}: a base model learns from public text only, never the phones' "
            "(NUS SMS) nor the senders held out for them (chitchat-heldout); use chitchat, "
            "ubuntu-irc or a directory of public text"
        )


def pretrain(config: PretrainConfig) -> tuple[list[dict], Path]:
    """Train the base model; -> (one metrics row per epoch, the base checkpoint's path)."""
    data = replace(config.data, clients=1, partition="iid")  # one pool: the whole training text
    if data.tokenizer == "sentencepiece" and data.tokenizer_text is None:
        data = replace(data, tokenizer_text=data.data)  # public text: its own pieces
    for spec in (data.data, data.tokenizer_text):
        if spec is not None:
            check_public(spec)
    config = replace(config, data=data)
    rows = train_central(
        data,
        config.train,
        config.model_config_for,
        config.out_dir,
        config.epochs,
        data.seed,
        config.device,
        config.progress,
        config.ksr_sentences,
        resume=config.resume,
        lr_decay=config.lr_decay,
    )
    run = Path(config.out_dir)
    last = RunStorage(run).checkpoint_path(rows[-1]["round"])
    base = write_base(last, run / BASE_FILE, config)
    write_ngram(base, run / NGRAM_FILE, data)
    return rows, base


def write_ngram(base: Path, out: Path, data: DataConfig) -> Path | None:
    """The Kneser-Ney n-gram of the base's training text, over the base's vocabulary (atomic);
    None for a SentencePiece base (the keyboard's n-gram is over words)."""
    from fedkey.corpora.dataset import load_cut
    from fedkey.models.base import base_tokenizer
    from fedkey.models.ngram import KneserNey
    from fedkey.models.tokenizers import WordTokenizer

    tokenizer = base_tokenizer(base)
    if not isinstance(tokenizer, WordTokenizer):
        return None
    corpus, _ = load_cut(data)
    kn = KneserNey(tokenizer, NGRAM_ORDER)
    kn.fit((tokenizer.encode(s) for s in corpus.train), min_count=NGRAM_MIN_COUNT)
    return kn.save(out, corpus=data.data)


def write_base(checkpoint: Path, out: Path, config: PretrainConfig) -> Path:
    """The run's `checkpoint` as the base `out`: the same weights, model and vocabulary, without
    the run's server memory, with the "pretrain" metadata (atomic)."""
    meta = read_metadata(checkpoint)
    meta.pop("server", None)
    meta.update(round=0, strategy="pretrain", pretrain=base_metadata(meta, config))
    state = st_load(checkpoint.read_bytes())
    return atomic_write(out, st_save(state, metadata={"fedkey": json.dumps(meta)}))


def base_metadata(meta: dict[str, Any], config: PretrainConfig) -> dict[str, Any]:
    """The "pretrain" object of a base: its corpora, its vocabulary and its recipe."""
    data, train = config.data, config.train
    return {
        "corpora": [data.data],
        "vocabulary": {
            "kind": meta["tokenizer"]["kind"],
            "size": meta["model"]["vocab_size"],
            "max_size": data.vocab_size,
            "built_from": data.tokenizer_text or f"the training text of {data.data}",
        },
        "recipe": {
            "epochs": meta["metrics"]["round"],
            "lr": train.lr,
            "lr_decay": config.lr_decay,
            "momentum": train.momentum,
            "clip": train.clip,
            "batch_size": train.batch_size,
            "max_len": train.max_len,
            "precision": train.precision,
            "model": meta["model"],
            "seed": data.seed,
            "max_train_tokens": data.max_train_tokens,
            "fedkey_commit": git("rev-parse", "HEAD") or None,
        },
    }


def ship(base: Path, dest: Path) -> Path:
    """The base checkpoint `base` as the shipped one at `dest`: its weights in fp16 (half the
    bytes; a run loads them back as fp32), its metadata unchanged, and its n-gram beside it
    (atomic, the base last)."""
    meta = header_metadata(base)
    state = {k: v.half() for k, v in st_load(base.read_bytes()).items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest.with_name(NGRAM_FILE), (base.parent / NGRAM_FILE).read_bytes())
    return atomic_write(dest, st_save(state, metadata=meta))
