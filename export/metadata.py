"""Reading the metadata of an exported keyboard model without torch.

The serving side (the web keyboard, a browser) needs the vocabulary and the model shape of an
ONNX export. Both live in one JSON document, stored twice: beside the model as ``<stem>.json``
(a browser fetches it without parsing ONNX) and inside the model as the ``metadata_props`` key
``"fedkey"``. This module imports only the standard library and, when needed, ``onnx``.
"""

from __future__ import annotations

import json
from pathlib import Path

METADATA_KEY = "fedkey"
FORMAT = "fedkey-onnx-1"


def metadata_path(onnx_path: str | Path) -> Path:
    """`model.onnx` -> `model.json` (the metadata written beside the model)."""
    return Path(onnx_path).with_suffix(".json")


def read_embedded_metadata(onnx_path: str | Path) -> dict:
    """The JSON stored in the ONNX model's metadata_props (key "fedkey"); parses the file."""
    import onnx  # imported here: reading the .json beside needs no onnx at all

    model = onnx.load(str(onnx_path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            return json.loads(prop.value)
    raise ValueError(f"{onnx_path} has no {METADATA_KEY!r} metadata: not a fedkey ONNX export")


def load_metadata(onnx_path: str | Path) -> dict:
    """The export's metadata: from `<stem>.json` beside the model, else from its metadata_props.

    Keys: "format" ("fedkey-onnx-1"), "model" (the ModelConfig dict: vocab_size, cell,
    emb_size, hidden_size, num_layers, tied, dropout), "tokenizer" (as in the checkpoint: for a
    word tokenizer {"kind": "word", "words": [...]}), "round", "strategy", "metrics"
    ({"val_ppl", "test_ppl"} when the checkpoint had them), "int8", "inputs", "outputs" and
    "export" (file sizes and held-out numbers measured at export time).
    """
    side = metadata_path(onnx_path)
    if side.exists():
        meta = json.loads(side.read_text(encoding="utf-8"))
    else:
        meta = read_embedded_metadata(onnx_path)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{onnx_path}: metadata format {meta.get('format')!r}, expected {FORMAT!r}"
        )
    return meta
