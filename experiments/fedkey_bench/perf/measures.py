"""The measurements behind `fedkey-bench perf` (fedkey_bench.perf.runner runs them and writes the report):
the local trainer against a bare PyTorch loop, bf16 against fp32, streaming aggregation's peak
memory, `fedkey run` against `fedkey simulate`, and model transfer on loopback. Each returns a
plain dict of figures; ratios are measured side by side in one run, interleaved."""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedkey.runners.processes import free_port
from fedkey_bench.common.checkout import ROOT

if TYPE_CHECKING:
    from fedkey.common.config import Precision

PTB = "../shared/data/ptb"  # relative to ROOT, as the commands the benches run name it


def _corpus(n_sentences: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """The trainer benches' sentences (encoded) and what they are: PTB's first training
    sentences where ../shared/data has it (real lengths: in the papers' batches of 10 about
    half of a padded batch is padding, which the trainer skips), else random ones."""
    if (ROOT / PTB).is_dir():
        from fedkey.corpora.loaders import load_corpus
        from fedkey.models.tokenizers import WordTokenizer

        train = load_corpus(ROOT / PTB, paper_protocol=True).train
        tok = WordTokenizer.build(train, vocab)
        seqs = [tok.encode(s) for s in train[:n_sentences]]
        return seqs, f"PTB's first {n_sentences} training sentences"
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 30, (n_sentences,), generator=g)
    seqs = [[1, *torch.randint(3, vocab, (int(n),), generator=g).tolist(), 2] for n in lengths]
    return seqs, f"{n_sentences} random sentences of 8-29 words"


def bare_loop(model_config, state, seqs, epochs, batch_size, lr, momentum, device="cpu") -> int:
    """The reference: the plainest PyTorch training loop over the same padded batches, the
    softmax run on every position (the trainer skips the padding: LanguageModel.logits_at)."""
    from fedkey.models.batching import IGNORE, batches
    from fedkey.models.checkpoint import build_model

    dev = torch.device(device)
    model = build_model(model_config, state).to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
    tokens = 0
    for epoch in range(epochs):
        order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(epoch)).tolist()
        for inputs, targets in batches(seqs, batch_size, order):
            tokens += int((targets != IGNORE).sum())  # on the CPU, as the trainer counts
            inputs, targets = inputs.to(dev), targets.to(dev)
            logits, _ = model(inputs)
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # the trainer's .cpu() copy of the weights waits too
    return tokens


def _training_setup(vocab: int, sentences: int, preset: str):
    """One torch thread, the preset model (seed 0), the sentences and what they are
    (:func:`_corpus`): what the trainer benches train on."""
    from fedkey.models.checkpoint import build_model, model_state
    from fedkey.models.config import ModelConfig

    torch.set_num_threads(1)
    cfg = ModelConfig.preset(preset, vocab)
    torch.manual_seed(0)
    return cfg, model_state(build_model(cfg)), *_corpus(sentences, vocab)


