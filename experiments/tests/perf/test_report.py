"""`fedkey-bench perf`: the report says met / not met right; the command parses; no benchmark runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkey_bench.perf.report import STEPS, write_report
from fedkey_bench.perf.targets import targets


def _mem(strategy: str, updates: int, peak: float) -> dict:
    return {
        "strategy": strategy,
        "updates": updates,
        "model_mb": 13.5,
        "peak_rss_mb": peak,
        "rss_before_mb": 250.0,
        "seconds": 0.1 * updates,
    }


def _trainer(ratio: float) -> dict:
    return {
        "trainer_tokens_per_s": round(1000 * ratio),
        "bare_loop_tokens_per_s": 1000,
        "ratio": ratio,
        "all_trainer": [round(1000 * ratio)],
        "all_bare": [1000],
    }


def _latency(p50: float, p99: float, n: int = 1000) -> dict:
    return {"n": n, "p50_ms": p50, "p90_ms": p50, "p99_ms": p99, "max_ms": p99, "mean_ms": p50}


FAKE = {
    "meta": {
        "command": "fedkey-bench perf",
        "date": "2026-01-01T00:00:00+00:00",
        "git_commit": "abc123",
        "git_dirty": False,
        "machine": {"cpus": 2, "torch": "2.13.0+cpu", "device": "cpu"},
        "seconds": 600.0,
    },
    "params": {"model": {"epochs": 2}},
    "steps": {
        "trainer": {"cpu": _trainer(0.95), "cuda": _trainer(0.5)},
        "http": {
            "args": "--data demo",
            "simulate_seconds": [50.0, 51.0],
            "http_seconds": [55.0, 56.0],
            "simulate_round_seconds": [35.0, 36.0],
            "http_round_seconds": [35.5, 36.5],
            "ratio_of_best": 1.1,
            "round_seconds_ratio_of_best": 1.014,
        },
        "memory": {
            "rows": [
                _mem("fedavg", 10, 400.0),
                _mem("fedavg", 50, 405.0),
                _mem("fedavg", 200, 410.0),
                _mem("fedatt", 10, 400.0),
                _mem("fedatt", 50, 420.0),
                _mem("fedatt", 200, 500.0),  # 1.25x: not met
            ]
        },
        "keyboard": {
            "model_config": {"emb_size": 300, "hidden_size": 300, "tied": True, "vocab_size": 99},
            "ws": _latency(0.3, 1.0),
            "wasm": {
                "median_ms": 12.0,  # not met
                "all": _latency(12.0, 20.0, 300),
                "with_model_call": _latency(2.0, 4.0, 60),
                "server_ws_from_chromium": _latency(1.0, 2.0, 280),
                "model_load_ms": 700.0,
                "chromium": "1.0",
            },
        },
        "export": {
            "held_out_sentences": 807,
            "fp32_bytes": 4 * 2**20,
            "int8_bytes": 2 * 2**20,
            "ppl_fp32": 100.0,
            "ppl_int8": 100.5,
            "ppl_change_pct": 0.5,
            "top1_agreement": 0.99,
            "latency_fp32": {"p50_ms": 0.5, "p90_ms": 0.6},
            "latency_int8": {"p50_ms": 0.6, "p90_ms": 0.7},
        },
        "transport": {
            "model_mb": 4.1,
            "download_mb_per_s": 500.0,
            "upload_mb_per_s": 400.0,
            "first_upload_validated_seconds": 0.1,
        },
        "precision": {
            "speed": {
                "cpu": {
                    "native_bf16": True,
                    "auto": "bf16",
                    "fp32_tokens_per_s": 2000,
                    "bf16_tokens_per_s": 4200,
                    "ratio": 2.1,
                    "all_fp32": [2000],
                    "all_bf16": [4200],
                },
                "cuda": {
                    "native_bf16": True,
                    "auto": "bf16",
                    "fp32_tokens_per_s": 90000,
                    "bf16_tokens_per_s": 100000,
                    "ratio": 1.111,  # not met
                    "all_fp32": [90000],
                    "all_bf16": [100000],
                },
            },
            "quality": {
                "args": "--data demo --rounds 10",
                **{
                    p: {
                        "rounds": 10,
                        "val_ppl": 150.0,
                        "test_ppl": ppl,
                        "best_test_ppl": ppl,
                        "train_precision": p,
                        "eval_precision": p,
                        "wall_seconds": 100.0,
                        "round_seconds": 90.0,
                    }
                    for p, ppl in (("fp32", 140.0), ("bf16", 140.7))
                },
                "test_ppl_change_pct": 0.5,
            },
        },
        "gpu_share": {
            "gpu": "NVIDIA H200",
            "model": "small",
            "vocab": 10_000,
            "sentences": 600,
            "rows": [
                {
                    "processes": p,
                    "precision": "fp32",
                    "phones": 2 * p,
                    "tokens": 22_800 * p,
                    "seconds": 1.0,
                    "tokens_per_s": 22_800 * p,
                }
                for p in (1, 2, 4)
            ],
            "best": {"processes": 4, "precision": "fp32", "tokens_per_s": 91_200},
            "speedup_over_one_process": 4.0,
        },
        "fleet_memory": {
            "rows": [
                {
                    "phones": n,
                    "poll_wait_s": 25.0,
                    "enroll_seconds": 3.0,
                    "actor_rss_empty_mb": 287.0,
                    "actor_rss_idle_peak_mb": peak,
                    "actor_rss_idle_last_mb": peak,
                    "per_phone_kb": kb,
                    "under_1_gb": peak < 1024,
                    "phone_errors": [],
                }
                for n, peak, kb in ((1000, 305.1, 18.8), (10_000, 1100.0, 83.3))  # not met
            ]
        },
        "ray": {
            "local_seconds": [146.0, 150.0],
            "ray_seconds": [109.0, 140.0],
            "local_round_seconds": [119.8, 209.0],
            "ray_round_seconds": [85.3, 140.0],
            "round_seconds_ratio_of_best": 0.712,
            "wall_ratio_of_best": 0.747,
            "startup": {
                "ray_init_seconds": 6.4,
                "ray_actors_ready_seconds": 4.2,
                "ray_shutdown_seconds": 1.0,
                "ray_startup_seconds": 10.6,
                "local_pool_ready_seconds": 4.5,
            },
        },
        "stacked": {
            "model": "small",
            "vocab": 10_000,
            "sentences_per_phone": 40,
            "text": "PTB's first 2000 training sentences, 40 to a phone",
            "rows": [
                {
                    "device": d,
                    "precision": "fp32",
                    "phones": 10,
                    "tokens": 8_000,
                    "one_by_one_tokens_per_s": one,
                    "stacked_tokens_per_s": stacked,
                    "ratio": round(stacked / one, 3),
                }
                for d, one, stacked in (("cpu", 3_000, 1_350), ("cuda", 25_000, 200_000))
            ],
        },
    },
}

EXPECTED = {
    "trainer tokens/s vs bare PyTorch loop (cpu)": "met",
    "trainer tokens/s vs bare PyTorch loop (cuda)": "not met",
    "HTTP (`fedkey run`) vs in-process (`fedkey simulate`), wall time": "not met",
    "HTTP vs in-process, summed per-round seconds": "met",
    "FedAtt peak memory at 200 updates vs 10": "not met",
    "FedAvg peak memory at 200 updates vs 10": "met",
    "suggestion latency over the WebSocket, p99 (1000 keystrokes)": "met",
    "in-browser (wasm) median, all keystrokes": "not met",
    "in-browser (wasm) median, keystrokes with a model step": "met",
    "int8 perplexity change on held-out text": "met",
    "trainer tokens/s, bf16 vs fp32 (cpu)": "met",
    "trainer tokens/s, bf16 vs fp32 (cuda)": "not met",
    "test perplexity, bf16 vs fp32 (the same 10-round run)": "met",
    "phones side by side on one GPU: best pool's tokens/s vs one process": "met",
    "10,000 idle phones in one Ray phone host, the actor's peak RSS": "not met",
    "`--backend ray` vs `local`, summed per-round seconds (same simulate)": "met",
}


def _targets_table(md: str) -> dict[str, str]:
    """measure -> status (of the last machine's column), read back from the page's Targets
    table, whose cells read "met: 1.100x", "not met: ...", "skipped", "failed"."""
    lines = md.split("## Targets", 1)[1].strip().splitlines()
    rows = {}
    for line in lines[2:]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0]] = cells[-1].split(":", 1)[0]
    return rows


def test_markdown_says_met_and_not_met(tmp_path):
    json_path, md_path = write_report(FAKE, tmp_path / "cpu")
    assert json_path == tmp_path / "cpu" / "perf.json" and md_path == tmp_path / "results.md"
    md = md_path.read_text()
    assert md.startswith("# fedkey-bench perf") and md.index("## Targets") < md.index("## 1.")
    assert _targets_table(md) == EXPECTED
    saved = json.loads(json_path.read_text())
    assert saved["steps"] == FAKE["steps"] and saved["meta"] == FAKE["meta"]
    assert {r["measure"]: r["status"] for r in saved["targets"]} == EXPECTED
    for figure in (
        "1.100x",
        "1.250x",
        "1.00 ms",
        "+0.500%",
        "12.00 ms",
        "2.100x",
        "140.700",
        "0.712x",
        "1100 MB",
        "83.3",
        "10.6 s",
        "| cuda | fp32 | 10 | 25000 | 200000 | 8.00x | - | - |",
        "| cpu | fp32 | 10 | 3000 | 1350 | 0.45x | - | - |",
    ):
        assert figure in md
    assert "Failures" not in md


def test_skipped_and_failed_steps_are_neither_met_nor_not_met(tmp_path):
    steps = {
        **FAKE["steps"],
        "http": {"skipped": "--skip"},
        "export": {"error": "Traceback ...\nRuntimeError: the export broke\n"},
    }
    del steps["keyboard"]  # never ran (a stopped run)
    _, md_path = write_report({**FAKE, "steps": steps}, tmp_path / "cpu")
    table = _targets_table(md_path.read_text())
    assert table["HTTP vs in-process, summed per-round seconds"] == "skipped"
    assert table["int8 perplexity change on held-out text"] == "failed"
    assert table["in-browser (wasm) median, all keystrokes"] == "skipped"
    assert table["trainer tokens/s vs bare PyTorch loop (cpu)"] == "met"
    assert "RuntimeError: the export broke" in md_path.read_text()


def test_wasm_skipped_when_chromium_is_missing():
    steps = {**FAKE["steps"], "keyboard": {**FAKE["steps"]["keyboard"], "wasm": {"skipped": "x"}}}
    rows = {r["measure"]: r["status"] for r in targets({**FAKE, "steps": steps})}
    assert rows["in-browser (wasm) median, all keystrokes"] == "skipped"
    assert rows["suggestion latency over the WebSocket, p99 (1000 keystrokes)"] == "met"


def test_the_gpu_step_says_why_it_skipped_where_no_gpu_is_visible(monkeypatch, tmp_path):
    import torch

    from fedkey_bench.perf.runner import perf_params, run_perf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "gpu_share" in perf_params(quick=True)
    others = [s for s in STEPS if s != "gpu_share"]
    result = run_perf(out=tmp_path / "cpu", skip=others, command="fedkey-bench perf")
    assert result["steps"]["gpu_share"]["skipped"] == "no CUDA GPU visible"
    md = (tmp_path / "results.md").read_text()
    assert "- 8. Phones side by side on one GPU: skipped: no CUDA GPU visible" in md
    rows = _targets_table(md)
    assert rows["phones side by side on one GPU: best pool's tokens/s vs one process"] == "skipped"


def test_every_step_skipped_writes_a_report(tmp_path):
    from fedkey_bench.perf.runner import run_perf

    result = run_perf(out=tmp_path / "cpu", skip=STEPS, command="fedkey-bench perf --skip ...")
    assert all(s == {"skipped": "--skip"} for s in result["steps"].values())
    saved = json.loads((tmp_path / "cpu" / "perf.json").read_text())
    assert saved["meta"]["machine"]["cpus"] >= 1 and saved["meta"]["machine"]["torch"]
    assert set(_targets_table((tmp_path / "results.md").read_text()).values()) == {"skipped"}
    with pytest.raises(ValueError, match="unknown step"):
        run_perf(out=tmp_path / "cpu", skip=["nope"])


def test_a_skipped_step_keeps_its_earlier_figures_with_their_date(tmp_path):
    """Measuring one figure again (`--only precision`) must not wipe the others from the report:
    each is kept from the perf.json there was, marked with the run that measured it."""
    from fedkey_bench.perf.runner import kept_steps, run_perf

    machine = tmp_path / "cpu"
    machine.mkdir()
    (machine / "perf.json").write_text(
        json.dumps({**FAKE, "meta": {**FAKE["meta"], "quick": False}})
    )
    result = run_perf(out=machine, skip=STEPS, command="fedkey-bench perf --only ray")
    origin = {
        "date": "2026-01-01T00:00:00+00:00",
        "git_commit": "abc123",
        "command": "fedkey-bench perf",
    }
    assert result["steps"]["trainer"] == {**FAKE["steps"]["trainer"], "kept": origin}
    assert result["steps"]["http"]["kept"] == origin
    md = (tmp_path / "results.md").read_text()
    assert (
        "Kept from earlier runs, not measured by this command: trainer (2026-01-01T00:00:00+00:00, commit `abc123`), http ("
        in md
    )
    assert _targets_table(md)["trainer tokens/s vs bare PyTorch loop (cpu)"] == "met"
    # kept again by the next such run: still the date of the run that measured it
    again = run_perf(out=machine, skip=STEPS, command="fedkey-bench perf --only ray")
    assert again["steps"]["trainer"]["kept"] == origin
    # a --quick run's figures (other parameters) are not kept for a full run, nor the reverse
    quick = run_perf(out=machine, quick=True, skip=STEPS)
    assert quick["steps"]["trainer"] == {"skipped": "--skip"}
    # nor anything from a file this bench did not write
    for text in ("[]", '{"meta": [], "steps": {}}', '{"meta": {}, "steps": []}', "{not json"):
        (machine / "perf.json").write_text(text)
        assert kept_steps(machine, quick=False) == {}


def test_bench_perf_only_and_skip_together_is_a_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from fedkey_bench.cli import app

    res = CliRunner().invoke(
        app, ["perf", "--only", "ray", "--skip", "http", "--out", str(tmp_path)]
    )
    assert res.exit_code != 0 and "give --skip or --only, not both" in res.output
    assert not (tmp_path / "perf.json").exists()


def test_bench_perf_help():
    from fedkey_bench.cli import BenchStep, app

    result = CliRunner().invoke(app, ["perf", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--quick", "--out", "--skip"):
        assert option in result.output
    assert tuple(s.value for s in BenchStep) == STEPS
    bad = CliRunner().invoke(app, ["perf", "--skip", "nope"])
    assert bad.exit_code != 0


def test_the_committed_machines_share_one_short_page_that_leads_with_the_targets(tmp_path):
    """experiments/results/perf: one folder per machine (its perf.json), one page for them all,
    each machine's figure of a target side by side."""
    import shutil

    from fedkey_bench.perf.report import rebuild

    committed = Path(__file__).resolve().parents[2] / "results" / "perf"
    machines = sorted(p.parent.name for p in committed.glob("*/perf.json"))
    assert "cpu" in machines and len(machines) >= 2
    for name in machines:
        (tmp_path / name).mkdir()
        shutil.copy(committed / name / "perf.json", tmp_path / name / "perf.json")
    md = rebuild(tmp_path).read_text()
    assert len(md.encode()) <= 30 * 1024
    assert md.startswith("# fedkey-bench perf") and md.index("## Targets") < md.index("## Machines")
    header = md.split("## Targets", 1)[1].strip().splitlines()[0]
    assert header == "| measure | target | " + " | ".join(["cpu", *machines[1:]]) + " |"
    for name in machines:
        assert f"[`{name}/perf.json`]({name}/perf.json)" in md and f"\n## {name}: " in md
    assert _targets_table(md)  # every machine's status, read back
