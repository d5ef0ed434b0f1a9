"""Reading the metadata of an exported keyboard model without torch.

The serving side (the web keyboard, a browser) needs the vocabulary and the model shape of an
ONNX export. Both live in one JSON document, stored twice: beside the model as ``<stem>.json``
(a browser fetches it without parsing ONNX) and inside the model as the ``metadata_props`` key
``"fedkey"``. This module imports only the standard library and, when needed, ``onnx``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedkey.common.config import DP_MECHANISMS, FTRL_MECHANISMS

METADATA_KEY = "fedkey"
FORMAT = "fedkey-onnx-1"


def metadata_path(onnx_path: str | Path) -> Path:
    """`model.onnx` -> `model.json` (the metadata written beside the model)."""
    return Path(onnx_path).with_suffix(".json")


def ngram_path(onnx_path: str | Path) -> Path:
    """`model.onnx` -> `model.ngram.safetensors` (the n-gram an export mixes in, beside it)."""
    return Path(onnx_path).with_suffix(".ngram.safetensors")


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
    word tokenizer {"kind": "word", "words": [...]}), "round", "strategy", "data" (the corpus
    the model learned from, as its metrics row names it: demo, nus-sms, ubuntu-irc or the folder
    or file; None when not recorded), "best_round" (the round best on validation as of this
    round: this round when it is the best so far; None when not recorded), "metrics"
    ({"val_ppl", "test_ppl"} when the checkpoint had them), "privacy" (:func:`privacy_facts`;
    absent from exports made before it existed), "int8", "inputs", "outputs" and "export" (file
    sizes and held-out numbers measured at export time), "ngram" (present when the export mixes
    in an n-gram, fedkey.export.mixture.ngram_entry: {"file" (beside the model), "sha256",
    "bytes", "weight" (the model's share of the mixture), "weight_source", "order", "corpus",
    "min_count"}) and "personal" (the personal cache's parameters, fedkey.models.personal.
    DEFAULTS: {"max_weight", "ramp", "beta"}). "data", "best_round" and "personal" are absent
    from exports made before they existed.
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


# The bounding facts a keyboard may show, from the metrics row's info["clip"]: scalars only
# (never per-device numbers). weight_cap is in samples (the cap on a phone's n_k).
CLIP_KEYS = (
    "mode",
    "scope",
    "norm",
    "multiple",
    "clipped",
    "clipped_fraction",
    "median_norm",
    "max_norm",
    "weight_cap",
    "capped_weights",
    "trimmed",
)
# Under DP only the bound itself: the counts and norms above are exact functions of the phones'
# updates that the DP guarantee does not cover (fedkey.federation.metrics_row.public_info, which keeps them
# out of a DP row; an export of an older checkpoint may still hold them).
DP_CLIP_KEYS = ("mode", "scope", "norm")


def _number(x: Any) -> float | None:
    """A finite JSON number, else None (bools and strings are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return x


def privacy_facts(checkpoint_meta: Mapping[str, Any]) -> dict[str, Any]:
    """What an export tells its users about privacy and bounded influence, from a checkpoint's
    metadata (fedkey.models.checkpoint: "strategy", "metrics" = the round's metrics row, "server" = the
    server state with the accountant's state_dict). Only public facts: the accountant's settings
    and step count, and the round's clip summary; no per-device scores.

    Keys:
      dp: True (DP noise was added: an accountant or a recorded epsilon), False (the row
        records ``"epsilon": null``: no differential privacy), None (not recorded: a checkpoint
        written without a metrics row).
      epsilon: the epsilon spent so far at ``delta`` (a number; the string "inf" when the bound
        is infinite, e.g. noise multiplier 0; None without DP).
      rho: the privacy spent so far as rho-zCDP, from the row (a number, "inf", or None).
      mechanism: "gaussian" (DP-FedAvg), "tree" or "blt" (DP-FTRL), from the row's
        ``info["dp"]`` or the accountant's state; None without DP or when not recorded.
        min_separation: DP-FTRL's b (a phone's participations at least b rounds apart), else
        None.
      delta, target_epsilon (the budget; None: no budget set), noise_multiplier, sampling
        ("fixed": a fixed-size cohort per round, "poisson"), sampling_rate (Poisson's q; None
        under fixed-size sampling), steps (noised rounds accounted): the accountant's state
        (fedkey.federation.privacy.gaussian.PrivacyAccountant.state_dict), None when not recorded; delta from the
        row's "delta" when the accountant is not in the checkpoint.
      adaptive_clip: under ``--dp-clip-quantile``, {"quantile", "clip" (the round's clip),
        "unclipped_fraction_noisy"} from ``info["dp"]``; else None.
      clip: the round's bounding summary from the metrics row's ``info["clip"]`` (mode, norm S,
        clipped count, weight cap, ...; CLIP_KEYS) with "updates" (``info["num_updates"]``) and
        "attention_cap" (``info["attention_cap"]``) when the row has them; None when the row
        has no ``info["clip"]``. Under DP only mode, scope and norm (DP_CLIP_KEYS), and the
        cohort's size only where it is public (not under Poisson sampling): never an exact
        count of clipped updates or a norm, even from an older checkpoint's row.
      dp_clip: the DP-FedAvg clip as rows without ``info["clip"]`` reported it (``info``:
        clip_norm as "norm", noise_std; their exact clipped_fraction is not shown), else None.
    """
    metrics = checkpoint_meta.get("metrics") or {}
    server = checkpoint_meta.get("server") or {}
    raw_accountant = server.get("accountant") if isinstance(server, Mapping) else None
    accountant: Mapping[str, Any] = raw_accountant if isinstance(raw_accountant, Mapping) else {}
    raw_info = metrics.get("info")
    info: Mapping[str, Any] = raw_info if isinstance(raw_info, Mapping) else {}
    raw_eps = metrics.get("epsilon")
    if accountant or raw_eps is not None:
        dp: bool | None = True
    elif "epsilon" in metrics:
        dp = False
    else:
        dp = None
    epsilon: float | str | None = None
    if isinstance(raw_eps, (int, float)) and not isinstance(raw_eps, bool):
        epsilon = "inf" if math.isinf(raw_eps) else _number(raw_eps)
    steps = accountant.get("steps")
    events = accountant.get("events")  # [[population or q, cohort, rounds], ...]
    if steps is None and isinstance(events, list):
        counts = [e[-1] for e in events if isinstance(e, list) and e]
        steps = sum(counts) if all(_is_int(c) for c in counts) else None
    sampling = accountant.get("sampling")
    sampling = sampling if sampling in ("fixed", "poisson") else None
    raw_dp = info.get("dp")
    dp_info: Mapping[str, Any] = raw_dp if isinstance(raw_dp, Mapping) else {}
    raw_clip = info.get("clip")
    clip: dict[str, Any] | None = None
    if isinstance(raw_clip, Mapping):
        keys = DP_CLIP_KEYS if dp else CLIP_KEYS
        clip = {k: raw_clip[k] for k in keys if k in raw_clip and _scalar(raw_clip[k])}
        poisson = "poisson" in (sampling, dp_info.get("sampling"))
        if not (dp and poisson):  # Poisson's cohort size is private
            for key, source in (("updates", "num_updates"), ("attention_cap", "attention_cap")):
                if _number(info.get(source)) is not None:
                    clip[key] = info[source]
    mechanism = dp_info.get("mechanism") or accountant.get("mechanism")
    if mechanism not in DP_MECHANISMS:
        mechanism = "gaussian" if accountant else None
    separation = dp_info.get("min_separation", accountant.get("min_separation"))
    adaptive = None
    if _number(dp_info.get("clip_quantile")) is not None:
        adaptive = {
            k: _number(dp_info.get(k))
            for k in ("clip_quantile", "clip", "unclipped_fraction_noisy")
        }
        adaptive["quantile"] = adaptive.pop("clip_quantile")
    raw_rho = metrics.get("rho")
    rho: float | str | None = None
    if isinstance(raw_rho, (int, float)) and not isinstance(raw_rho, bool):
        rho = "inf" if math.isinf(raw_rho) else _number(raw_rho)
    dp_clip = None
    if dp and clip is None and _number(info.get("clip_norm")) is not None:
        dp_clip = {
            "norm": _number(info.get("clip_norm")),
            "noise_std": _number(info.get("noise_std")),
        }
    return {
        "dp": dp,
        "epsilon": epsilon,
        "rho": rho,
        "mechanism": mechanism if dp else None,
        "min_separation": separation
        if dp and mechanism in FTRL_MECHANISMS and _is_int(separation)
        else None,
        "delta": _number(accountant.get("delta")) or _number(metrics.get("delta")),
        "target_epsilon": _number(accountant.get("target_epsilon")),
        "noise_multiplier": _number(accountant.get("noise_multiplier")),
        "sampling": sampling,
        "sampling_rate": None if sampling == "fixed" else _number(accountant.get("sampling_rate")),
        "steps": steps if _is_int(steps) else None,
        "clip": clip,
        "dp_clip": dp_clip,
        "adaptive_clip": adaptive,
    }


def _scalar(x: Any) -> bool:
    return isinstance(x, str) or x is None or _number(x) is not None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
