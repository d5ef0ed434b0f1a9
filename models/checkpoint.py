"""Checkpoint format: one safetensors file whose header metadata carries a JSON config.

The config ("fedkey" metadata key) holds the model config, the tokenizer, the round and the
strategy, so a checkpoint alone rebuilds the model and its vocabulary. One file means one atomic
rename when the server writes it. Read the config with `safetensors.safe_open(p, "pt").metadata()`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.common.files import atomic_write
from fedkey.models.base import base_path
from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel
from fedkey.models.tokenizers import Tokenizer, tokenizer_from_config

FORMAT_VERSION = 1

#: What the JSON object under the "fedkey" metadata key holds, key -> meaning (the checkpoint
#: reference, docs/reference/checkpoint.md, is generated from it). checkpoint_bytes writes the
#: first five; the round engine (fedkey.federation.engine) adds "metrics" and "server" through `extra`,
#: fedkey.runners.pretrain "pretrain" to a base model.
METADATA: dict[str, str] = {
    "format": f"The format's version ({FORMAT_VERSION}).",
    "model": "The model config (fedkey.models.config.ModelConfig): vocab_size, cell, emb_size, "
    "hidden_size, num_layers, tied, dropout.",
    "tokenizer": 'The tokenizer, so the checkpoint alone rebuilds it: {"kind": "word", "words": '
    '[the vocabulary, by id]} or {"kind": "sentencepiece", "model": the model, base64}.',
    "round": "The round whose global model this is (0: the initial model).",
    "strategy": "The aggregation method (or the run's label) that produced it.",
    "metrics": "The round's metrics row, as in metrics.jsonl.",
    "server": "The server's memory for a restart: the strategy's per-phone scores and sample "
    "counts, the privacy accountant, the best round so far. Only in the run's own files: the "
    "model served by GET /v1/model leaves it out.",
    "pretrain": "A base model's only (fedkey pretrain, the --init of a federation): its corpora, "
    "its vocabulary (kind, size, the --vocab-size asked, the public text it was built from) and "
    "its recipe (epochs, lr, lr_decay, momentum, clip, batch_size, max_len, precision, model, "
    "seed, max_train_tokens, fedkey_commit).",
    "vocabulary": "An extended base's only (fedkey vocabulary discover): one note per extension, "
    "oldest first: the words added (at the end of the word list), the vocabulary size before, "
    "the DP count's epsilon, delta, phones, max_words_per_phone, noise_std, threshold and "
    "noisy_counts (fedkey.models.vocab_extend).",
}

#: The METADATA keys only a base model holds, never a run's own checkpoints.
BASE_ONLY = ("pretrain", "vocabulary")


class CheckpointError(ValueError):
    """A checkpoint or an uploaded state does not match the model it claims to be."""


def model_state(model: LanguageModel) -> dict[str, torch.Tensor]:
    """The model's tensors as federated: a tied decoder weight is the embedding, sent once."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tied:
        state.pop("decoder.weight", None)
    return state


def expected_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor a model with `config` federates (checked for every
    upload and every phone trained: worked out once per config and process)."""
    return dict(_expected(tuple(asdict(config).items())))


@functools.lru_cache(maxsize=16)
def _expected(
    key: tuple[tuple[str, Any], ...],
) -> tuple[tuple[str, tuple[tuple[int, ...], torch.dtype]], ...]:
    # A model on the CPU, its initialization drawn from a forked generator (torch's global one
    # seeds the runs): on the meta device building a GRU imports torch._dynamo, 3 s a process.
    with torch.random.fork_rng(devices=[]):
        model = LanguageModel(ModelConfig(**dict(key)))
    return tuple((k, (tuple(v.shape), v.dtype)) for k, v in model_state(model).items())


def check_state(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Raise CheckpointError naming the first tensor whose name, shape or dtype is wrong."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"tensor names do not match the model config: missing {missing}, unexpected {extra}"
        )
    for name, (shape, dtype) in expected.items():
        t = state[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(
                f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, the config expects {dtype} {shape}"
            )


def load_model_state(model: LanguageModel, state: dict[str, torch.Tensor]) -> None:
    check_state(state, model.config)
    model.load_state_dict(state, strict=False)  # decoder.weight of a tied model is the embedding


def build_model(config: ModelConfig, state: dict[str, torch.Tensor] | None = None) -> LanguageModel:
    model = LanguageModel(config)
    if state is not None:
        load_model_state(model, state)
    return model


def initial_state(config: ModelConfig, init: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The weights a run starts from: a fresh model's (seeded by the caller's torch.manual_seed),
    or those of the base checkpoint `init` (fedkey.models.base), checked against `config`."""
    fresh = model_state(build_model(config))
    if init is None:
        return fresh
    # A shipped base is stored in fp16 (fedkey pretrain --shipped); a run's weights are fp32.
    state = {k: v.float() for k, v in st_load(base_path(init).read_bytes()).items()}
    try:
        check_state(state, config)
    except CheckpointError as e:
        raise CheckpointError(f"{init}: {e}") from None
    return {k: state[k] for k in fresh}  # the model's key order, as a fresh run holds it


def save_checkpoint(
    path: str | Path,
    state: dict[str, torch.Tensor],
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    *,
    round_idx: int,
    strategy: str,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write atomically (fedkey.common.files): a crash never leaves a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = checkpoint_bytes(
        state, model_config, tokenizer, round_idx=round_idx, strategy=strategy, extra=extra
    )
    return atomic_write(path, data, mode=0o600)  # holds the server's private memory: owner only


def checkpoint_bytes(
    state: dict[str, torch.Tensor],
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    *,
    round_idx: int,
    strategy: str,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """A checkpoint file's bytes (:func:`save_checkpoint` writes them): the tensors and the
    metadata (format, model and tokenizer config, round, strategy, then ``extra``)."""
    meta = {
        "format": FORMAT_VERSION,
        "model": model_config.to_dict(),
        "tokenizer": tokenizer.to_config(),
        "round": round_idx,
        "strategy": strategy,
        **(extra or {}),
    }
    return st_save(
        {k: v.contiguous() for k, v in state.items()}, metadata={"fedkey": json.dumps(meta)}
    )


def public_bytes(
    path: str | Path, metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> bytes:
    """The checkpoint as served to devices: without the server's private memory (the strategy's
    per-device scores and sample counts, the accountant), which only a restarted server needs;
    `metrics`, when given, maps its metrics row to the row devices may see."""
    meta = read_metadata(path)
    meta.pop("server", None)
    if metrics is not None and "metrics" in meta:
        meta["metrics"] = metrics(meta["metrics"])
    state = st_load(Path(path).read_bytes())
    return st_save(state, metadata={"fedkey": json.dumps(meta)})


def read_metadata(path: str | Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "fedkey" not in meta:
        raise CheckpointError(f"{path} is not a fedkey checkpoint (no 'fedkey' metadata)")
    config: dict[str, Any] = json.loads(meta["fedkey"])
    return config


def load_checkpoint(path: str | Path) -> tuple[LanguageModel, Tokenizer, dict[str, Any]]:
    """-> (model, tokenizer, metadata). Fails with CheckpointError if tensors and config disagree."""
    meta = read_metadata(path)
    config = ModelConfig(**meta["model"])
    state = st_load(Path(path).read_bytes())
    try:
        check_state(state, config)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return build_model(config, state), tokenizer_from_config(meta["tokenizer"]), meta
