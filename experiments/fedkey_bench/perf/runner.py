"""Performance benchmarks (figures printed, never asserted by tests).

    fedkey-bench perf [--quick]     all of them, written to experiments/results/perf/cpu/perf.json
                                    (and the page experiments/results/perf/results.md)
                                    with the targets beside the figures (run_perf below)
    python -m fedkey_bench.perf.runner trainer    local trainer tokens/s against a bare PyTorch loop, same run
    python -m fedkey_bench.perf.runner precision  trainer tokens/s under bf16 against fp32, same run
    python -m fedkey_bench.perf.runner memory     peak memory of streaming aggregation, 10 vs 200 updates
    python -m fedkey_bench.perf.runner http       `fedkey run` (HTTP) wall time against `fedkey simulate`, same workload
    python -m fedkey_bench.perf.runner transport  model download / update upload throughput on loopback
    python -m fedkey_bench.perf.runner ray        simulate's round time with --backend ray vs local, Ray's start-up

Ratios are measured side by side in one run and interleaved: these machines are noisy. The
measurements are in fedkey_bench.perf.measures (and fedkey_bench.perf.ray, fedkey_bench.perf.fleet_memory); this module
holds the steps, their parameters and the runner.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedkey_bench.common.checkout import RESULTS
from fedkey_bench.common.provenance import git, machine
from fedkey_bench.perf.measures import (
    PTB,
    ROOT,
    _aggregate_once,
    bench_gpu_share,
    bench_http,
    bench_memory,
    bench_precision,
    bench_precision_quality,
    bench_stacked,
    bench_trainer,
    bench_transport,
)

# -- fedkey-bench perf: every benchmark, one report ---------------------------------------------

HTTP_WORKLOAD = "--data demo --clients 20 --fraction 0.5 --rounds 5 --local-epochs 2 --workers 2"
HTTP_WORKLOAD_QUICK = (
    "--data demo --clients 20 --fraction 0.5 --rounds 2 --local-epochs 1 --workers 2"
)
#: The precision step's 10-round run: PTB (a 10k vocabulary, the papers' setup, its first 100k
#: training words) where ../shared/data has it (PTB: fedkey_bench.perf.measures), else the demo corpus.
PRECISION_WORKLOAD = (
    "--clients 20 --fraction 0.5 --rounds 10 --local-epochs 1 --ksr-sentences 0 --workers 2"
)
PRECISION_PTB = "--max-train-tokens 100000 --max-eval-sentences 500"


#: The ray step's workload (fedkey_bench.perf.ray): the http step's, both backends with 2 trainers.
RAY_WORKLOAD = "--data demo --clients 20 --fraction 0.5 --rounds 5 --local-epochs 2"
RAY_WORKLOAD_QUICK = "--data demo --clients 20 --fraction 0.5 --rounds 2 --local-epochs 1"


def precision_workload(quick: bool = False) -> str:
    if quick:
        return PRECISION_WORKLOAD.replace("--rounds 10", "--rounds 3") + " --data demo"
    if (ROOT / PTB).is_dir():
        return f"{PRECISION_WORKLOAD} --data {PTB} {PRECISION_PTB}"
    return f"{PRECISION_WORKLOAD} --data demo"


def perf_params(quick: bool = False) -> dict:
    """What each step of `fedkey-bench perf` measures; --quick shrinks every step."""
    return {
        "trainer": {
            "model": "small",
            "vocab": 10_000,
            "sentences": 150 if quick else 300,
            "repeats": 3 if quick else 5,
        },
        "http": {
            "args": HTTP_WORKLOAD_QUICK if quick else HTTP_WORKLOAD,
            "repeats": 1 if quick else 3,
        },
        "memory": {
            "counts": [10, 50] if quick else [10, 50, 200],
            "strategies": ["fedavg", "fedatt"],
            "vocab": 10_000,
        },
        # The keyboard's model (steps keyboard and export): `fedkey train-central`, small preset.
        "model": {"data": "demo", "epochs": 1 if quick else 2},
        "keyboard": {
            "keystrokes": 300 if quick else 1000,
            "warmup": 50 if quick else 100,
            "browser_keystrokes": 200 if quick else 1000,
        },
        "export": {"held_out": "the demo test split", "latency_steps": 300 if quick else 1000},
        "transport": {"data": "demo", "repeats": 5 if quick else 10},
        # bf16 against fp32: the trainer's tokens/s (as step trainer), then a 10-round simulate.
        "precision": {
            "model": "small",
            "vocab": 10_000,
            "sentences": 100 if quick else 300,
            "repeats": 2 if quick else 5,
            "args": precision_workload(quick),
        },
        # Phones side by side on one GPU (pool processes sharing it): aggregate tokens/s.
        "gpu_share": {
            "model": "small",
            "vocab": 10_000,
            "sentences": 300 if quick else 600,
            "processes": [1, 2, 4] if quick else [1, 2, 4, 8],
        },
        # A round's phones one by one vs stacked (--backend stacked), on the CPU and a GPU.
        "stacked": {
            "model": "small",
            "vocab": 10_000,
            "sentences_per_phone": 20 if quick else 40,
            "phones_cpu": [10],
            "phones_cuda": [10] if quick else [10, 50],
            "repeats": 2 if quick else 3,
        },
        # Idle phones in one Ray phone host (fedkey_bench.perf.fleet_memory): its RSS per phone.
        "fleet_memory": {"phones": [1000] if quick else [1000, 10_000]},
        # The same simulate with --backend ray and local (fedkey_bench.perf.ray), Ray's start-up.
        "ray": {
            "args": RAY_WORKLOAD_QUICK if quick else RAY_WORKLOAD,
            "repeats": 1 if quick else 3,
            "workers": 2,
        },
    }


def _step_trainer(p: dict, work: Path, shared: dict) -> dict:
    t = p["trainer"]
    out = {"cpu": bench_trainer(t["vocab"], t["sentences"], t["repeats"], t["model"], "cpu")}
    if torch.cuda.is_available():
        print(f"  cpu: ratio {out['cpu']['ratio']:.3f}; now cuda", flush=True)
        out["cuda"] = bench_trainer(t["vocab"], t["sentences"], t["repeats"], t["model"], "cuda")
    return out


def _step_http(p: dict, work: Path, shared: dict) -> dict:
    h = p["http"]
    return bench_http(h["args"].split(), h["repeats"], str(work / "http"))


def _step_memory(p: dict, work: Path, shared: dict) -> dict:
    m = p["memory"]
    return {"rows": bench_memory(m["counts"], m["strategies"], m["vocab"])}


def _demo_model(p: dict, work: Path, shared: dict) -> tuple[Path, dict]:
    """The keyboard's model, trained once: `fedkey train-central` on the demo corpus."""
    if "model" not in shared:
        m, run_dir = p["model"], work / "central"
        cmd = [sys.executable, "-m", "fedkey", "train-central", "--data", m["data"]]
        cmd += ["--epochs", str(m["epochs"]), "--out", str(run_dir)]
        print(f"  the keyboard's model: fedkey {' '.join(cmd[3:])}", flush=True)
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
        shared["model"] = (sorted((run_dir / "checkpoints").glob("*.safetensors"))[-1], last)
    return shared["model"]


