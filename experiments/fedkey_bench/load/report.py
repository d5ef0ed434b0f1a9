"""The report of `fedkey-bench load` (fedkey_bench.load.runner): its console table, OUT/results.md and the
machine-readable files beside it.

Split from fedkey_bench/load/runner.py, which runs the cells; this module only formats their results.json
objects. results.md leads with the answer (the newest cell of each fleet size, database and
share of phones a round), then one row per (label, database, phones, rounds) cell and the
protocol; each round of each cell goes to OUT/rounds.csv and each cell's failed requests,
statuses and server warnings to OUT/errors.csv (results.json holds all of it, with every cell's
command). Rebuild the three from results.json alone: `python -m fedkey_bench.load.report OUT`.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from fedkey.common.files import atomic_write
from fedkey_bench.common.checkout import RESULTS

FRACTION = 0.1  # of the phones selected (each uploads) every round, unless a cell says otherwise
ROUND_DEADLINE = 900.0  # s: the server's --round-deadline in fedkey_bench.load.runner (long: a round closes once its cohort uploaded)

__all__ = ["HEAD", "headline", "print_table", "rebuild", "table_row", "write_report"]

QUESTION = (
    "How many phones can one `fedkey server` take, and what does a round cost it: seconds a "
    "round, /healthz latency while it runs, the server's peak memory, failed requests?"
)
ROUNDS_CSV = "rounds.csv"
ERRORS_CSV = "errors.csv"


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


def _database(r: dict) -> str:
    return str(r.get("database", "sqlite"))


HEAD = ("label", "database", "phones", "uploads/round", "s/round", "aggregation s/round",
        "/healthz p50 / p99 / max (s)", "loop lag p99 (late > 0.1 s)", "server peak RSS", "peak PSS", "enroll (s)", "errors")  # fmt: skip


def table_row(r: dict) -> list[str]:
    h = r["healthz"]
    notes = [f"phones nice +{r['phones_nice']}"] if r.get("phones_nice") else []
    if r.get("fraction", FRACTION) != FRACTION:
        notes.append(f"fraction {r['fraction']:g}")
    return [
        r["label"] + (f" ({', '.join(notes)})" if notes else ""),
        _database(r),
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


def headline(runs: list[dict]) -> list[dict]:
    """The answer: the newest cell (the last recorded in results.json) of each fleet size,
    database and share of the phones a round, largest fleet first."""
    newest: dict[tuple, dict] = {}
    for r in runs:  # results.json keeps the cells in the order they ran
        newest[(r["phones"], _database(r), r.get("fraction", FRACTION))] = r
    return sorted(
        newest.values(), key=lambda r: (-r["phones"], _database(r), -r.get("fraction", FRACTION))
    )


ANSWER_HEAD = ("phones", "database", "uploads/round", "s/round", "/healthz p99 (s)",
               "server peak RSS", "errors", "cell")  # fmt: skip


def _answer_row(r: dict) -> list[str]:
    return [f"{r['phones']:,}", _database(r), _uploads(r), _span(r["seconds_per_round"]),
            _s(r["healthz"]["p99"]), _gb(r["server_peak_rss"]), _errors(r), r["id"]]  # fmt: skip


def _table(head: tuple[str, ...] | list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(row) + " |" for row in rows)]  # fmt: skip


def _csv(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def rounds_csv(runs: list[dict]) -> str:
    """Every round of every cell: one CSV row each."""
    header = ["id", "label", "database", "phones", "fraction", "phones_nice", "round", "selected",
              "uploads", "uploads_accepted", "seconds", "server_seconds", "healthz_n",
              "healthz_p50", "healthz_p99", "healthz_max"]  # fmt: skip
    rows = []
    for r in runs:
        for p in r["per_round"]:
            h = p.get("healthz") or {}
            rows.append([r["id"], r["label"], _database(r), r["phones"],
                         r.get("fraction", FRACTION), r.get("phones_nice", 0), p["round"],
                         p["selected"], p["uploads"], p.get("uploads_accepted", ""),
                         p["seconds"], p.get("server_seconds", ""), h.get("n", ""),
                         h.get("p50", ""), h.get("p99", ""), h.get("max", "")])  # fmt: skip
    return _csv(header, rows)


def errors_csv(runs: list[dict]) -> str:
    """Every cell's failed requests and HTTP statuses by kind, the phones that gave up, the
    rounds that failed and the server log's warnings: one CSV row per (cell, what, name)."""
    header = ["id", "what", "name", "count"]
    rows: list[list] = []
    for r in runs:
        rows += [[r["id"], "error", k, v] for k, v in r["errors"].items()]
        rows += [[r["id"], "status", k, v] for k, v in r["statuses"].items()]
        if r.get("phones_gave_up"):
            rows.append([r["id"], "phones_gave_up", "", r["phones_gave_up"]])
        rows += [[r["id"], "round_failed", str(n), 1] for n in r.get("rounds_failed") or []]
        log = r.get("server_log") or {}
        if log.get("count"):
            rows.append([r["id"], "server_log_warnings", "", log["count"]])
            rows += [[r["id"], "server_log_line", line, ""] for line in log.get("first", [])[:5]]
        if r.get("problem"):
            rows.append([r["id"], "problem", r["problem"], ""])
    return _csv(header, rows)


