"""Performance benchmarks (figures printed, never asserted by tests).

    python -m bench.perf trainer    local trainer tokens/s against a bare PyTorch loop, same run
    python -m bench.perf memory     peak memory of streaming aggregation, 10 vs 200 updates
    python -m bench.perf http       `fedkey run` (HTTP) wall time against `fedkey simulate`, same workload
    python -m bench.perf transport  model download / update upload throughput on loopback

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


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - t


def bench_http(args: list[str], repeats: int, out: str) -> dict:
    """Whole-command wall time of the same federation in-process and over HTTP, interleaved."""
    fedkey = [sys.executable, "-m", "cli"]
    sim, http = [], []
    for i in range(repeats):
        sim.append(_timed([*fedkey, "simulate", *args, "--out", f"{out}/sim{i}"]))
        http.append(_timed([*fedkey, "run", *args, "--out", f"{out}/http{i}"]))
        print(f"repeat {i}: simulate {sim[-1]:.1f} s, run {http[-1]:.1f} s", flush=True)
    return {
        "args": " ".join(args),
        "simulate_seconds": [round(x, 2) for x in sim],
        "http_seconds": [round(x, 2) for x in http],
        "ratio_of_best": round(min(http) / min(sim), 3),
    }


def bench_transport(data: str, repeats: int, out: str) -> dict:
    """MB/s of GET /v1/model and POST /v1/rounds/1/update for the small model on loopback."""
    import httpx
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    port, secret = _free_port(), "bench"
    env = {
        **__import__("os").environ,
        "FEDKEY_DATA": data,
        "FEDKEY_STORAGE": out,
        "FEDKEY_PORT": str(port),
        "FEDKEY_ENROLLMENT_SECRET": secret,
        "FEDKEY_WAIT_DEVICES": "2",
        "FEDKEY_FRACTION": "1.0",
        "FEDKEY_MAX_EVAL_SENTENCES": "50",
        "FEDKEY_KSR_SENTENCES": "0",
        "FEDKEY_ROUND_DEADLINE": "600",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.main"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            for _ in range(600):
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            tokens = [
                http.post(
                    "/v1/devices",
                    json={"enrollment_secret": secret, "name": f"d{i}", "num_samples": 10},
                ).json()["token"]
                for i in range(2)
            ]
            auth = {"Authorization": f"Bearer {tokens[0]}"}
            while (
                http.get("/v1/rounds/current", headers=auth, params={"wait": 5}).json()["state"]
                != "open"
            ):
                pass
            t, size = time.perf_counter(), 0
            for _ in range(repeats):
                body = http.get("/v1/model").content
                size += len(body)
            down = size / (time.perf_counter() - t) / 2**20
            update = st_save(st_load(body))
            headers = {
                **auth,
                "X-Fedkey-Num-Samples": "10",
                "X-Fedkey-Train-Loss": "4.2",
                "Content-Type": "application/octet-stream",
            }
            t = time.perf_counter()
            first = http.post("/v1/rounds/1/update", content=update, headers=headers)
            first.raise_for_status()
            first_s = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(
                repeats
            ):  # identical re-uploads: the whole body crosses, then the receipt
                http.post("/v1/rounds/1/update", content=update, headers=headers).raise_for_status()
            up = len(update) * repeats / (time.perf_counter() - t) / 2**20
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "model_mb": round(len(update) / 2**20, 2),
        "download_mb_per_s": round(down, 1),
        "upload_mb_per_s": round(up, 1),
        "first_upload_validated_seconds": round(first_s, 3),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    h = sub.add_parser("http", help="HTTP (fedkey run) vs in-process (fedkey simulate) wall time")
    h.add_argument("--repeats", type=int, default=2)
    h.add_argument("--out", default="runs/bench-http")
    h.add_argument(
        "--args",
        default="--data demo --clients 20 --fraction 0.5 --rounds 5 --local-epochs 2 --workers 2",
        help="the workload, passed to both commands",
    )
    tr = sub.add_parser("transport", help="model download / update upload MB/s on loopback")
    tr.add_argument("--data", default="demo", help="the corpus whose vocabulary sizes the model")
    tr.add_argument("--repeats", type=int, default=10)
    tr.add_argument("--out", default="runs/bench-transport")
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
    elif args.cmd == "http":
        print(json.dumps(bench_http(args.args.split(), args.repeats, args.out), indent=2))
    elif args.cmd == "transport":
        import shutil

        shutil.rmtree(args.out, ignore_errors=True)
        print(json.dumps(bench_transport(args.data, args.repeats, args.out), indent=2))
    else:
        print(json.dumps(_aggregate_once(args.strategy, args.updates, args.vocab)))


if __name__ == "__main__":
    main()
