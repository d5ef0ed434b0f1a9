"""The report of `fedkey-bench load` (bench.load): its console table and OUT/results.md.

Split from bench/load.py, which runs the cells; this module only formats their results.json
objects: one row per (label, database, phones, rounds) cell, then each round, then each cell's
errors, statuses, /healthz by phase, event-stream lag and the machine's load average.
"""

from __future__ import annotations

from pathlib import Path

from common.files import atomic_write

FRACTION = 0.1  # of the phones selected (each uploads) every round, unless a cell says otherwise
ROUND_DEADLINE = 900.0  # s: the server's --round-deadline in bench.load (long: a round closes once its cohort uploaded)

__all__ = ["HEAD", "print_table", "table_row", "write_report"]


def _gb(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GB"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f}"


def _uploads(r: dict) -> str:
    ups = r["uploads_per_round"]
    return str(ups[0]) if ups and all(u == ups[0] for u in ups) else ", ".join(map(str, ups))


def _errors(r: dict) -> str:
    if not r["errors_total"]:
        return "0"
    top = sorted(r["errors"].items(), key=lambda kv: -kv[1])[:3]
    return f"{r['errors_total']} (" + "; ".join(f"{k}: {v}" for k, v in top) + ")"


def _lag(lag: dict | None) -> str:
    if not lag or not lag.get("n"):
        return ""  # a cell from before the server measured it
    return f"<= {lag['p99_at_most']:g} s ({lag['over_0.1']:,} of {lag['n']:,})"


HEAD = ("label", "database", "phones", "uploads/round", "s/round", "aggregation s/round",
        "/healthz p50 / p99 / max (s)", "loop lag p99 (late > 0.1 s)", "server peak RSS", "peak PSS", "enroll (s)", "errors")  # fmt: skip


def table_row(r: dict) -> list[str]:
    h = r["healthz"]
    notes = [f"phones nice +{r['phones_nice']}"] if r.get("phones_nice") else []
    if r.get("fraction", FRACTION) != FRACTION:
        notes.append(f"fraction {r['fraction']:g}")
    return [
        r["label"] + (f" ({', '.join(notes)})" if notes else ""),
        r.get("database", "sqlite"),
        f"{r['phones']:,}",
        _uploads(r),
        _span(r["seconds_per_round"]),
        _s(r.get("aggregation_seconds")),
        f"{_s(h['p50'])} / {_s(h['p99'])} / {_s(h['max'])}",
        _lag(r.get("loop_lag")),
        _gb(r["server_peak_rss"]),
        _gb(r["server_peak_pss"]) if r.get("server_peak_pss") else "",
        _s(r["enroll_seconds"]),
        _errors(r),
    ]


def print_table(runs: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fedkey-bench load")
    for h in HEAD:
        table.add_column(h, justify="left" if h in ("label", "errors") else "right")
    for r in runs:
        table.add_row(*table_row(r))
    console = Console()
    if not console.is_terminal:  # a log file: the whole table, not 80 columns of it
        console = Console(width=160)
    console.print(table)


def write_report(runs: list[dict], out: Path, commands: list[str]) -> None:
    runs = sorted(
        runs, key=lambda r: (r["label"], r.get("database", "sqlite"), r["phones"], r["rounds"])
    )
    lines = [
        "# fedkey-bench load: the server under fake phones",
        "",
        "Written by `fedkey-bench load` (bench/load.py). Each cell: `fedkey server` on 127.0.0.1 "
        "(demo corpus, default demo model, FedAvg, fraction 0.1 unless the label says otherwise, "
        "round deadline "
        f"{ROUND_DEADLINE:.0f} s) and N fake phones in this machine's driver processes "
        "(bench/load_phones.py: the real phone's HTTP contract without training, a keep-alive "
        "connection each; selected phones download the model with If-None-Match and upload the "
        "global tensors plus noise). s/round: a round's opening to its aggregation (evaluation and "
        "checkpoint included); aggregation s/round: the server's own fedkey_aggregation_seconds "
        "(aggregate, privacy, evaluate, checkpoint), the rest of a round is collecting the uploads; "
        "server s (per round): the metrics row's seconds, opening to the end of the aggregation "
        "(before evaluation). A cell run with --server-tree DIR ran the server of that checkout "
        "(its commit in the table). Database: the server's SQLite in its storage folder, or "
        "PostgreSQL (a throwaway cluster of Debian's postgresql package on 127.0.0.1, started "
        "for the cell by tests/support/postgres.py, durability settings left at their defaults). "
        "/healthz: a probe every 0.1-0.25 s while the rounds ran. Loop lag: the server's own "
        "fedkey_event_loop_lag_seconds over the whole cell (enrollment included), a wake-up due "
        "every 0.1 s: the bucket bound its 99th percentile lies under, and how many wake-ups "
        "came more than 0.1 s late (blank: a server from before it measured this). Server "
        "peak RSS: the largest of its VmHWM and the sampled RSS of it and its children; peak PSS: "
        "the largest sampled sum of their proportional set sizes (a page shared by the "
        "aggregation process and its forkserver counted once; recorded since the aggregation "
        "process, blank before). Errors: "
        "every failed request (retried or not) by kind, refused uploads, phones that gave up.",
        "",
        "| " + " | ".join(HEAD) + " | machine | commit |",
        "|" + "---|" * (len(HEAD) + 2),
    ]
    for r in runs:
        commit = (r.get("git_commit") or "?")[:10] + (" (dirty)" if r.get("git_dirty") else "")
        lines.append("| " + " | ".join([*table_row(r), r["machine"], commit]) + " |")
    lines += [
        "",
        "## Per round",
        "",
        "| label | database | phones | round | selected | uploads | s | server s "
        "| /healthz p50 / p99 / max (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        for p in r["per_round"]:
            h = p["healthz"]
            lines.append(
                f"| {r['label']} | {r.get('database', 'sqlite')} | {r['phones']:,} | "
                f"{p['round']} | {p['selected']} | {p['uploads']} | {_s(p['seconds'])} | {_s(p['server_seconds'])} | "
                f"{_s(h['p50'])} / {_s(h['p99'])} / {_s(h['max'])} |"
            )
    lines += ["", "## Errors, statuses and server warnings", ""]
    for r in runs:
        lines.append(f"**{r['id']}** (server {r.get('server_stop', '?')})")
        lines.append("")
        for name, value in (("errors", r["errors"]), ("statuses", r["statuses"])):
            shown = ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
            lines.append(f"- {name}: {shown}")
        phases = r.get("healthz_by_phase") or {}
        if phases:
            shown = "; ".join(
                f"{k} (n {v['n']}) {_s(v['p50'])} / {_s(v['p99'])} / {_s(v['max'])}"
                for k, v in phases.items()
            )
            lines.append(f"- /healthz p50 / p99 / max (s) by phase: {shown}")
        lag = r.get("event_stream_lag") or {}
        if lag.get("n"):
            lines.append(
                f"- WS /v1/events lag (publish to arrival, s): p50 {_s(lag['p50'])}, "
                f"p99 {_s(lag['p99'])}, max {_s(lag['max'])}"
            )
        latency = r.get("latency") or {}
        if latency:
            shown = ", ".join(
                f"{k} {_s(v['p50'])} / {_s(v['p99'])}" for k, v in latency.items() if v["n"]
            )
            lines.append(f"- phones' request latency p50 / p99 (s; long-polls aside): {shown}")
        if r.get("loadavg"):
            before, after = r["loadavg"]
            lines.append(f"- machine load average (1 min) before / after: {before} / {after}")
        log = r.get("server_log") or {}
        lines.append(f"- server log warnings/errors: {log.get('count', 0)}")
        lines += [f"  - `{line}`" for line in log.get("first", [])[:5]]
        if r.get("rounds_failed"):
            lines.append(f"- rounds failed: {r['rounds_failed']}")
        lines.append("")
    lines += ["## Commands", "", *[f"    {c}" for c in commands], ""]
    lines += ["Each cell's own command is its `command` in results.json.", ""]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.md", "\n".join(lines))