def _step_keyboard(p: dict, work: Path, shared: dict) -> dict:
    from fedkey_bench.perf.keyboard import main as keyboard_bench

    checkpoint, row = _demo_model(p, work, shared)
    k = p["keyboard"]
    argv = ["--checkpoint", str(checkpoint), "--data", p["model"]["data"]]
    argv += ["--keystrokes", str(k["keystrokes"]), "--warmup", str(k["warmup"])]
    argv += ["--browser-keystrokes", str(k["browser_keystrokes"])]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its JSON: ours is the report
        result = keyboard_bench(argv)
    result.pop("model", None)  # a temporary path
    return {**result, "model_round": row["round"], "model_test_ppl": row["test_ppl"]}


def _step_export(p: dict, work: Path, shared: dict) -> dict:
    from fedkey.corpora.loaders import load_corpus
    from fedkey.export.onnx_export import export_checkpoint
    from fedkey_bench.perf.export import compare_exports

    checkpoint, row = _demo_model(p, work, shared)
    held_out = load_corpus(p["model"]["data"]).test
    fp32 = export_checkpoint(checkpoint, work / "export" / "model.onnx", parity_text=held_out)
    int8 = export_checkpoint(
        checkpoint, work / "export" / "model-int8.onnx", int8=True, parity_text=held_out
    )
    steps = p["export"]["latency_steps"]
    return {
        "model": json.loads(fp32.json_path.read_text())["model"],
        "model_test_ppl": row["test_ppl"],
        "held_out_sentences": len(held_out),
        **compare_exports(fp32, int8, steps),
    }


