"""The targets of `fedkey-bench perf`: one row per target, from the plain result dict that
fedkey_bench.perf.runner.run_perf builds (fedkey_bench.perf.report writes it out). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable

MET, NOT_MET, SKIPPED, FAILED = "met", "not met", "skipped", "failed"

#: Each target: how its figure is written, the target as the report states it, and the test.
TARGETS: dict[str, tuple[str, str, Callable[[float], bool]]] = {
    "trainer": ("{:.3f}x", ">= 0.9x", lambda v: v >= 0.9),
    "http": ("{:.3f}x", "<= 1.05x", lambda v: v <= 1.05),
    "websocket_p99": ("{:.2f} ms", "<= 5 ms", lambda v: v <= 5),
    "wasm_median": ("{:.2f} ms", "<= 10 ms", lambda v: v <= 10),
    "int8": ("{:+.3f}%", "<= 1%", lambda v: abs(v) <= 1.0),
    "bf16_speed": ("{:.3f}x", ">= 1.8x", lambda v: v >= 1.8),
    "bf16_quality": ("{:+.3f}%", "within 1%", lambda v: abs(v) <= 1.0),
    "gpu_share": ("{:.2f}x", ">= 2x", lambda v: v >= 2.0),
    "ray": ("{:.3f}x", "<= 1.1x", lambda v: v <= 1.1),
}


def _step(result: dict, name: str) -> tuple[dict | None, str | None]:
    """(figures, None) for a step that ran, else (None, "skipped" | "failed")."""
    s = result.get("steps", {}).get(name)
    if s is None or "skipped" in s:
        return None, SKIPPED
    if "error" in s:
        return None, FAILED
    return s, None


def _row(measure: str, figure: str, target: str, ok: bool | None, status: str | None = None):
    if status is None:
        status = SKIPPED if ok is None else (MET if ok else NOT_MET)
    return {"measure": measure, "figure": figure, "target": target, "status": status}


def _measured(
    measure: str,
    value: float | None,
    target: tuple[str, str, Callable[[float], bool]],
    status: str | None = None,
):
    """The row of a figure that may be missing against `target` (one of TARGETS): "-" and
    skipped when `value` is None, else written in the target's format, met when its test is."""
    fmt, stated, ok = target
    if value is None:
        return _row(measure, "-", stated, None, status)
    return _row(measure, fmt.format(value), stated, ok(value), status)


def targets(result: dict) -> list[dict]:
    """One row per target: {"measure", "figure", "target", "status"}; status is "met",
    "not met", "skipped" (step skipped or figure unavailable) or "failed" (the step failed)."""
    rows = []

    s, why = _step(result, "trainer")
    for device in [d for d in ("cpu", "cuda") if d in (s or {})] or ["cpu"]:
        ratio = (s or {}).get(device, {}).get("ratio")
        rows.append(
            _measured(
                f"trainer tokens/s vs bare PyTorch loop ({device})", ratio, TARGETS["trainer"], why
            )
        )

    s, why = _step(result, "http")
    for key, label in (
        ("ratio_of_best", "HTTP (`fedkey run`) vs in-process (`fedkey simulate`), wall time"),
        ("round_seconds_ratio_of_best", "HTTP vs in-process, summed per-round seconds"),
    ):
        r = (s or {}).get(key)
        rows.append(_measured(label, r, TARGETS["http"], why))

    s, why = _step(result, "memory")
    for strategy, label in (("fedatt", "FedAtt"), ("fedavg", "FedAvg")):
        ratio, figure, least, most = None, "-", 10, 200
        if s is not None:
            by_n = {r["updates"]: r for r in s["rows"] if r["strategy"] == strategy}
            if by_n:
                least, most = min(by_n), max(by_n)
                hi, lo = by_n[most], by_n[least]
                ratio = hi["peak_rss_mb"] / lo["peak_rss_mb"]
                figure = (
                    f"{ratio:.3f}x ({hi['peak_rss_mb']:.0f} vs {lo['peak_rss_mb']:.0f} MB; above "
                    f"the start {hi['peak_rss_mb'] - hi['rss_before_mb']:.0f} vs "
                    f"{lo['peak_rss_mb'] - lo['rss_before_mb']:.0f} MB)"
                )
        rows.append(
            _row(
                f"{label} peak memory at {most} updates vs {least}",
                figure,
                "<= 1.2x",
                None if ratio is None else ratio <= 1.2,
                why,
            )
        )

    s, why = _step(result, "keyboard")
    ws = (s or {}).get("ws") or {}
    p99 = ws.get("p99_ms")
    rows.append(
        _measured(
            f"suggestion latency over the WebSocket, p99 ({ws.get('n', '-')} keystrokes)",
            p99,
            TARGETS["websocket_p99"],
            why,
        )
    )
    wasm = (s or {}).get("wasm") or {}
    model_step = (wasm.get("with_model_call") or {}).get("p50_ms")
    for label, value in (
        ("in-browser (wasm) median, all keystrokes", wasm.get("median_ms")),
        ("in-browser (wasm) median, keystrokes with a model step", model_step),
    ):
        rows.append(_measured(label, value, TARGETS["wasm_median"], why))

    s, why = _step(result, "export")
    change = (s or {}).get("ppl_change_pct")
    rows.append(_measured("int8 perplexity change on held-out text", change, TARGETS["int8"], why))

    s, why = _step(result, "precision")
    speed = (s or {}).get("speed") or {}
    for device in [d for d in ("cpu", "cuda") if d in speed] or ["cpu"]:
        ratio = speed.get(device, {}).get("ratio")
        rows.append(
            _measured(
                f"trainer tokens/s, bf16 vs fp32 ({device})", ratio, TARGETS["bf16_speed"], why
            )
        )
    quality = (s or {}).get("quality") or {}
    change = quality.get("test_ppl_change_pct")
    rows.append(
        _measured(
            f"test perplexity, bf16 vs fp32 (the same {quality.get('fp32', {}).get('rounds', 10)}"
            "-round run)",
            change,
            TARGETS["bf16_quality"],
            why,
        )
    )

    s, why = _step(result, "gpu_share")
    speedup = (s or {}).get("speedup_over_one_process")
    label = "phones side by side on one GPU: best pool's tokens/s vs one process"
    rows.append(_measured(label, speedup, TARGETS["gpu_share"], why))

    s, why = _step(result, "fleet_memory")
    biggest = max((s or {}).get("rows") or [], key=lambda r: r["phones"], default=None)
    rows.append(
        _row(
            f"{biggest['phones'] if biggest else 10_000:,} idle phones in one Ray phone host, "
            "the actor's peak RSS",
            "-" if biggest is None else f"{biggest['actor_rss_idle_peak_mb']:.0f} MB",
            "< 1 GB",
            None if biggest is None else biggest["under_1_gb"],
            why,
        )
    )

    s, why = _step(result, "ray")
    ratio = (s or {}).get("round_seconds_ratio_of_best")
    label = "`--backend ray` vs `local`, summed per-round seconds (same simulate)"
    rows.append(_measured(label, ratio, TARGETS["ray"], why))
    return rows
