"""The report of `fedkey-bench perf`: one folder per machine with its perf.json (every figure),
and one page beside them, results.md, with every machine's figures against the targets side by
side and then each machine's tables.

    experiments/results/perf/<machine>/perf.json    what `fedkey-bench perf --out` there wrote
    experiments/results/perf/results.md             every machine's (`python -m fedkey_bench.report DIR`)

No torch here: the report is written (and tested) from a plain result dict, the one
`fedkey_bench.perf.run_perf` builds: {"meta": {...}, "params": {...}, "steps": {name: figures, or
{"skipped": reason}, or {"error": message}}}.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from fedkey_bench.checkout import RESULTS
from fedkey_bench.perf_targets import targets

# The steps of `fedkey-bench perf`, in the order they run (also the names --skip takes).
STEPS = (
    "trainer",
    "http",
    "memory",
    "keyboard",
    "export",
    "transport",
    "precision",
    "gpu_share",
    "fleet_memory",
    "ray",
    "stacked",
)


def _text(figures: dict, params: dict) -> str:
    """What a trainer bench trained on (fedkey_bench.perf_measures._corpus); results from before it
    recorded that trained on random sentences."""
    return figures.get("text") or f"{params.get('sentences', '?')} random sentences of 8-29 words"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _not_run(result: dict, name: str) -> str | None:
    s = result.get("steps", {}).get(name)
    if s is None:
        return "not run"
    if "skipped" in s:
        return f"skipped: {s['skipped']}"
    if "error" in s:
        return f"**failed**: `{s['error'].strip().splitlines()[-1] if s['error'].strip() else ''}`"
    return None


def _kept_line(result: dict) -> list[str]:
    """The header's line on the steps this command skipped whose earlier figures it kept."""
    kept = [f"{n} ({k['date']}, commit `{(k.get('git_commit') or '?')[:10]}`)"
            for n, s in result.get("steps", {}).items() if (k := s.get("kept"))]  # fmt: skip
    return [f"Kept from earlier runs, not measured by this command: {', '.join(kept)}."] * bool(
        kept
    )