def bench_trainer(
    vocab: int, sentences: int, repeats: int, preset: str, device: str = "cpu"
) -> dict:
    from fedkey.common.config import TrainConfig
    from fedkey.device_sim.training.trainer import train_local

    cfg, state, seqs, text = _training_setup(vocab, sentences, preset)
    # fp32, as the bare loop: the trainer's overhead against the padding it skips (bf16:
    # bench_precision).
    tc = TrainConfig(epochs=1, batch_size=10, lr=0.01, momentum=0.5, precision="fp32")
    ours, bare = [], []
    for r in range(repeats):  # interleaved, so drift in machine load hits both alike
        t = time.perf_counter()
        res = train_local(cfg, state, seqs, tc, seed=r, device=device)
        ours.append(res.num_tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        n = bare_loop(cfg, state, seqs, 1, 10, 0.01, 0.5, device)
        bare.append(n / (time.perf_counter() - t))
    best_ours, best_bare = max(ours), max(bare)
    return {
        "device": device,
        "model": preset,
        "vocab": vocab,
        "sentences": sentences,
        "text": text,
        "trainer_tokens_per_s": round(best_ours),
        "bare_loop_tokens_per_s": round(best_bare),
        "ratio": round(best_ours / best_bare, 3),
        "all_trainer": [round(x) for x in ours],
        "all_bare": [round(x) for x in bare],
    }


def bench_precision(
    vocab: int, sentences: int, repeats: int, preset: str, device: str = "cpu"
) -> dict:
    """The trainer's tokens/s under bf16 against fp32: the same step, interleaved, one thread."""
    from fedkey.common.config import TrainConfig
    from fedkey.device_sim.training.trainer import train_local
    from fedkey.models.precision import native_bf16, resolve_precision

    cfg, state, seqs, text = _training_setup(vocab, sentences, preset)
    speeds: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for r in range(repeats):  # interleaved, alternating which goes first
        for precision in ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"):
            tc = TrainConfig(epochs=1, batch_size=10, lr=0.01, momentum=0.5, precision=precision)
            t = time.perf_counter()
            res = train_local(cfg, state, seqs, tc, seed=r, device=device)
            speeds[precision].append(res.num_tokens / (time.perf_counter() - t))
    best = {p: max(v) for p, v in speeds.items()}
    return {
        "device": device,
        "model": preset,
        "vocab": vocab,
        "sentences": sentences,
        "text": text,
        "native_bf16": native_bf16(device),
        "auto": resolve_precision("auto", device),
        "fp32_tokens_per_s": round(best["fp32"]),
        "bf16_tokens_per_s": round(best["bf16"]),
        "ratio": round(best["bf16"] / best["fp32"], 3),
        "all_fp32": [round(x) for x in speeds["fp32"]],
        "all_bf16": [round(x) for x in speeds["bf16"]],
    }


def bench_precision_quality(args: list[str], out: str) -> dict:
    """The same `fedkey simulate` run under --precision fp32 and bf16: the last round's test
    perplexity of each and the relative difference (bf16 - fp32) / fp32 in percent."""
    out = str(Path(out).resolve())  # the commands run in ROOT
    runs = {}
    for precision in ("fp32", "bf16"):
        run_dir = f"{out}/{precision}"
        cmd = [sys.executable, "-m", "fedkey", "simulate", *args, "--precision", precision]
        seconds = _timed([*cmd, "--out", run_dir])
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        last = json.loads([line for line in lines if line.strip()][-1])
        runs[precision] = {
            "rounds": last["round"],
            "val_ppl": last["val_ppl"],
            "test_ppl": last["test_ppl"],
            "best_test_ppl": last["best_test_ppl"],
            "train_precision": last.get("train_precision"),
            "eval_precision": last.get("eval_precision"),
            "wall_seconds": round(seconds, 1),
            "round_seconds": round(_round_seconds(run_dir), 1),
        }
        print(
            f"  {precision}: test perplexity {last['test_ppl']:.3f} after round {last['round']} "
            f"({seconds:.0f} s)",
            flush=True,
        )
    fp32, bf16 = runs["fp32"]["test_ppl"], runs["bf16"]["test_ppl"]
    return {
        "args": " ".join(args),
        **runs,
        "test_ppl_change_pct": round((bf16 - fp32) / fp32 * 100, 3),
    }


def bench_gpu_share(
    vocab: int,
    sentences: int,
    preset: str,
    processes: tuple[int, ...] = (1, 2, 4, 8),
    phones_per_process: int = 2,
) -> dict:
    """Phones training side by side on one GPU, as `fedkey simulate` and the fleet's pool run
    them (fedkey.device_sim.training.process_pool: one process per trainer, each with its own CUDA context): for each
    pool size P, 2P phones of `sentences` sentences (:func:`_corpus`), one epoch each, batch
    10; the aggregate tokens/s (every phone's tokens over the batch's wall time), fp32 and bf16. At the
    seed papers' batch one phone leaves the GPU mostly idle (kernel launches, not arithmetic,
    bound a step), so phones side by side is where the GPU's speed shows."""
    from fedkey.common.config import TrainConfig
    from fedkey.device_sim.training.process_pool import LocalTask, TrainerPool

    cfg, state, seqs, text = _training_setup(vocab, sentences, preset)

    def tasks(n: int, precision: Precision, shard: list[list[int]]) -> list[LocalTask]:
        tc = TrainConfig(epochs=1, batch_size=10, lr=0.01, momentum=0.5, precision=precision)
        return [
            LocalTask(f"phone-{i}", shard, seed=i, model_config=cfg, train=tc, device="cuda")
            for i in range(n)
        ]

    rows: list[dict[str, Any]] = []
    precisions: tuple[Precision, Precision] = ("fp32", "bf16")
    for p in processes:
        pool = TrainerPool(p)
        try:
            for precision in precisions:  # each process's CUDA context and kernels
                pool.run(tasks(2 * p, precision, seqs[:40]), state)
            for precision in precisions if p % 2 else precisions[::-1]:
                batch = tasks(phones_per_process * p, precision, seqs)
                t = time.perf_counter()
                results = pool.run(batch, state)
                seconds = time.perf_counter() - t
                tokens = sum(r.num_tokens for r in results.values())
                rows.append(
                    {
                        "processes": p,
                        "precision": precision,
                        "phones": len(batch),
                        "tokens": tokens,
                        "seconds": round(seconds, 2),
                        "tokens_per_s": round(tokens / seconds),
                    }
                )
                print(
                    f"  {p} processes, {precision}: {rows[-1]['tokens_per_s']} tokens/s", flush=True
                )
        finally:
            pool.close()
    one = max(r["tokens_per_s"] for r in rows if r["processes"] == min(processes))
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {
        "gpu": torch.cuda.get_device_name(0),
        "model": preset,
        "vocab": vocab,
        "sentences": sentences,
        "text": text,
        "rows": rows,
        "best": best,
        "speedup_over_one_process": round(best["tokens_per_s"] / one, 3),
    }


def bench_stacked(
    vocab: int,
    sentences_per_phone: int,
    phones: tuple[int, ...],
    preset: str,
    device: str,
    precisions: tuple[Precision, ...],
    repeats: int = 2,
) -> dict:
    """A round's phones trained one after another by one trainer (fedkey.device_sim.training.trainer.train_local,
    as a pool process trains them) against all at once as one stacked model (fedkey.device_sim.training.stacked,
    `--backend stacked`), and on a GPU against the stack whose steps replay CUDA graphs (what
    the backend runs there): tokens/s of each, interleaved, best of `repeats`. Each of P phones
    holds its own `sentences_per_phone` sentences (:func:`_corpus`), one epoch, batch 10."""
    from fedkey.common.config import TrainConfig

    n = sentences_per_phone
    cfg, state, seqs, text = _training_setup(vocab, n * max(phones), preset)
    rows = []
    for precision in precisions:
        tc = TrainConfig(epochs=1, batch_size=10, lr=0.01, momentum=0.5, precision=precision)
        for p in phones:
            shards = [(seqs[i * n : (i + 1) * n], i) for i in range(p)]
            r = _stacked_row(cfg, state, shards, tc, torch.device(device), repeats)
            rows.append(r)
            graphs = r["graphed_ratio"]
            print(
                f"  {device} {precision}, {p} phones: one by one {r['one_by_one_tokens_per_s']}"
                f" tokens/s, stacked {r['stacked_tokens_per_s']} ({r['ratio']:.2f}x)"
                + (f", CUDA graphs {r['graphed_tokens_per_s']} ({graphs:.2f}x)" if graphs else ""),
                flush=True,
            )
    text = f"{text}, {n} to a phone"
    return {"model": preset, "vocab": vocab, "sentences_per_phone": n, "text": text, "rows": rows}


def _stacked_row(cfg, state, shards, tc, dev: torch.device, repeats: int) -> dict[str, Any]:
    """bench_stacked's figures for one precision and one number of phones."""
    from fedkey.device_sim.training.stacked import Stack, train_stacked
    from fedkey.device_sim.training.trainer import train_local
    from fedkey.models.batching import count_targets

    device, cuda = str(dev), dev.type == "cuda"
    tokens = sum(count_targets(s) for s, _ in shards)
    graphed = Stack(cfg, tc, len(shards), dev, static=True) if cuda else None
    ways = {
        "one": lambda: [train_local(cfg, state, s, tc, i, device) for s, i in shards],
        "stacked": lambda: train_stacked(cfg, state, shards, tc, device),
    }
    if graphed is not None:
        ways["graphed"] = lambda: train_stacked(cfg, state, shards, tc, device, stack=graphed)
    train_local(cfg, state, shards[0][0][:10], tc, 0, device)  # warm-up: kernels, context
    train_stacked(cfg, state, [(s[:10], i) for s, i in shards], tc, device)
    if graphed is not None:  # and its captures, one a step width
        ways["graphed"]()
    speeds: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):  # interleaved, so drift in machine load hits each alike
        for what, train in ways.items():
            t = time.perf_counter()
            train()
            if cuda:
                torch.cuda.synchronize(dev)
            speeds[what].append(tokens / (time.perf_counter() - t))
    best = {k: max(v) for k, v in speeds.items()}
    return {
        "device": dev.type,
        "precision": tc.precision,
        "phones": len(shards),
        "tokens": tokens,
        "one_by_one_tokens_per_s": round(best["one"]),
        "stacked_tokens_per_s": round(best["stacked"]),
        "ratio": round(best["stacked"] / best["one"], 3),
        "graphed_tokens_per_s": round(best["graphed"]) if "graphed" in best else None,
        "graphed_ratio": round(best["graphed"] / best["one"], 3) if "graphed" in best else None,
    }


