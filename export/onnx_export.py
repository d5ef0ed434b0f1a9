"""Export a fedkey checkpoint to ONNX for the web keyboard, optionally int8-quantized.

The graph (names and shapes are the keyboard's contract, see docs/how-to/keyboard.md):

    inputs   tokens   int64   [batch, time]
             h0       float32 [layers, batch, hidden]
             c0       float32 [layers, batch, hidden]      (LSTM only)
    outputs  logprobs float32 [batch, time, vocab]          log_softmax inside the graph
             hn       float32 [layers, batch, hidden]
             cn       float32 [layers, batch, hidden]      (LSTM only)

Batch and time are dynamic; a suggestion is one step (time = 1) fed with the previous state.

Choices:
- The TorchScript exporter (``torch.onnx.export(dynamo=False)``): it emits one ONNX GRU/LSTM node
  per layer (GRU with linear_before_reset = 1, which is PyTorch's GRU) and is measured correct
  here; every export is checked against PyTorch anyway (`check_parity`), and a failed check
  raises `ExportParityError` before any file is written.
- A tied model: the exporter folds the decoder's transpose into a second [hidden, vocab] copy of
  the embedding. `share_tied_weight` rewrites the graph so that one [hidden, vocab] initializer
  feeds both the output MatMul and the embedding lookup (a Gather along axis 1 and a small
  transpose of the looked-up vectors), so the file holds the matrix once. Dynamic int8
  quantization then quantizes that one shared initializer once (per tensor) and both the Gather
  and the MatMul use the same int8 tensor, which the tests check.
- int8: ``onnxruntime.quantization.quantize_dynamic`` with int8 weights, per tensor, on MatMul,
  Gather and LSTM (what it supports; a GRU stays fp32). The held-out perplexity of fp32 and int8
  is computed with onnxruntime, with the definition of fedkey.models.metrics.evaluate.
- Files are written atomically (fedkey.common.files): the .onnx first, then the n-gram it mixes
  in (`<stem>.ngram.safetensors`, with `ngram`), then the .json beside them, so a watcher that
  sees a new .json finds a complete .onnx and n-gram.
- With `ngram`, the metadata's "ngram" names the n-gram file and the mixture weight
  (fedkey.export.mixture); "personal" always holds the personal cache's parameters
  (fedkey.models.personal.DEFAULTS), which the keyboard reads.
"""

from __future__ import annotations

import io
import json
import logging
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper
from torch import Tensor, nn

from fedkey.common.files import atomic_write as _atomic_write  # a module name the tests can patch
from fedkey.export.metadata import FORMAT, METADATA_KEY, metadata_path, ngram_path, privacy_facts
from fedkey.export.mixture import mixture_weight, ngram_entry, read_ngram, target_probs
from fedkey.models.checkpoint import load_checkpoint
from fedkey.models.model import LanguageModel
from fedkey.models.personal import DEFAULTS as PERSONAL_DEFAULTS
from fedkey.models.tokenizers import Tokenizer

PARITY_TOLERANCE = 1e-4
INT8_OP_TYPES = ("MatMul", "Gather", "LSTM")  # what quantize_dynamic covers here (not GRU)


class ExportParityError(RuntimeError):
    """onnxruntime and PyTorch disagree on the exported model: nothing was written."""


@dataclass
class ExportReport:
    path: Path
    json_path: Path
    bytes: int  # size of the written .onnx
    parity_max_abs_diff: float  # fp32 onnxruntime vs PyTorch, over log-probs and states
    int8: bool
    fp32_bytes: int  # size of the fp32 model (the written file when int8 is False)
    held_out_ppl_fp32: float | None  # onnxruntime, on parity_text (None without it)
    held_out_ppl_int8: float | None
    top1_agreement: float | None  # int8 vs fp32 top suggestion on held-out prefixes
    seconds: float
    ngram: dict | None = None  # the metadata's "ngram" (fedkey.export.mixture.ngram_entry)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"], d["json_path"] = str(self.path), str(self.json_path)
        return d


def io_names(cell: str) -> tuple[list[str], list[str]]:
    if cell == "lstm":
        return ["tokens", "h0", "c0"], ["logprobs", "hn", "cn"]
    return ["tokens", "h0"], ["logprobs", "hn"]


