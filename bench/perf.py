"""Performance benchmarks of the foundation (figures printed, never asserted by tests).

    python -m bench.perf trainer   local trainer tokens/s against a bare PyTorch loop, same run
    python -m bench.perf memory    peak memory of streaming aggregation, 10 vs 200 updates

Ratios are measured side by side in one run and interleaved: these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from torch import nn


def _corpus(n_sentences: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 30, (n_sentences,), generator=g)
    return [[1, *torch.randint(3, vocab, (int(n),), generator=g).tolist(), 2] for n in lengths]


def bare_loop(model_config, state, seqs, epochs, batch_size, lr, momentum) -> int:
    """The reference: the plainest PyTorch training loop over the same padded batches."""
    from models.batching import IGNORE, batches
    from models.checkpoint import build_model

    model = build_model(model_config, state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
    tokens = 0
    for epoch in range(epochs):
        order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(epoch)).tolist()
        for inputs, targets in batches(seqs, batch_size, order):
            logits, _ = model(inputs)
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tokens += int((targets != IGNORE).sum())
    return tokens


def bench_trainer(vocab: int, sentences: int, repeats: int, preset: str) -> dict:
    from device_sim.trainer import TrainConfig, train_local
    from models.checkpoint import build_model, model_state
    from models.model import ModelConfig

    torch.set_num_threads(1)
    cfg = ModelConfig.preset(preset, vocab)
    torch.manual_seed(0)
    state = model_state(build_model(cfg))
    seqs = _corpus(sentences, vocab)
    tc = TrainConfig(epochs=1, batch_size=10, lr=0.01, momentum=0.5)
    ours, bare = [], []
    for r in range(repeats):  # interleaved, so drift in machine load hits both alike
        t = time.perf_counter()
        res = train_local(cfg, state, seqs, tc, seed=r, device="cpu")
        ours.append(res.num_tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        n = bare_loop(cfg, state, seqs, 1, 10, 0.01, 0.5)
        bare.append(n / (time.perf_counter() - t))
    best_ours, best_bare = max(ours), max(bare)
    return {
        "model": preset,
        "vocab": vocab,
        "sentences": sentences,
        "trainer_tokens_per_s": round(best_ours),
        "bare_loop_tokens_per_s": round(best_bare),
        "ratio": round(best_ours / best_bare, 3),
        "all_trainer": [round(x) for x in ours],
        "all_bare": [round(x) for x in bare],
    }


def _aggregate_once(strategy: str, updates: int, vocab: int) -> dict:
    """Run in a fresh process: peak RSS of aggregating `updates` lazily generated updates."""
    from models.checkpoint import build_model, model_state
    from models.model import ModelConfig
    from server.strategies import ClientUpdate, get_strategy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    glob = model_state(build_model(ModelConfig.preset("small", vocab)))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def stream():  # one update alive at a time, as when the server reads them from disk
        for k in range(updates):
            g = torch.Generator().manual_seed(k)
            state = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in glob.items()}
            yield ClientUpdate(state=state, num_samples=100 + k, train_loss=4.0, device_id=f"d{k}")

    s = get_strategy(strategy)
    t = time.perf_counter()
    s.aggregate(glob, stream())
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model_mb = sum(v.numel() * v.element_size() for v in glob.values()) / 2**20
    return {
        "strategy": strategy,
        "updates": updates,
        "model_mb": round(model_mb, 1),
        "peak_rss_mb": round(peak / 1024, 1),
        "rss_before_mb": round(base_rss / 1024, 1),
        "seconds": round(seconds, 2),
    }


def bench_memory(counts: list[int], strategies: list[str], vocab: int) -> list[dict]:
    rows = []
    for strategy in strategies:
        for n in counts:
            out = subprocess.run(
                [sys.executable, "-m", "bench.perf", "_aggregate", strategy, str(n), str(vocab)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trainer", help="trainer tokens/s vs a bare PyTorch loop")
    t.add_argument("--vocab", type=int, default=10_000)
    t.add_argument("--sentences", type=int, default=300)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--model", default="small")
    m = sub.add_parser("memory", help="peak memory of streaming aggregation")
    m.add_argument("--counts", default="10,200")
    m.add_argument("--strategies", default="fedavg,fedatt")
    m.add_argument("--vocab", type=int, default=10_000)
    a = sub.add_parser("_aggregate")  # internal: one measurement in a fresh process
    a.add_argument("strategy")
    a.add_argument("updates", type=int)
    a.add_argument("vocab", type=int)
    args = p.parse_args(argv)
    if args.cmd == "trainer":
        print(
            json.dumps(
                bench_trainer(args.vocab, args.sentences, args.repeats, args.model), indent=2
            )
        )
    elif args.cmd == "memory":
        bench_memory(
            [int(c) for c in args.counts.split(",")], args.strategies.split(","), args.vocab
        )
    else:
        print(json.dumps(_aggregate_once(args.strategy, args.updates, args.vocab)))


if __name__ == "__main__":
    main()
