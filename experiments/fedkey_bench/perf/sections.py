"""The sections of a machine's perf page, one per step of `fedkey-bench perf`: each takes the
step's figures in perf.json and gives its text and tables (a step not measured: one line
saying why, written by the page)."""

from __future__ import annotations

from fedkey_bench.common.markdown import markdown_table


def _text(figures: dict, params: dict) -> str:
    """What a trainer bench trained on (fedkey_bench.perf.measures._corpus); results from before it
    recorded that trained on random sentences."""
    return figures.get("text") or f"{params.get('sentences', '?')} random sentences of 8-29 words"


def _fmt(v, spec: str = ".2f") -> str:
    """A figure, or '-' for none."""
    return "-" if v is None else format(v, spec)


def trainer(result: dict) -> list[str]:
    """The trainer step's figures."""
    steps, params = result["steps"], result.get("params", {})
    out: list[str] = []
    s = steps["trainer"]
    rows = []
    for device in ("cpu", "cuda"):
        d = s.get(device)
        if not d:
            continue
        rows.append(
            [
                device,
                d["trainer_tokens_per_s"],
                d["bare_loop_tokens_per_s"],
                f"{d['ratio']:.3f}",
            ]
        )
    out += [
        f"Model `{params.get('trainer', {}).get('model', 'small')}` (GRU, emb = hidden = 300, "
        f"tied), vocabulary {params.get('trainer', {}).get('vocab', '?')}, "
        f"{_text(s.get('cpu', {}), params.get('trainer', {}))}, "
        "batch 10, one epoch per repeat, one torch thread, fp32; tokens/s of the best repeat "
        "(every repeat's: perf.json). "
        "The bare loop runs the softmax layer on every position of the padded batches, the "
        "trainer on the real words only (`LanguageModel.logits_at`): a ratio above 1 is the "
        "padding skipped, less the trainer's overhead.",
        "",
        markdown_table(
            [
                "device",
                "trainer tokens/s",
                "bare loop tokens/s",
                "ratio",
            ],
            rows,
        ),
    ]
    return out


def http(result: dict) -> list[str]:
    """The http step's figures."""
    steps = result["steps"]
    out: list[str] = []
    s = steps["http"]
    rows = [
        [i + 1, f"{a:.1f}", f"{b:.1f}", f"{c:.1f}", f"{d:.1f}"]
        for i, (a, b, c, d) in enumerate(
            zip(
                s["simulate_seconds"],
                s["http_seconds"],
                s["simulate_round_seconds"],
                s["http_round_seconds"],
                strict=True,
            )
        )
    ]
    out += [
        f"The same workload (`{s['args']}`) run by `fedkey simulate` and by `fedkey run` (a "
        "server process and the phones over loopback HTTP), alternately. Wall time is the "
        "whole command; the per-round seconds are the sum of `seconds` in each run's "
        "`metrics.jsonl`, which leaves out the start-up of the processes.",
        "",
        markdown_table(
            [
                "repeat",
                "simulate wall s",
                "run (HTTP) wall s",
                "simulate rounds s",
                "run (HTTP) rounds s",
            ],
            rows,
        ),
        "",
        f"Ratio of the best: wall time {s['ratio_of_best']:.3f}x, per-round seconds "
        f"{s['round_seconds_ratio_of_best']:.3f}x.",
    ]
    return out


def memory(result: dict) -> list[str]:
    """The memory step's figures."""
    steps, params = result["steps"], result.get("params", {})
    out: list[str] = []
    s = steps["memory"]
    rows = [
        [
            r["strategy"],
            r["updates"],
            f"{r['seconds']:.2f}",
            f"{r['peak_rss_mb']:.1f}",
            f"{r['peak_rss_mb'] - r['rss_before_mb']:.1f}",
        ]
        for r in s["rows"]
    ]
    model_mb = s["rows"][0]["model_mb"] if s["rows"] else "?"
    out += [
        f"Each measurement in a fresh process: the small model (vocabulary "
        f"{params.get('memory', {}).get('vocab', '?')}, {model_mb} MB of weights) and N "
        "updates generated one at a time, as the server reads them from disk. Seconds "
        "include generating the updates. Peak RSS is the whole process (Python and torch "
        "included); the last column is the peak above the RSS before aggregating.",
        "",
        markdown_table(
            ["strategy", "updates", "seconds", "peak RSS MB", "peak above start MB"],
            rows,
        ),
    ]
    return out