def _step_precision(p: dict, work: Path, shared: dict) -> dict:
    q = p["precision"]
    speed = {"cpu": bench_precision(q["vocab"], q["sentences"], q["repeats"], q["model"], "cpu")}
    print(f"  cpu: bf16 / fp32 tokens/s {speed['cpu']['ratio']:.3f}", flush=True)
    if torch.cuda.is_available():
        speed["cuda"] = bench_precision(
            q["vocab"], q["sentences"], q["repeats"], q["model"], "cuda"
        )
    quality = bench_precision_quality(q["args"].split(), str(work / "precision"))
    return {"speed": speed, "quality": quality}


def _step_gpu_share(p: dict, work: Path, shared: dict) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU visible"}
    g = p["gpu_share"]
    return bench_gpu_share(g["vocab"], g["sentences"], g["model"], tuple(g["processes"]))


def _step_stacked(p: dict, work: Path, shared: dict) -> dict:
    from fedkey.models.precision import resolve_precision

    s = p["stacked"]
    args = (s["vocab"], s["sentences_per_phone"])
    cpu = resolve_precision("auto", "cpu")  # the CPU's own: bf16 where it has AVX512-BF16
    rows = bench_stacked(*args, tuple(s["phones_cpu"]), s["model"], "cpu", (cpu,), s["repeats"])
    if torch.cuda.is_available():
        cuda = bench_stacked(
            *args, tuple(s["phones_cuda"]), s["model"], "cuda", ("fp32", "bf16"), s["repeats"]
        )
        rows["rows"] += cuda["rows"]
        rows["text"] = cuda["text"]  # its largest P: the CPU's phones are its first ones
    return rows


def _step_transport(p: dict, work: Path, shared: dict) -> dict:
    t = p["transport"]
    return bench_transport(t["data"], t["repeats"], str(work / "transport"))


def _step_fleet_memory(p: dict, work: Path, shared: dict) -> dict:
    from fedkey_bench.perf.fleet_memory import measure_idle_phones

    return {"rows": [measure_idle_phones(n) for n in p["fleet_memory"]["phones"]]}


def _step_ray(p: dict, work: Path, shared: dict) -> dict:
    from fedkey_bench.perf.ray import bench_ray

    r = p["ray"]
    return bench_ray(r["args"].split(), r["repeats"], str(work / "ray"), r["workers"])