def _peak_rss_kib() -> int:
    """This process's peak resident set in KiB: VmHWM, which starts afresh at exec. Not
    ru_maxrss: Linux carries the parent's peak into a child that subprocess starts with vfork."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _aggregate_once(strategy: str, updates: int, vocab: int) -> dict:
    """Run in a fresh process: peak RSS of aggregating `updates` lazily generated updates."""
    from fedkey.federation.strategies import ClientUpdate, get_strategy
    from fedkey.models.checkpoint import build_model, model_state
    from fedkey.models.config import ModelConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    glob = model_state(build_model(ModelConfig.preset("small", vocab)))
    base_rss = _peak_rss_kib()

    def stream():  # one update alive at a time, as when the server reads them from disk
        for k in range(updates):
            g = torch.Generator().manual_seed(k)
            state = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in glob.items()}
            yield ClientUpdate(state=state, num_samples=100 + k, train_loss=4.0, device_id=f"d{k}")

    s = get_strategy(strategy)
    t = time.perf_counter()
    s.aggregate(glob, stream())
    seconds = time.perf_counter() - t
    peak = _peak_rss_kib()
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
                [
                    sys.executable,
                    "-m",
                    "fedkey_bench.perf.runner",
                    "_aggregate",
                    strategy,
                    str(n),
                    str(vocab),
                ],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - t


def _round_seconds(run_dir: str | Path) -> float:
    """The sum of the per-round `seconds` in a run's metrics.jsonl (round 0 is the start)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return sum(row["seconds"] for row in map(json.loads, filter(None, lines)) if row["round"] > 0)