def keyboard(result: dict) -> list[str]:
    """The keyboard step's figures."""
    steps, params = result["steps"], result.get("params", {})
    out: list[str] = []
    s = steps["keyboard"]
    ws, wasm = s["ws"], s.get("wasm") or {}
    mc = s.get("model_config", {})
    out += [
        f"GRU {mc.get('emb_size')}/{mc.get('hidden_size')}"
        f"{' tied' if mc.get('tied') else ''}, demo vocabulary {mc.get('vocab_size')}, fp32, "
        f"trained by `fedkey train-central --data demo --epochs "
        f"{params.get('model', {}).get('epochs', '?')}` (test perplexity "
        f"{_fmt(s.get('model_test_ppl'))}). Keystrokes type the demo test sentences "
        "character by character (`fedkey_bench/perf/keyboard.py`).",
        "",
        markdown_table(
            ["path", "keystrokes", "p50 ms", "p90 ms", "p99 ms", "max ms"],
            [
                [
                    "WebSocket round trip (Python client)",
                    ws["n"],
                    _fmt(ws["p50_ms"]),
                    _fmt(ws["p90_ms"]),
                    _fmt(ws["p99_ms"]),
                    _fmt(ws["max_ms"]),
                ]
            ]
            + [
                [
                    label,
                    w["n"],
                    _fmt(w["p50_ms"]),
                    _fmt(w["p90_ms"]),
                    _fmt(w["p99_ms"]),
                    _fmt(w["max_ms"]),
                ]
                for label, w in (
                    ("in-browser wasm, all keystrokes", wasm.get("all")),
                    ("in-browser wasm, with a model step", wasm.get("with_model_call")),
                    ("WebSocket from inside chromium", wasm.get("server_ws_from_chromium")),
                )
                if w
            ],
        ),
    ]
    if "skipped" in wasm:
        out += ["", f"In-browser mode skipped: {wasm['skipped']}."]
    elif wasm:
        out += [
            "",
            f"Chromium {wasm.get('chromium')}; the in-browser model loaded in "
            f"{_fmt(wasm.get('model_load_ms'), '.0f')} ms. `performance.now()` in chromium "
            "has 0.1 ms resolution.",
        ]
    return out


def export(result: dict) -> list[str]:
    """The export step's figures."""
    steps = result["steps"]
    out: list[str] = []
    s = steps["export"]
    lf, li = s.get("latency_fp32", {}), s.get("latency_int8", {})
    out += [
        f"The same model as in 4, exported by `export_checkpoint` (fp32, and int8 dynamic "
        f"quantization); perplexity on the {s['held_out_sentences']} held-out demo test "
        "sentences; one-step latency in onnxruntime, one thread (`fedkey_bench/perf/export.py`).",
        "",
        markdown_table(
            ["model", "file MB", "held-out perplexity", "one step p50 ms", "one step p90 ms"],
            [
                [
                    "fp32",
                    f"{s['fp32_bytes'] / 2**20:.2f}",
                    _fmt(s["ppl_fp32"], ".3f"),
                    _fmt(lf.get("p50_ms"), ".3f"),
                    _fmt(lf.get("p90_ms"), ".3f"),
                ],
                [
                    "int8",
                    f"{s['int8_bytes'] / 2**20:.2f}",
                    _fmt(s["ppl_int8"], ".3f"),
                    _fmt(li.get("p50_ms"), ".3f"),
                    _fmt(li.get("p90_ms"), ".3f"),
                ],
            ],
        ),
        "",
        f"int8 perplexity change {s['ppl_change_pct']:+.3f}%, size "
        f"{s['int8_bytes'] / s['fp32_bytes']:.2f}x of fp32, top-1 agreement with fp32 "
        f"{_fmt(s.get('top1_agreement'), '.3f')}.",
    ]
    return out


def transport(result: dict) -> list[str]:
    """The transport step's figures."""
    steps, params = result["steps"], result.get("params", {})
    out: list[str] = []
    s = steps["transport"]
    out += [
        f"`GET /v1/model` and `POST /v1/rounds/1/update` of the demo-vocabulary small model "
        f"({s['model_mb']} MB), {params.get('transport', {}).get('repeats', '?')} times each "
        f"(no target): download {s['download_mb_per_s']} MB/s, upload "
        f"{s['upload_mb_per_s']} MB/s; the first upload, validated and stored, took "
        f"{s['first_upload_validated_seconds']} s.",
    ]
    return out