STEP_RUNNERS: dict[str, tuple[str, Callable[[dict, Path, dict], dict], Callable[[dict], str]]] = {
    "trainer": (
        "trainer tokens/s vs a bare PyTorch loop, interleaved",
        _step_trainer,
        lambda s: "; ".join(
            f"{d}: trainer {s[d]['trainer_tokens_per_s']} tokens/s, bare loop "
            f"{s[d]['bare_loop_tokens_per_s']}, ratio {s[d]['ratio']:.3f}"
            for d in ("cpu", "cuda")
            if d in s
        ),
    ),
    "http": (
        "fedkey run (HTTP) vs fedkey simulate, same workload, interleaved",
        _step_http,
        lambda s: (
            f"wall-time ratio {s['ratio_of_best']:.3f}, "
            f"per-round seconds ratio {s['round_seconds_ratio_of_best']:.3f}"
        ),
    ),
    "memory": (
        "aggregation time and peak memory vs the number of updates, fresh processes",
        _step_memory,
        lambda s: ", ".join(
            f"{r['strategy']} {r['updates']}: {r['peak_rss_mb']:.0f} MB {r['seconds']:.1f} s"
            for r in s["rows"]
        ),
    ),
    "keyboard": (
        "suggestion latency over the WebSocket and in chromium (wasm)",
        _step_keyboard,
        lambda s: (
            f"WS p50 {s['ws']['p50_ms']:.2f} ms, p99 {s['ws']['p99_ms']:.2f} ms; "
            f"wasm median {(s.get('wasm') or {}).get('median_ms', '-')} ms"
        ),
    ),
    "export": (
        "ONNX sizes fp32/int8 and the int8 perplexity change",
        _step_export,
        lambda s: (
            f"fp32 {s['fp32_bytes'] / 2**20:.2f} MB, int8 {s['int8_bytes'] / 2**20:.2f} MB, "
            f"perplexity {s['ppl_fp32']:.3f} -> {s['ppl_int8']:.3f} ({s['ppl_change_pct']:+.3f}%)"
        ),
    ),
    "transport": (
        "model download / update upload MB/s on loopback",
        _step_transport,
        lambda s: f"download {s['download_mb_per_s']} MB/s, upload {s['upload_mb_per_s']} MB/s",
    ),
    "precision": (
        "bf16 mixed precision vs fp32: trainer tokens/s, and a 10-round run's test perplexity",
        _step_precision,
        lambda s: "; ".join(
            [
                f"{d}: bf16 {v['bf16_tokens_per_s']} vs fp32 {v['fp32_tokens_per_s']} tokens/s, "
                f"{v['ratio']:.3f}x"
                for d, v in s["speed"].items()
            ]
            + [
                f"test perplexity bf16 {s['quality']['bf16']['test_ppl']:.3f} vs fp32 "
                f"{s['quality']['fp32']['test_ppl']:.3f} ({s['quality']['test_ppl_change_pct']:+.3f}%)"
            ]
        ),
    ),
    "gpu_share": (
        "phones training side by side on one GPU: aggregate tokens/s per pool size",
        _step_gpu_share,
        lambda s: (
            s.get("skipped")
            or ", ".join(
                f"{r['processes']}x {r['precision']} {r['tokens_per_s']}" for r in s["rows"]
            )
        ),
    ),
    "stacked": (
        "a round's phones trained one by one vs as one stacked model (--backend stacked)",
        _step_stacked,
        lambda s: ", ".join(
            f"{r['device']} {r['precision']} {r['phones']} phones {r['ratio']:.2f}x"
            + (f" (CUDA graphs {r['graphed_ratio']:.2f}x)" if r.get("graphed_ratio") else "")
            for r in s["rows"]
        ),
    ),
    "fleet_memory": (
        "idle phones long-polling in one Ray phone host: its RSS per phone",
        _step_fleet_memory,
        lambda s: ", ".join(
            f"{r['phones']} phones: {r['actor_rss_idle_peak_mb']:.0f} MB, {r['per_phone_kb']} KB each"
            for r in s["rows"]
        ),
    ),
    "ray": (
        "fedkey simulate --backend ray vs local, same workload, interleaved; Ray's start-up",
        _step_ray,
        lambda s: (
            f"per-round seconds ratio {s['round_seconds_ratio_of_best']:.3f}, wall-time ratio "
            f"{s['wall_ratio_of_best']:.3f}; start-up: Ray {s['startup']['ray_startup_seconds']} s"
            f" (ray.init {s['startup']['ray_init_seconds']} s), local pool "
            f"{s['startup']['local_pool_ready_seconds']} s"
        ),
    ),
}


def _describe(e: BaseException) -> str:
    text = "".join(traceback.format_exception(e))
    if isinstance(e, subprocess.CalledProcessError) and e.stderr:
        text += f"\n--- stderr of the command ---\n{e.stderr[-3000:]}"
    return text[-6000:]