def bench_http(args: list[str], repeats: int, out: str) -> dict:
    """Whole-command wall time of the same federation in-process and over HTTP, interleaved;
    also the summed per-round `seconds` of each run's metrics (no process start-up in them)."""
    out = str(Path(out).resolve())  # the commands run in ROOT
    fedkey = [sys.executable, "-m", "fedkey"]
    sim, http = list[float](), list[float]()  # each command's wall seconds
    sim_rounds, http_rounds = list[float](), list[float]()  # and its summed round seconds
    for i in range(repeats):
        # Alternate which goes first (A B, B A, ...), so neither always follows the other.
        for kind in ("simulate", "run") if i % 2 == 0 else ("run", "simulate"):
            run_dir = f"{out}/{'sim' if kind == 'simulate' else 'http'}{i}"
            seconds = _timed([*fedkey, kind, *args, "--out", run_dir])
            walls, rounds = (sim, sim_rounds) if kind == "simulate" else (http, http_rounds)
            walls.append(seconds)
            rounds.append(_round_seconds(run_dir))
        print(
            f"  repeat {i + 1}/{repeats}: simulate {sim[-1]:.1f} s (rounds {sim_rounds[-1]:.1f} s),"
            f" run {http[-1]:.1f} s (rounds {http_rounds[-1]:.1f} s)",
            flush=True,
        )
    return {
        "args": " ".join(args),
        "simulate_seconds": [round(x, 2) for x in sim],
        "http_seconds": [round(x, 2) for x in http],
        "ratio_of_best": round(min(http) / min(sim), 3),
        "simulate_round_seconds": [round(x, 3) for x in sim_rounds],
        "http_round_seconds": [round(x, 3) for x in http_rounds],
        "round_seconds_ratio_of_best": round(min(http_rounds) / min(sim_rounds), 3),
    }


def bench_transport(data: str, repeats: int, out: str) -> dict:
    """MB/s of GET /v1/model and POST /v1/rounds/1/update for the small model on loopback."""
    import httpx
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from fedkey.runners.loopback import ServerProcess
    from fedkey.server.settings import Settings

    port, secret = free_port(), "bench"
    settings = Settings(
        data=data,
        storage=Path(out).resolve(),
        port=port,
        enrollment_secret=secret,
        wait_devices=2,
        fraction=1.0,
        max_eval_sentences=50,
        ksr_sentences=0,
        round_deadline=600,
    )
    with ServerProcess(settings, Path(out)) as server:
        server.wait_healthy()
        url = server.url
        with httpx.Client(base_url=url, timeout=60) as http:
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
            # Identical re-uploads: the whole body crosses, then the receipt.
            for _ in range(repeats):
                http.post("/v1/rounds/1/update", content=update, headers=headers).raise_for_status()
            up = len(update) * repeats / (time.perf_counter() - t) / 2**20
    return {
        "model_mb": round(len(update) / 2**20, 2),
        "download_mb_per_s": round(down, 1),
        "upload_mb_per_s": round(up, 1),
        "first_upload_validated_seconds": round(first_s, 3),
    }