def precision(result: dict) -> list[str]:
    """The precision step's figures."""
    steps, params = result["steps"], result.get("params", {})
    out: list[str] = []
    s = steps["precision"]
    q = params.get("precision", {})
    rows = [
        [
            device,
            "yes" if d["native_bf16"] else "no",
            d["auto"],
            d["fp32_tokens_per_s"],
            d["bf16_tokens_per_s"],
            f"{d['ratio']:.3f}",
        ]
        for device, d in s["speed"].items()
    ]
    qs = s["quality"]
    runs = [
        [
            precision,
            f"{r['train_precision']} / {r['eval_precision']}",
            _fmt(r["val_ppl"], ".3f"),
            _fmt(r["test_ppl"], ".3f"),
            _fmt(r["best_test_ppl"], ".3f"),
            f"{r['round_seconds']:.1f}",
            f"{r['wall_seconds']:.1f}",
        ]
        for precision, r in ((p, qs[p]) for p in ("fp32", "bf16"))
    ]
    out += [
        "The local trainer (`fedkey.device_sim.training.trainer.train_local`) under `--precision fp32` and "
        "`bf16` (fp32 master weights, loss, gradients and optimizer; on the GPU bf16 "
        "autocast on the forward; on the CPU fedkey.device_sim.training.bf16_cpu's step: the recurrence "
        "written out in bf16, longest sentences first. That step alone, in fp32 arithmetic, "
        "is about 1.17x torch's GRU, so bf16 on the same step is about 1.7x fp32), "
        f"interleaved: model `{q.get('model', 'small')}` (GRU 300, tied), vocabulary "
        f"{q.get('vocab', '?')}, {_text(s['speed'].get('cpu', {}), q)}, "
        "batch 10, one epoch per repeat, one torch thread; tokens/s of the best repeat "
        "(every repeat's: perf.json). `auto` is what `--precision auto` resolves to there (fedkey.models.precision).",
        "",
        markdown_table(
            [
                "device",
                "native bf16",
                "auto",
                "fp32 tokens/s",
                "bf16 tokens/s",
                "ratio",
            ],
            rows,
        ),
        "",
        f"Then the same federation, `fedkey simulate {qs['args']}`, once with each "
        "precision (training and evaluation); the last round's perplexities:",
        "",
        markdown_table(
            [
                "--precision",
                "train / eval",
                "val ppl",
                "test ppl",
                "best-val model's test ppl",
                "rounds s",
                "wall s",
            ],
            runs,
        ),
        "",
        f"Test perplexity bf16 vs fp32: {qs['test_ppl_change_pct']:+.3f}%.",
    ]
    return out


def gpu_share(result: dict) -> list[str]:
    """The gpu_share step's figures."""
    steps = result["steps"]
    out: list[str] = []
    s = steps["gpu_share"]
    cpu = (steps.get("trainer") or {}).get("cpu", {}).get("trainer_tokens_per_s")
    out += [
        f"The training pool (fedkey.device_sim.training.process_pool) on one GPU ({s['gpu']}): P processes, each "
        f"with its own CUDA context, train 2P phones of {_text(s, s)} "
        f"(model `{s['model']}`, vocabulary {s['vocab']}, batch 10, one epoch); tokens/s of "
        "all the phones over the batch's wall time"
        + (f", and against one CPU trainer of step 1 ({cpu} tokens/s, fp32)" if cpu else "")
        + ":",
        "",
        markdown_table(
            ["processes", "precision", "phones", "s", "tokens/s"]
            + (["x one CPU trainer"] if cpu else []),
            [
                [r["processes"], r["precision"], r["phones"], r["seconds"], r["tokens_per_s"]]
                + ([f"{r['tokens_per_s'] / cpu:.1f}"] if cpu else [])
                for r in s["rows"]
            ],
        ),
        "",
        f"Best: {s['best']['processes']} processes, {s['best']['precision']}, "
        f"{s['speedup_over_one_process']:.2f}x one process.",
    ]
    return out


