"""A base model: the checkpoint a federation starts from (``--init``), as `fedkey pretrain` writes
it from public text. It fixes the model's shape and the vocabulary the phones' text is encoded
with, so neither is chosen again, nor built from the phones' text.

``--init base`` names the base that ships with fedkey (:data:`SHIPPED`, package data built by
``fedkey pretrain --shipped``); any other value is a path.

Its metadata is read without torch (safetensors' header alone, through its numpy reader), so the
settings check ``--init`` as the command line is parsed; the weights are loaded by
fedkey.models.checkpoint.initial_state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedkey.models.config import PRESETS, ModelConfig
from fedkey.models.tokenizers import Tokenizer, tokenizer_from_config

__all__ = [
    "FIXED_BY_BASE",
    "SHIPPED",
    "SHIPPED_NAME",
    "SHIPPED_NGRAM",
    "base_conflicts",
    "base_model_config",
    "base_path",
    "base_tokenizer",
    "ngram_path",
    "header_metadata",
    "read_base",
]

#: `--init base`: the base model that ships with fedkey, and its folder (with its n-gram).
SHIPPED_NAME = "base"
SHIPPED = Path(__file__).resolve().parent / "shipped" / "base.safetensors"
SHIPPED_NGRAM = SHIPPED.with_name("ngram.safetensors")

#: The Settings fields a base model fixes: its shape and its vocabulary.
FIXED_BY_BASE = (
    "model", "hidden_size", "cell", "layers", "tied", "tokenizer", "vocab_size", "tokenizer_text",
)  # fmt: skip


def header_metadata(path: Path) -> dict[str, str]:
    """The safetensors header's metadata of the file at `path` (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(str(e)) from None


def base_path(spec: str | Path) -> Path:
    """The file an --init value names: the shipped base for "base", else the path itself."""
    return SHIPPED if str(spec) == SHIPPED_NAME else Path(spec).expanduser()


def ngram_path(spec: str | Path) -> Path:
    """The file an --ngram value names: the shipped base's n-gram for "base", else the path."""
    return SHIPPED_NGRAM if str(spec) == SHIPPED_NAME else Path(spec).expanduser()


def read_base(path: str | Path) -> dict[str, Any]:
    """The fedkey metadata of the checkpoint at `path` ("base": the shipped one); a ValueError
    in one line when the file is missing, unreadable or not a fedkey checkpoint."""
    p = base_path(path)
    if str(path) == SHIPPED_NAME and not p.is_file():
        raise ValueError(
            "--init base: the shipped base model is missing from this installation "
            "(build it with `fedkey pretrain --shipped`)"
        )
    if not p.is_file():
        raise ValueError(f"--init {path}: no such file (a checkpoint of fedkey pretrain)")
    try:
        meta: dict[str, Any] = json.loads(header_metadata(p)["fedkey"])
        ModelConfig(**meta["model"])
        meta["tokenizer"]["kind"]
    except OSError as e:
        raise ValueError(f"--init {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--init {path}: not a fedkey checkpoint") from None
    return meta


def base_model_config(meta: Mapping[str, Any], dropout: float | None = None) -> ModelConfig:
    """The base's model config; `dropout`, when given, replaces its dropout (training, not shape)."""
    config = dict(meta["model"])
    if dropout is not None:
        config["dropout"] = dropout
    return ModelConfig(**config)


def base_tokenizer(path: str | Path) -> Tokenizer:
    """The vocabulary of the base at `path`, which the phones' text is encoded with."""
    return tokenizer_from_config(read_base(path)["tokenizer"])


def _flag(name: str, value: Any) -> str:
    if name == "tied":
        return "--tied" if value else "--untied"
    return f"--{name.replace('_', '-')} {value}"


def _size_conflict(model: Mapping[str, Any], asked: Mapping[str, Any]) -> str | None:
    """An asked --hidden-size, or else --model preset, whose size is not the base's."""
    if asked.get("hidden_size") is not None:
        size, flag = asked["hidden_size"], f"--hidden-size {asked['hidden_size']}"
    elif "model" in asked:
        size = PRESETS[asked["model"]]
        flag = f"--model {asked['model']} (size {size})"
    else:
        return None
    if size == model["hidden_size"]:
        return None
    return f"{flag} (the base's: --hidden-size {model['hidden_size']})"


def base_conflicts(meta: Mapping[str, Any], asked: Mapping[str, Any]) -> list[str]:
    """The options in `asked` (Settings field -> value given explicitly) that disagree with the
    base `meta`, each as '--flag VALUE (the base's: BASE)'. A --vocab-size may also be the one
    the base was pretrained with: a maximum its vocabulary need not have reached."""
    model = meta["model"]
    base = {
        "cell": model["cell"],
        "layers": model["num_layers"],
        "tied": model["tied"],
        "tokenizer": meta["tokenizer"]["kind"],
        "vocab_size": model["vocab_size"],
    }
    accepted = {name: {value} for name, value in base.items()}
    accepted["vocab_size"].add(meta.get("pretrain", {}).get("vocabulary", {}).get("max_size"))
    problems = [
        f"{_flag(name, asked[name])} (the base's: {_flag(name, value)})"
        for name, value in base.items()
        if name in asked and asked[name] not in accepted[name]
    ]
    size = _size_conflict(model, asked)
    if size is not None:
        problems.insert(0, size)
    if asked.get("tokenizer_text") is not None:
        problems.append("--tokenizer-text (the vocabulary is the base's)")
    return problems