class _Exported(nn.Module):
    """LanguageModel with the ONNX signature: flat state tensors, log-probs out."""

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, h0: Tensor, c0: Tensor | None = None):
        state = h0 if c0 is None else (h0, c0)
        logits, state = self.model(tokens, state)
        logprobs = torch.log_softmax(logits, dim=-1)
        if c0 is None:
            return logprobs, state
        return logprobs, state[0], state[1]


def _example_inputs(model: LanguageModel, batch: int = 2, time_: int = 3) -> tuple[Tensor, ...]:
    c = model.config
    tokens = torch.zeros(batch, time_, dtype=torch.long)
    h = torch.zeros(c.num_layers, batch, c.hidden_size)
    return (tokens, h) if c.cell == "gru" else (tokens, h, h.clone())


def _to_onnx(model: LanguageModel, opset: int = 17) -> onnx.ModelProto:
    """The fp32 graph of `model` (TorchScript exporter; dynamic batch and time)."""
    model.eval()
    inputs, outputs = io_names(model.config.cell)
    dynamic = {"tokens": {0: "batch", 1: "time"}, "logprobs": {0: "batch", 1: "time"}}
    for name in inputs[1:] + outputs[1:]:
        dynamic[name] = {1: "batch"}
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # deprecation of dynamo=False, RNN batch_first notes
        torch.onnx.export(
            _Exported(model),
            _example_inputs(model),
            buf,  # type: ignore[arg-type]  # the TorchScript exporter writes file objects too
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    proto = onnx.load_from_string(buf.getvalue())
    if model.config.tied:
        share_tied_weight(proto)
    onnx.checker.check_model(proto)
    return proto


def share_tied_weight(proto: onnx.ModelProto) -> bool:
    """Store a tied embedding once: Gather(E [V,H]) + MatMul(E^T [H,V]) -> both read E^T.

    The embedding lookup becomes Gather(E^T, tokens, axis=1) -> [H, B, T] followed by a
    Transpose to [B, T, H]. Returns False (graph unchanged) if the pattern is not found.
    """
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    matmuls = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    if len(gathers) != 1 or len(matmuls) != 1:
        return False
    gather, matmul = gathers[0], matmuls[0]
    emb = numpy_helper.to_array(inits[gather.input[0]])
    dec_t = numpy_helper.to_array(inits[matmul.input[1]])
    if emb.shape[::-1] != dec_t.shape or not np.array_equal(emb.T, dec_t):
        return False  # untied after all
    if any(gather.input[0] in n.input for n in graph.node if n is not gather):
        return False
    looked_up = gather.output[0] + "_hbt"
    new_gather = helper.make_node(
        "Gather", [matmul.input[1], gather.input[1]], [looked_up], name="embedding_lookup", axis=1
    )
    to_bth = [1, 2, 0]  # [H, B, T] -> [B, T, H]
    consumers = [n for n in graph.node if gather.output[0] in n.input]
    is_output = any(o.name == gather.output[0] for o in graph.output)
    idx = list(graph.node).index(gather)
    graph.node.remove(gather)
    if len(consumers) == 1 and consumers[0].op_type == "Transpose" and not is_output:
        # The exporter's own transpose to time-major follows: fold ours into it.
        (perm,) = [a for a in consumers[0].attribute if a.name == "perm"]
        perm.ints[:] = [to_bth[p] for p in perm.ints]
        consumers[0].input[0] = looked_up
    else:
        graph.node.insert(
            idx,
            helper.make_node(
                "Transpose", [looked_up], [gather.output[0]], name="embedding_to_bth", perm=to_bth
            ),
        )
    graph.node.insert(idx, new_gather)
    graph.initializer.remove(inits[gather.input[0]])
    return True


def _session(model_bytes: bytes, threads: int = 1) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def _feeds(cell: str, tokens: Tensor, state) -> dict[str, np.ndarray]:
    feeds = {"tokens": tokens.numpy().astype(np.int64)}
    if cell == "lstm":
        feeds["h0"], feeds["c0"] = state[0].numpy(), state[1].numpy()
    else:
        feeds["h0"] = state.numpy()
    return feeds


def check_parity(model: LanguageModel, session: ort.InferenceSession, seed: int = 0) -> float:
    """Max abs difference of onnxruntime vs PyTorch (log-probs and states) over random batches:
    batch 1 and 3, length 1 and 7, zero and random initial state, and one step fed with the
    state the previous batch returned. Raises ExportParityError above PARITY_TOLERANCE."""
    c = model.config
    model.eval()
    exported = _Exported(model)
    gen = torch.Generator().manual_seed(seed)
    _, outputs = io_names(c.cell)

    def rand_state(batch: int):
        h = torch.randn(c.num_layers, batch, c.hidden_size, generator=gen) * 0.5
        if c.cell == "lstm":
            return (h, torch.randn(c.num_layers, batch, c.hidden_size, generator=gen))
        return h

    def run(tokens: Tensor, state) -> tuple[list[np.ndarray], list[np.ndarray]]:
        with torch.no_grad():
            args = (state,) if c.cell == "gru" else tuple(state)
            ref = [t.numpy() for t in exported(tokens, *args)]
        got = session.run(outputs, _feeds(c.cell, tokens, state))
        return ref, got

    worst, failures = 0.0, []
    for batch in (1, 3):
        for length in (1, 7):
            for init in ("zero", "random"):
                tokens = torch.randint(0, c.vocab_size, (batch, length), generator=gen)
                state = model.init_state(batch) if init == "zero" else rand_state(batch)
                ref, got = run(tokens, state)
                cases = [(f"batch={batch} time={length} state={init}", ref, got)]
                # Next step fed with the state this step returned, as the keyboard does.
                prev = (
                    torch.from_numpy(got[1])
                    if c.cell == "gru"
                    else (torch.from_numpy(got[1]), torch.from_numpy(got[2]))
                )
                nxt = torch.randint(0, c.vocab_size, (batch, 1), generator=gen)
                ref2, got2 = run(nxt, prev)
                cases.append((f"batch={batch} time=1 after time={length} state={init}", ref2, got2))
                for label, r, g in cases:
                    for name, a, b in zip(outputs, r, g, strict=True):
                        if a.shape != b.shape:
                            raise ExportParityError(
                                f"{label}: {name} has shape {b.shape} in onnxruntime, "
                                f"{a.shape} in PyTorch"
                            )
                        diff = float(np.abs(a - b).max()) if a.size else 0.0
                        if not math.isfinite(diff):
                            diff = math.inf
                        worst = max(worst, diff)
                        if diff > PARITY_TOLERANCE:
                            failures.append(f"{label} {name}: max abs diff {diff:.3g}")
    if failures:
        raise ExportParityError(
            f"ONNX export does not match PyTorch (tolerance {PARITY_TOLERANCE:g}, worst "
            f"{worst:.3g}): " + "; ".join(failures[:6]) + (" ..." if len(failures) > 6 else "")
        )
    return worst


def held_out_logprobs(
    session: ort.InferenceSession,
    cell: str,
    num_layers: int,
    hidden_size: int,
    seqs: list[list[int]],
    batch_size: int = 32,
):
    """Yield (sequence index, log-probs [len-1, vocab]) for each encoded sentence, run from a
    zero state on its ids without the last (the targets are the ids without the first)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    outputs = ["logprobs"]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        lengths = [len(seqs[i]) - 1 for i in idx]
        width = max(lengths)
        tokens = np.zeros((len(idx), width), dtype=np.int64)  # right padding: causal, no effect
        for row, i in enumerate(idx):
            tokens[row, : lengths[row]] = seqs[i][:-1]
        h = np.zeros((num_layers, len(idx), hidden_size), dtype=np.float32)
        feeds = {"tokens": tokens, "h0": h}
        if cell == "lstm":
            feeds["c0"] = h.copy()
        (logp,) = session.run(outputs, feeds)
        for row, i in enumerate(idx):
            yield i, logp[row, : lengths[row]]


def held_out_scores(
    sessions: dict[str, ort.InferenceSession],
    config,
    tokenizer: Tokenizer,
    sentences: list[str],
) -> dict:
    """Perplexity of each session on `sentences` (fedkey.models.metrics.evaluate's definition:
    exp(total NLL / (words + 1 per sentence)), </s> predicted, <s> input only) and, for two
    sessions, how often their top suggestion agrees (argmax over the vocabulary without <unk>,
    <s>, </s>, which a suggestion bar never shows) over every prefix of every sentence."""
    seqs = [tokenizer.encode(s) for s in sentences]
    words = sum(tokenizer.num_words(s) + 1 for s in sentences)
    special = tokenizer.special_ids
    nll: dict[str, float] = {}
    top: dict[str, dict[int, np.ndarray]] = {}
    for name, sess in sessions.items():
        total, tops = 0.0, {}
        for i, logp in held_out_logprobs(
            sess, config.cell, config.num_layers, config.hidden_size, seqs
        ):
            targets = np.asarray(seqs[i][1:])
            total -= float(logp[np.arange(len(targets)), targets].astype(np.float64).sum())
            masked = logp.copy()
            masked[:, special] = -np.inf
            tops[i] = masked.argmax(axis=-1)
        nll[name], top[name] = total, tops
    out = {f"ppl_{k}": math.exp(v / max(words, 1)) for k, v in nll.items()}
    if len(sessions) == 2:
        a, b = (top[k] for k in sessions)
        same = sum(int((a[i] == b[i]).sum()) for i in a)
        total_prefixes = sum(len(a[i]) for i in a)
        out["top1_agreement"] = same / max(total_prefixes, 1)
    return out


class _DropPreprocessHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def quantize_int8(fp32: onnx.ModelProto) -> onnx.ModelProto:
    """Dynamic int8 quantization (weights int8 per tensor, activations quantized at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="fedkey-int8-") as tmp:
        src, dst = Path(tmp, "fp32.onnx"), Path(tmp, "int8.onnx")
        onnx.save(fp32, str(src))
        root = logging.getLogger()
        quiet = _DropPreprocessHint()
        root.addFilter(quiet)  # "consider pre-processing before quantization": not for us
        try:
            quantize_dynamic(
                src,
                dst,
                op_types_to_quantize=list(INT8_OP_TYPES),
                per_channel=False,
                weight_type=QuantType.QInt8,
            )
        finally:
            root.removeFilter(quiet)
        return onnx.load(str(dst))


def public_metadata(meta: dict) -> dict:
    """The checkpoint metadata a keyboard may see: no server state, metrics reduced to ppl, the
    corpus the model learned from ("data", the metrics row's; None when not recorded), the round
    best on validation as of this one ("best_round": this round when it is the best so far), and
    the privacy facts (fedkey.export.metadata.privacy_facts: epsilon, the budget, the bounding)."""
    metrics = meta.get("metrics") or {}
    best_round = metrics.get("best_round")
    return {
        "model": meta["model"],
        "tokenizer": meta["tokenizer"],
        "round": meta.get("round"),
        "strategy": meta.get("strategy"),
        "data": metrics.get("data") if isinstance(metrics.get("data"), str) else None,
        "best_round": best_round if isinstance(best_round, int) else None,
        "metrics": {k: metrics[k] for k in ("val_ppl", "test_ppl") if metrics.get(k) is not None},
        "privacy": privacy_facts(meta),
    }


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    int8: bool = False,
    parity_text: list[str] | None = None,
    opset: int = 17,
    metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ngram: str | Path | None = None,
    ngram_weight: float | None = None,
    weight_text: list[str] | None = None,
) -> ExportReport:
    """Export `checkpoint` to `out` (.onnx) and `<out stem>.json`; see the module docstring.

    `parity_text`: held-out sentences for the perplexity (fp32, and int8 with `int8`) and the
    int8-vs-fp32 top-1 agreement; without it those report fields are None. `metrics`, when
    given, maps the checkpoint's metrics row to the row the export may publish (the server's:
    fedkey.federation.metrics_row.public_row).
    `ngram`: an n-gram file (fedkey.models.ngram.KneserNey.save) on the model's vocabulary, copied
    beside the model as `<out stem>.ngram.safetensors` and mixed in by the keyboard with the
    model's share `ngram_weight`; without it, the checkpoint's metrics row's "ngram_weight" (as
    `metrics` publishes the row), else the weight of fedkey.models.mixture.GRID best on
    `weight_text` (validation sentences, never the test's), else 0.5
    (fedkey.export.mixture.mixture_weight).
    Raises ExportParityError (and writes nothing) if onnxruntime disagrees with PyTorch, and
    ValueError (and writes nothing) for an n-gram of another vocabulary or a damaged one.
    """
    start = time.perf_counter()
    out = Path(out)
    if out.suffix != ".onnx":
        raise ValueError(f"the output should end in .onnx, got {out}")
    if ngram_weight is not None and not 0 <= ngram_weight <= 1:
        raise ValueError(
            f"ngram_weight is the model's share of the mixture, in [0, 1]: {ngram_weight}"
        )
    json_path = metadata_path(out)
    model, tokenizer, meta = load_checkpoint(checkpoint)
    ngram_data, lm = read_ngram(ngram, tokenizer) if ngram is not None else (b"", None)
    if metrics is not None and "metrics" in meta:
        meta["metrics"] = metrics(meta["metrics"])
    # The weight measured on held-out text only as far as the row may be published (under DP,
    # fedkey.federation.metrics_row.public_row keeps the phones' held-out scores out).
    row = dict(meta.get("metrics") or {})
    model.eval()
    config = model.config

    fp32 = _to_onnx(model, opset)
    fp32_bytes = fp32.SerializeToString()
    fp32_session = _session(fp32_bytes)
    parity = check_parity(model, fp32_session)

    final = fp32
    sessions = {"fp32": fp32_session}
    if int8:
        final = quantize_int8(fp32)
        int8_session = _session(final.SerializeToString())
        _check_finite(int8_session, model)
        sessions["int8"] = int8_session
    scores = held_out_scores(sessions, config, tokenizer, parity_text) if parity_text else {}
    entry = None
    if lm is not None:  # the mixture with the model that ships (int8 or fp32)
        targets = None
        if weight_text:
            seqs = [tokenizer.encode(s) for s in weight_text]
            shipped = sessions["int8" if int8 else "fp32"]
            c = config
            logprobs = held_out_logprobs(shipped, c.cell, c.num_layers, c.hidden_size, seqs)
            targets = target_probs(lm, seqs, logprobs)
        weight, source, ppl = mixture_weight(ngram_weight, row, targets)
        entry = {**ngram_entry(ngram_path(out).name, ngram_data, lm, weight, source),
                 "held_out_ppl": ppl}  # fmt: skip

    inputs, outputs = io_names(config.cell)
    doc = {
        "format": FORMAT,
        **public_metadata(meta),
        "int8": bool(int8),
        "inputs": inputs,
        "outputs": outputs,
        "export": {
            "opset": opset,
            "fp32_bytes": len(fp32_bytes),
            "parity_max_abs_diff": parity,
            "int8_op_types": list(INT8_OP_TYPES) if int8 else [],
            "held_out_sentences": len(parity_text) if parity_text else 0,
            "held_out_ppl_fp32": scores.get("ppl_fp32"),
            "held_out_ppl_int8": scores.get("ppl_int8"),
            "top1_agreement": scores.get("top1_agreement"),
        },
        **({"ngram": entry} if entry is not None else {}),
        "personal": dict(PERSONAL_DEFAULTS),
    }
    text = json.dumps(doc, ensure_ascii=False)
    del final.metadata_props[:]
    final.metadata_props.add(key=METADATA_KEY, value=text)
    final.producer_name = "fedkey"
    data = final.SerializeToString()

    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, data)
    if entry is not None:
        _atomic_write(ngram_path(out), ngram_data)
    _atomic_write(json_path, text.encode("utf-8"))  # last: a new .json means a complete export
    return ExportReport(
        path=out,
        json_path=json_path,
        bytes=len(data),
        parity_max_abs_diff=parity,
        int8=bool(int8),
        fp32_bytes=len(fp32_bytes),
        held_out_ppl_fp32=scores.get("ppl_fp32"),
        held_out_ppl_int8=scores.get("ppl_int8"),
        top1_agreement=scores.get("top1_agreement"),
        seconds=time.perf_counter() - start,
        ngram=entry,
    )


def _check_finite(session: ort.InferenceSession, model: LanguageModel) -> None:
    """The quantized model runs and gives finite log-probs that are distributions."""
    c = model.config
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c.vocab_size, (2, 5), generator=gen)
    got = session.run(None, _feeds(c.cell, tokens, model.init_state(2)))
    if not all(np.isfinite(g).all() for g in got):
        raise ExportParityError("the int8 model gives non-finite outputs")
    mass = np.exp(got[0].astype(np.float64)).sum(-1)
    if np.abs(mass - 1).max() > 1e-3:
        raise ExportParityError(f"int8 log-probs do not sum to 1 (off by {np.abs(mass - 1).max()})")