def fleet_memory(result: dict) -> list[str]:
    """The fleet_memory step's figures."""
    steps = result["steps"]
    out: list[str] = []
    out += [
        "Enrolled phones long-polling the server as asyncio tasks in one phone-host actor "
        "(fedkey.device_sim.fleets.ray_fleet, fedkey_bench.perf.fleet_memory); the actor's RSS before the phones and "
        "its peak while they idle:",
        "",
        markdown_table(
            ["phones", "empty MB", "idle peak MB", "KB per phone", "enrolled in s", "errors"],
            [
                [
                    f"{r['phones']:,}",
                    r["actor_rss_empty_mb"],
                    r["actor_rss_idle_peak_mb"],
                    r["per_phone_kb"],
                    r["enroll_seconds"],
                    len(r["phone_errors"]),
                ]
                for r in steps["fleet_memory"]["rows"]
            ],
        ),
    ]
    return out


def ray(result: dict) -> list[str]:
    """The ray step's figures."""
    steps = result["steps"]
    out: list[str] = []
    s = steps["ray"]
    start = s["startup"]
    out += [
        "The same `fedkey simulate` with `--backend ray` (a private Ray instance, long-lived "
        "trainer actors) and `--backend local` (the process pool), interleaved (every repeat's "
        "seconds: perf.json):",
        "",
        markdown_table(
            ["backend", "summed per-round s, best repeat", "wall s, best repeat"],
            [[b, min(s[f"{b}_round_seconds"]), min(s[f"{b}_seconds"])] for b in ("ray", "local")],
        ),
        "",
        f"Ratios of the best repeats, ray / local: per-round {s['round_seconds_ratio_of_best']:.3f}x,"
        f" wall {s['wall_ratio_of_best']:.3f}x. Start-up: Ray {start['ray_startup_seconds']} s"
        f" (ray.init {start['ray_init_seconds']} s, trainer actors ready "
        f"{start['ray_actors_ready_seconds']} s) against {start['local_pool_ready_seconds']} s "
        "for the local pool's processes.",
    ]
    return out


def stacked(result: dict) -> list[str]:
    """The stacked step's figures."""
    steps = result["steps"]
    out: list[str] = []
    s = steps["stacked"]
    out += [
        f"P phones of {s['sentences_per_phone']} sentences each ({s['text']}; model "
        f"`{s['model']}`, vocabulary {s['vocab']}, batch 10, one epoch), trained one after "
        "another by one trainer (`train_local`, as a pool process trains them) and all at "
        "once as one stacked model (`--backend stacked`, fedkey.device_sim.training.stacked; eager, and on a "
        "GPU also with each step shape captured in a CUDA graph, what the backend runs "
        "there), interleaved; tokens/s of the best repeat:",
        "",
        markdown_table(
            [
                "device",
                "precision",
                "phones",
                "one by one tokens/s",
                "stacked tokens/s",
                "ratio",
                "CUDA graphs tokens/s",
                "ratio",
            ],  # fmt: skip
            [
                [
                    r["device"],
                    r["precision"],
                    r["phones"],
                    r["one_by_one_tokens_per_s"],
                    r["stacked_tokens_per_s"],
                    f"{r['ratio']:.2f}x",
                    _fmt(r.get("graphed_tokens_per_s"), "d"),
                    _fmt(r.get("graphed_ratio")) + ("x" if r.get("graphed_ratio") else ""),
                ]
                for r in s["rows"]
            ],
        ),
    ]
    return out


#: The steps of `fedkey-bench perf` in the order they run (the names --skip takes), each with
#: its section's title and writer.
SECTIONS = (
    ("trainer", "Local training: fedkey's trainer vs a bare PyTorch loop", trainer),
    ("http", "Federation over HTTP vs in-process", http),
    ("memory", "Streaming aggregation: time and peak memory vs the number of updates", memory),
    ("keyboard", "Suggestion latency (web keyboard)", keyboard),
    ("export", "Export: model sizes and int8", export),
    ("transport", "Model transfer on loopback", transport),
    ("precision", "Mixed precision: bf16 vs fp32", precision),
    ("gpu_share", "Phones side by side on one GPU", gpu_share),
    ("fleet_memory", "An idle phone's memory in a Ray phone host", fleet_memory),
    ("ray", "Training on Ray vs the local pool", ray),
    ("stacked", "A round's phones as one stacked model", stacked),
)