def run_perf(
    quick: bool = False,
    out: str | Path = RESULTS / "perf" / "cpu",
    skip: list[str] | tuple[str, ...] = (),
    command: str = "fedkey-bench perf",
) -> dict:
    """Run every step of `fedkey-bench perf` not in `skip`, one progress line per step, and
    write `<out>/perf.json` and the page `<out>/../results.md` (after each step, so a stopped
    run leaves what it measured). A step that fails is recorded with its error; the others still run. A skipped
    step keeps its figures from the `<out>/perf.json` there was (:func:`kept_steps`), so one
    figure can be measured again without the half hour of the rest."""
    from datetime import UTC, datetime

    from fedkey_bench.perf.report import STEPS, write_report
    from fedkey_bench.perf.targets import targets

    unknown = sorted(set(skip) - set(STEPS))
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; the steps are {list(STEPS)}")
    params = perf_params(quick)
    kept = kept_steps(Path(out), quick)
    result: dict[str, Any] = {
        "meta": {
            "command": command,
            "quick": quick,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "machine": machine(),
            "seconds": 0.0,
        },
        "params": params,
        "steps": {},
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedkey-bench-perf-") as tmp:
        shared: dict = {}
        for i, name in enumerate(STEPS, 1):
            head = f"[{i}/{len(STEPS)}] {name}"
            what, runner, line = STEP_RUNNERS[name]
            if name in skip:
                result["steps"][name] = kept.get(name) or {"skipped": "--skip"}
                was = kept[name]["kept"]["date"] if name in kept else None
                kept_note = f", its figures of {was} kept" if was else ""
                print(f"{head}: skipped (--skip){kept_note}", flush=True)
                continue
            print(f"{head}: {what} ...", flush=True)
            t = time.perf_counter()
            try:
                figures = runner(params, Path(tmp), shared)
                figures["seconds"] = round(time.perf_counter() - t, 1)
                print(f"{head}: {line(figures)} ({figures['seconds']:.0f} s)", flush=True)
            except Exception as e:  # recorded in the report; the other steps still run
                figures = {"error": _describe(e), "seconds": round(time.perf_counter() - t, 1)}
                print(f"{head}: FAILED: {e!r}", flush=True)
            result["steps"][name] = figures
            result["meta"]["seconds"] = round(time.perf_counter() - start, 1)
            write_report(result, out)
    result["meta"]["seconds"] = round(time.perf_counter() - start, 1)
    json_path, md_path = write_report(result, out)
    result["targets"] = targets(result)
    for row in result["targets"]:
        print(f"  {row['status']:<8} {row['measure']}: {row['figure']} (target {row['target']})")
    print(f"total {result['meta']['seconds']:.0f} s; wrote {json_path} and {md_path}", flush=True)
    return result


def kept_steps(out: Path, quick: bool) -> dict[str, dict]:
    """The figures of the steps `<out>/perf.json` measured (not skipped, not failed), each with
    "kept": the date, commit and command that measured it. None from a run of the other size
    (--quick or not: other parameters) or where there is no readable perf.json."""
    try:
        previous = json.loads((out / "perf.json").read_text())
        meta = previous["meta"]
        steps = previous["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(meta, dict) or not isinstance(steps, dict) or meta.get("quick") != quick:
        return {}  # not a perf.json this bench wrote, or of the other size
    origin = {k: meta.get(k) for k in ("date", "git_commit", "command")}
    return {
        name: {**s, "kept": s.get("kept", origin)}
        for name, s in steps.items()
        if name in STEP_RUNNERS and isinstance(s, dict) and not {"skipped", "error"} & set(s)
    }


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
    pr = sub.add_parser("precision", help="trainer tokens/s under bf16 vs fp32")
    pr.add_argument("--vocab", type=int, default=10_000)
    pr.add_argument("--sentences", type=int, default=300)
    pr.add_argument("--repeats", type=int, default=3)
    pr.add_argument("--model", default="small")
    pr.add_argument("--device", default="cpu")
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
    ry = sub.add_parser("ray", help="simulate's round time with --backend ray vs local")
    ry.add_argument("--repeats", type=int, default=2)
    ry.add_argument("--workers", type=int, default=2, help="local processes and ray actors")
    ry.add_argument("--out", default="runs/bench-ray")
    ry.add_argument("--args", default=RAY_WORKLOAD, help="the workload, for both backends")
    rs = sub.add_parser("_ray_startup")  # internal: start-up seconds in a fresh process
    rs.add_argument("workers", type=int)
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
    elif args.cmd == "precision":
        result = bench_precision(args.vocab, args.sentences, args.repeats, args.model, args.device)
        print(json.dumps(result, indent=2))
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
    elif args.cmd == "ray":
        from fedkey_bench.perf.ray import bench_ray

        result = bench_ray(args.args.split(), args.repeats, args.out, args.workers)
        print(json.dumps(result, indent=2))
    elif args.cmd == "_ray_startup":
        from fedkey_bench.perf.ray import startup

        print(json.dumps(startup(args.workers)))
    else:
        print(json.dumps(_aggregate_once(args.strategy, args.updates, args.vocab)))


if __name__ == "__main__":
    main()
