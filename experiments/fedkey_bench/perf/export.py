"""Measure an export: file sizes, parity, int8 perplexity change and one-step latency.

    python -m fedkey_bench.perf.export --corpus demo --epochs 2
    python -m fedkey_bench.perf.export --corpus ../shared/data/ptb --vocab 10000 --max-train 6000

trains the "small" preset (emb = hidden = 300, tied GRU unless told otherwise) a little with
fedkey.device_sim.training.trainer.train_local, saves a checkpoint, exports it fp32 and int8 with the held-out
(valid) sentences as parity_text, and times one next-word step in onnxruntime CPU with one
thread. `step_latency` needs only onnxruntime and numpy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def step_latency(onnx_path: str | Path, steps: int = 1000, warmup: int = 50, seed: int = 0) -> dict:
    """One-token steps fed with the previous state, as the keyboard runs them (batch 1,
    intra_op_num_threads = 1): {"p50_ms", "p90_ms", "mean_ms", "steps"}."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    vocab = sess.get_outputs()[0].shape[-1]
    layers, _, hidden = inputs["h0"].shape
    rng = np.random.default_rng(seed)
    state_names = [n for n in inputs if n != "tokens"]  # h0 (and c0)
    state = [np.zeros((layers, 1, hidden), np.float32) for _ in state_names]
    times = []
    for i in range(warmup + steps):
        feeds = {"tokens": rng.integers(0, vocab, (1, 1), dtype=np.int64)}
        feeds.update(zip(state_names, state, strict=True))
        t0 = time.perf_counter()
        out = sess.run(None, feeds)
        dt = time.perf_counter() - t0
        state = out[1:]
        if i >= warmup:
            times.append(dt * 1e3)
    t = np.asarray(times)
    return {
        "p50_ms": float(np.percentile(t, 50)),
        "p90_ms": float(np.percentile(t, 90)),
        "mean_ms": float(t.mean()),
        "steps": steps,
    }


def compare_exports(fp32, int8, steps: int = 1000) -> dict:
    """Sizes, parity, held-out perplexity change, top-1 agreement and one-step latency of an fp32
    export and its int8 twin (two ExportReports made with the same parity_text)."""
    return {
        "fp32_bytes": fp32.bytes,
        "int8_bytes": int8.bytes,
        "parity_max_abs_diff": fp32.parity_max_abs_diff,
        "ppl_fp32": int8.held_out_ppl_fp32,
        "ppl_int8": int8.held_out_ppl_int8,
        "ppl_change_pct": 100 * (int8.held_out_ppl_int8 / int8.held_out_ppl_fp32 - 1),
        "top1_agreement": int8.top1_agreement,
        "export_seconds": {"fp32": round(fp32.seconds, 2), "int8": round(int8.seconds, 2)},
        "latency_fp32": step_latency(fp32.path, steps),
        "latency_int8": step_latency(int8.path, steps),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="demo", help="'demo' or a corpus directory (PTB layout)")
    ap.add_argument("--vocab", type=int, default=10_000, help="max vocabulary size")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--cell", default="gru", choices=["gru", "lstm"])
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--max-train", type=int, default=None, help="first N training sentences")
    ap.add_argument("--held-out", type=int, default=800, help="valid sentences for perplexity")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default="runs/export-bench")
    args = ap.parse_args(argv)

    import torch

    from fedkey.common.config import TrainConfig
    from fedkey.corpora.loaders import load_corpus
    from fedkey.device_sim.training.trainer import train_local
    from fedkey.export.onnx_export import export_checkpoint
    from fedkey.models.checkpoint import build_model, model_state, save_checkpoint
    from fedkey.models.config import ModelConfig
    from fedkey.models.tokenizers import WordTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    corpus = load_corpus(args.corpus)
    train = corpus.train[: args.max_train] if args.max_train else corpus.train
    held_out = corpus.valid[: args.held_out]
    tok = WordTokenizer.build(corpus.train, max_size=args.vocab)
    cfg = ModelConfig.preset(args.preset, tok.vocab_size, cell=args.cell, tied=not args.untied)
    t0 = time.perf_counter()
    result = train_local(
        cfg,
        model_state(build_model(cfg)),
        [tok.encode(s) for s in train],
        TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=20),
        seed=0,
        device="cpu",
    )
    train_s = time.perf_counter() - t0
    out = Path(args.out)
    name = f"{Path(str(args.corpus)).name}-{args.preset}-{args.cell}-v{tok.vocab_size}"
    ckpt = save_checkpoint(
        out / f"{name}.safetensors", result.state, cfg, tok, round_idx=0, strategy="central"
    )
    fp32 = export_checkpoint(ckpt, out / f"{name}.onnx", parity_text=held_out)
    int8 = export_checkpoint(ckpt, out / f"{name}-int8.onnx", int8=True, parity_text=held_out)
    report = {
        "corpus": str(args.corpus),
        "vocab": tok.vocab_size,
        "model": cfg.to_dict(),
        "train_sentences": len(train),
        "train_tokens": result.num_tokens,
        "epochs": args.epochs,
        "train_seconds": round(train_s, 1),
        "train_loss": result.train_loss,
        "held_out_sentences": len(held_out),
        **compare_exports(fp32, int8, args.steps),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