PROTOCOL = (
    "Each cell: `fedkey server` on 127.0.0.1 (demo corpus, default demo model, FedAvg, fraction "
    "0.1 unless the label says otherwise, round deadline "
    f"{ROUND_DEADLINE:.0f} s) and N fake phones in this machine's driver processes "
    "(fedkey_bench/load/phones.py: the real phone's HTTP contract without training, a keep-alive "
    "connection each; selected phones download the model with If-None-Match and upload the "
    "global tensors plus noise). s/round: a round's opening to its aggregation (evaluation and "
    "checkpoint included); aggregation s/round: the server's own fedkey_aggregation_seconds "
    "(aggregate, privacy, evaluate, checkpoint), the rest of a round is collecting the uploads; "
    "server s (rounds.csv): the metrics row's seconds, opening to the end of the aggregation "
    "(before evaluation). A cell run with --server-tree DIR ran the server of that checkout "
    "(its commit in the table). Phones nice +N: the phones' driver processes ran that much "
    "nicer than the server (in a deployment the phones are other machines; here they share "
    "its CPUs). Database: the server's SQLite in its storage folder, or "
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
    "every failed request (retried or not) by kind, refused uploads, phones that gave up."
)


def write_report(runs: list[dict], out: Path, commands: list[str]) -> None:
    """OUT/results.md (the answer first, then every cell), OUT/rounds.csv and OUT/errors.csv."""
    runs = list(runs)  # results.json's order: the order the cells ran (headline's "newest")
    cells = sorted(runs, key=lambda r: (r["label"], _database(r), r["phones"], r["rounds"]))
    machines = sorted({r["machine"] for r in runs})
    lines = [
        "# fedkey-bench load: the server under fake phones",
        "",
        QUESTION,
        "",
        "## The answer",
        "",
        "The newest cell of each fleet size, database and share of the phones a round "
        "(every cell below):",
        "",
        *_table(ANSWER_HEAD, [_answer_row(r) for r in headline(runs)]),
        "",
        f"Machine: {'; '.join(machines) or '-'}. Phones and server share it.",
        "",
        "## Every cell",
        "",
        *_table(
            [*HEAD, "commit"],
            [
                [
                    *table_row(r),
                    (r.get("git_commit") or "?")[:10] + (" (dirty)" if r.get("git_dirty") else ""),
                ]
                for r in cells
            ],
        ),  # fmt: skip
        "",
    ]
    failed = [r for r in cells if r["errors_total"] or r.get("rounds_failed") or r.get("problem")
              or r.get("phones_gave_up")]  # fmt: skip
    lines += [f"Cells with failed requests, failed rounds or phones that gave up: {len(failed)} "
              f"of {len(cells)}" + (":" if failed else "."), ""]  # fmt: skip
    for r in failed:
        gave_up = f"; {r['phones_gave_up']} phones gave up" if r.get("phones_gave_up") else ""
        rounds_failed = f"; rounds failed: {r['rounds_failed']}" if r.get("rounds_failed") else ""
        lines.append(f"- {r['id']}: {_errors(r)}{gave_up}{rounds_failed}")
    if failed:
        lines.append("")
    lines += [
        "## How it was measured",
        "",
        "Written by `fedkey-bench load` (fedkey_bench/load/runner.py). " + PROTOCOL,
        "",
        "## Files",
        "",
        f"- [`results.json`](results.json): every cell ({len(runs)}) with the command that "
        "reproduces it, its commit and machine, and everything it measured (per round, "
        "/healthz by phase, event-stream lag, the phones' request latency, load average, the "
        f"server's memory over time); the {len(commands)} bench command lines "
        "(`bench_commands`).",
        f"- [`{ROUNDS_CSV}`]({ROUNDS_CSV}): every round of every cell (selected, uploads, "
        "seconds, the server's seconds, /healthz).",
        f"- [`{ERRORS_CSV}`]({ERRORS_CSV}): every cell's failed requests and HTTP statuses by "
        "kind, phones that gave up, failed rounds, server log warnings.",
        "",
        "Rebuild the page and the CSV files from results.json: "
        "`python -m fedkey_bench.load.report experiments/results/load`.",
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / ROUNDS_CSV, rounds_csv(runs))
    atomic_write(out / ERRORS_CSV, errors_csv(runs))
    atomic_write(out / "results.md", "\n".join(lines))


def rebuild(folder: Path) -> Path:
    """FOLDER/results.md, rounds.csv and errors.csv from FOLDER/results.json; -> results.md."""
    from fedkey_bench.paper.results import Bench

    bench = Bench(folder)
    write_report(bench.read(), folder, bench.commands())
    return folder / "results.md"


if __name__ == "__main__":
    print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "load"))