def markdown(result: dict) -> str:
    meta, params = result.get("meta", {}), result.get("params", {})
    m = meta.get("machine", {})
    out = [
        "# fedkey performance benchmark",
        "",
        f"`{meta.get('command', 'fedkey-bench perf')}` on {meta.get('date', '?')}, commit "
        f"`{meta.get('git_commit', '?')}`{' (with uncommitted changes)' if meta.get('git_dirty') else ''}.",
        f"Machine: {m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), torch "
        f"{m.get('torch', '?')}, device {m.get('device', '?')}, Python {m.get('python', '?')}. "
        f"Total {_fmt(meta.get('seconds'), '.0f')} s. Every figure is in `perf.json`.",
        *_kept_line(result),
        "",
        "## Targets",
        "",
        markdown_table(
            ["measure", "figure", "target", "status"],
            [[r["measure"], r["figure"], r["target"], r["status"]] for r in targets(result)],
        ),
        "",
        "Speed ratios are measured side by side in one run, interleaved, and compare the best "
        "repeat of each: the machine is shared and noisy. Peak memory is the whole process's "
        "peak RSS (VmHWM).",
    ]
    steps = result.get("steps", {})

    out += ["", "## 1. Local training: our trainer vs a bare PyTorch loop", ""]
    note = _not_run(result, "trainer")
    if note:
        out.append(note)
    else:
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
                    ", ".join(map(str, d["all_trainer"])),
                    ", ".join(map(str, d["all_bare"])),
                ]
            )
        out += [
            f"Model `{params.get('trainer', {}).get('model', 'small')}` (GRU, emb = hidden = 300, "
            f"tied), vocabulary {params.get('trainer', {}).get('vocab', '?')}, "
            f"{_text(s.get('cpu', {}), params.get('trainer', {}))}, "
            "batch 10, one epoch per repeat, one torch thread, fp32; tokens/s of the best repeat. "
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
                    "trainer, every repeat",
                    "bare, every repeat",
                ],
                rows,
            ),
        ]

    out += ["", "## 2. Federation over HTTP vs in-process", ""]
    note = _not_run(result, "http")
    if note:
        out.append(note)
    else:
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

    out += ["", "## 3. Streaming aggregation: time and peak memory vs the number of updates", ""]
    note = _not_run(result, "memory")
    if note:
        out.append(note)
    else:
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

    out += ["", "## 4. Suggestion latency (web keyboard)", ""]
    note = _not_run(result, "keyboard")
    if note:
        out.append(note)
    else:
        s = steps["keyboard"]
        ws, wasm = s["ws"], s.get("wasm") or {}
        mc = s.get("model_config", {})
        out += [
            f"GRU {mc.get('emb_size')}/{mc.get('hidden_size')}"
            f"{' tied' if mc.get('tied') else ''}, demo vocabulary {mc.get('vocab_size')}, fp32, "
            f"trained by `fedkey train-central --data demo --epochs "
            f"{params.get('model', {}).get('epochs', '?')}` (test perplexity "
            f"{_fmt(s.get('model_test_ppl'))}). Keystrokes type the demo test sentences "
            "character by character (`fedkey_bench/keyboard.py`).",
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

    out += ["", "## 5. Export: model sizes and int8", ""]
    note = _not_run(result, "export")
    if note:
        out.append(note)
    else:
        s = steps["export"]
        lf, li = s.get("latency_fp32", {}), s.get("latency_int8", {})
        out += [
            f"The same model as in 4, exported by `export_checkpoint` (fp32, and int8 dynamic "
            f"quantization); perplexity on the {s['held_out_sentences']} held-out demo test "
            "sentences; one-step latency in onnxruntime, one thread (`fedkey_bench/export.py`).",
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

    out += ["", "## 6. Model transfer on loopback", ""]
    note = _not_run(result, "transport")
    if note:
        out.append(note)
    else:
        s = steps["transport"]
        out += [
            f"`GET /v1/model` and `POST /v1/rounds/1/update` of the demo-vocabulary small model "
            f"({s['model_mb']} MB), {params.get('transport', {}).get('repeats', '?')} times each "
            f"(no target): download {s['download_mb_per_s']} MB/s, upload "
            f"{s['upload_mb_per_s']} MB/s; the first upload, validated and stored, took "
            f"{s['first_upload_validated_seconds']} s.",
        ]

    out += ["", "## 7. Mixed precision: bf16 vs fp32", ""]
    note = _not_run(result, "precision")
    if note:
        out.append(note)
    else:
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
                ", ".join(map(str, d["all_fp32"])),
                ", ".join(map(str, d["all_bf16"])),
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
            "batch 10, one epoch per repeat, one torch thread; tokens/s of the best repeat. "
            "`auto` is what `--precision auto` resolves to there (fedkey.models.precision).",
            "",
            markdown_table(
                [
                    "device",
                    "native bf16",
                    "auto",
                    "fp32 tokens/s",
                    "bf16 tokens/s",
                    "ratio",
                    "fp32, every repeat",
                    "bf16, every repeat",
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

    out += ["", "## 8. Phones side by side on one GPU", ""]
    note = _not_run(result, "gpu_share")
    if note:
        out.append(note)
    else:
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

    out += ["", "## 9. An idle phone's memory in a Ray phone host", ""]
    note = _not_run(result, "fleet_memory")
    if note:
        out.append(note)
    else:
        out += [
            "Enrolled phones long-polling the server as asyncio tasks in one phone-host actor "
            "(fedkey.device_sim.fleets.ray_fleet, fedkey_bench.fleet_memory); the actor's RSS before the phones and "
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

    out += ["", "## 10. Training on Ray vs the local pool", ""]
    note = _not_run(result, "ray")
    if note:
        out.append(note)
    else:
        s = steps["ray"]
        start = s["startup"]
        out += [
            "The same `fedkey simulate` with `--backend ray` (a private Ray instance, long-lived "
            "trainer actors) and `--backend local` (the process pool), interleaved:",
            "",
            markdown_table(
                ["backend", "summed per-round s, every repeat", "wall s, every repeat"],
                [
                    [
                        b,
                        ", ".join(map(str, s[f"{b}_round_seconds"])),
                        ", ".join(map(str, s[f"{b}_seconds"])),
                    ]
                    for b in ("ray", "local")
                ],
            ),
            "",
            f"Ratios of the best repeats, ray / local: per-round {s['round_seconds_ratio_of_best']:.3f}x,"
            f" wall {s['wall_ratio_of_best']:.3f}x. Start-up: Ray {start['ray_startup_seconds']} s"
            f" (ray.init {start['ray_init_seconds']} s, trainer actors ready "
            f"{start['ray_actors_ready_seconds']} s) against {start['local_pool_ready_seconds']} s "
            "for the local pool's processes.",
        ]

    out += ["", "## 11. A round's phones as one stacked model", ""]
    note = _not_run(result, "stacked")
    if note:
        out.append(note)
    else:
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

    failed = [n for n, s in steps.items() if "error" in s]
    if failed:
        out += ["", "## Failures", ""]
        for n in failed:
            out += [f"### {n}", "", "```", steps[n]["error"].rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


QUESTION = (
    "Does fedkey meet its performance targets: its trainer against a bare PyTorch loop, HTTP "
    "against in-process, aggregation memory, suggestion latency, the int8 model, bf16, the Ray "
    "phone host, a round's phones stacked on a GPU?"
)


#: "(1000 keystrokes)" and a skipped step's "(- keystrokes)": one row of the side-by-side table.
KEYSTROKES = re.compile(r"\((?:\d+|-) keystrokes\)")


def _cell(row: dict) -> str:
    """A machine's figure of one target, its verdict first."""
    if row["status"] in ("met", "not met"):
        return f"{row['status']}: {row['figure']}"
    return str(row["status"])


def _machine(result: dict) -> str:
    m = result.get("meta", {}).get("machine", {})
    return (f"{m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), device "
            f"{m.get('device', '?')}, torch {m.get('torch', '?')}")  # fmt: skip


def _details(result: dict) -> list[str]:
    """markdown(result) below its targets (the page has them side by side), a level down."""
    text = markdown(result)
    lines = text.split("\n## Targets", 1)[0].splitlines()[2:]  # the command, machine, kept
    start = text.find("\n## 1. ")
    sections = re.split(r"\n(?=## )", text[start:].strip()) if start >= 0 else []
    shown, skipped = [], []
    for section in sections:
        title, _, rest = section.partition("\n")
        if rest.strip().startswith(("skipped", "not run")) and "\n" not in rest.strip():
            skipped.append(f"- {title.removeprefix('## ')}: {rest.strip()}")
        else:
            shown += ["", "#" + section]
    if skipped:
        lines += ["", "Not measured here:", "", *skipped]
    return [*lines, *shown]


def page(machines: dict[str, dict]) -> str:
    """results.md: every machine's figures against the targets side by side, then each
    machine's tables. `machines`: folder name -> its perf.json."""
    names = sorted(machines, key=lambda n: (n != "cpu", n))
    rows: dict[str, dict] = {}  # measure -> {"target": ..., name: cell}
    for name in names:
        result = machines[name]
        for row in targets(result):  # today's targets, from the figures it recorded
            key = KEYSTROKES.sub("keystrokes)", row["measure"])  # a skipped step counts "-"
            rows.setdefault(key, {"measure": row["measure"], "target": row["target"]})
            rows[key][name] = _cell(row)
    out = [
        "# fedkey-bench perf: the system against its performance targets",
        "",
        QUESTION,
        "",
        "## Targets",
        "",
        markdown_table(
            ["measure", "target", *names],
            [[r["measure"], r["target"], *(r.get(n, "-") for n in names)] for r in rows.values()],
        ),
        "",
        "Speed ratios are measured side by side in one run, interleaved, and compare the best "
        "repeat of each: the machine is shared and noisy. Peak memory is the whole process's "
        "peak RSS (VmHWM). Skipped: not measured on that machine (no GPU, or left out by "
        "--skip / --only).",
        "",
        "## Machines",
        "",
        markdown_table(
            ["machine", "what it is", "date", "commit", "figures"],
            [
                [
                    n,
                    _machine(machines[n]),
                    machines[n].get("meta", {}).get("date", "?"),
                    f"`{(machines[n].get('meta', {}).get('git_commit') or '?')[:10]}`",
                    f"[`{n}/perf.json`]({n}/perf.json)",
                ]
                for n in names
            ],
        ),  # fmt: skip
        "",
        "Each machine's command, its parameters and every repeat are in its perf.json. A new "
        "machine: `fedkey-bench perf --out experiments/results/perf/<machine>`; the page is "
        "rebuilt from every perf.json here (`python -m fedkey_bench.report experiments/results/perf`).",
    ]
    for name in names:
        out += ["", f"## {name}: {_machine(machines[name])}", "", *_details(machines[name])]
    return "\n".join(out).rstrip() + "\n"


def rebuild(folder: str | Path) -> Path:
    """FOLDER/results.md from every FOLDER/<machine>/perf.json; -> its path."""
    folder = Path(folder)
    machines = {p.parent.name: json.loads(p.read_text()) for p in folder.glob("*/perf.json")}
    path = folder / "results.md"
    path.write_text(page(machines))
    return path


def write_report(result: dict, out: str | Path) -> tuple[Path, Path]:
    """Write `<out>/perf.json` (OUT: this machine's folder, e.g. experiments/results/perf/cpu)
    and rebuild the page beside the machines' folders, `<out>/../results.md`; their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "targets": targets(result)}
    json_path = out / "perf.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    return json_path, rebuild(out.parent)


if __name__ == "__main__":  # python -m fedkey_bench.report experiments/results/perf
    print(rebuild(sys.argv[1] if len(sys.argv) > 1 else RESULTS / "perf"))
