"""`fedkey-bench load`: the federation server under thousands of fake phones.

One cell = one fleet size N and R rounds. The bench starts `fedkey server` as a child process on
127.0.0.1 (a free port, a temporary storage folder, the demo corpus and the default demo model,
FedAvg with a fraction of 0.1 so that 10% of the phones upload each round, a 900 s round deadline,
round 1 opening once all N phones enrolled), then drives N fake phones against it
(fedkey_bench.load.phones: the real phone's contract, no training, one keep-alive connection each, in
one asyncio event loop per driver process, one process per 5,000 phones). This process only
watches: a /healthz prober on its own connection every 0.1-0.25 s (in a process of its own,
fedkey_bench.load.watch.HealthProber), the server's event stream
(WS /v1/events: when each round opened and was aggregated), and the server's memory (VmRSS of
the server and its children every 0.25 s, and the server's VmHWM). Once the phones heard
"finished" it reads GET /v1/metrics and stops the server with SIGTERM.

Per round: seconds from opening to aggregation (evaluation and checkpoint included; the metrics
row's `seconds`, opening to the end of the aggregation, beside it), the cohort and the uploads
aggregated, /healthz p50 / p99 / max while the round ran. Per cell: the same over the rounds,
the time to enroll, the server's peak RSS, every failed request by kind (retried or not), the
uploads refused, the phones that gave up. The server's database: SQLite (its default) or, with
--database postgresql, a throwaway PostgreSQL cluster (fedkey.testing.postgres).
Results: OUT/results.json (one object per (phones, rounds, label, database) cell with the command
that reproduces it; a cell already there with the same
command is not run again, so an interrupted bench resumes) and OUT/results.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedkey.runners.processes import (
    ProcessError,
    free_port,
    listen_problem,
    server_env,
    wait_healthy,
)
from fedkey.testing import postgres
from fedkey_bench.common.checkout import RESULTS, ROOT
from fedkey_bench.common.provenance import git, machine_line
from fedkey_bench.load.phones import HttpError, PhoneConfig, Stats, shard_main
from fedkey_bench.load.report import FRACTION, ROUND_DEADLINE, print_table, write_report
from fedkey_bench.load.watch import (
    HOST,
    HealthProber,
    RssMonitor,
    Watch,
    get_json,
    get_text,
    round_times,
    split_by_phase,
    summary_stats,
    watch_events,
)
from fedkey_bench.paper.results import Bench

PHONES_PER_DRIVER = 5_000  # phones per driver process (one event loop each)
#: The server's histograms a cell reads from /metrics at its end.
HISTOGRAMS = ("fedkey_aggregation_seconds", "fedkey_event_loop_lag_seconds")
# the server's database: SQLite in its storage folder (its default), or a throwaway PostgreSQL
# cluster (fedkey.testing.postgres) passed as --database-url
DATABASES = ("sqlite", "postgresql")

__all__ = ["Cell", "LoadError", "cohort_size", "command", "run_cell", "run_load"]


class LoadError(RuntimeError):
    """A cell could not run (the server did not start, exited, or the run timed out)."""


@dataclass(frozen=True)
class Cell:
    phones: int
    rounds: int
    label: str = "run"
    database: str = "sqlite"  # one of DATABASES
    phones_nice: int = 0  # the driver processes' nice above the bench's (PhoneConfig.nice)
    fraction: float = FRACTION  # of the phones selected (and uploading) each round

    @property
    def id(self) -> str:
        base = f"{self.label}-{self.phones}-phones-{self.rounds}-rounds"
        base = base if self.database == "sqlite" else f"{base}-{self.database}"
        base = f"{base}-phones-nice-{self.phones_nice}" if self.phones_nice else base
        return base if self.fraction == FRACTION else f"{base}-fraction-{self.fraction:g}"


@dataclass(frozen=True)
class Options:
    """How the bench runs a cell (beyond the cell itself)."""

    drivers: int | None = None  # driver processes; None: one per PHONES_PER_DRIVER phones
    port: int = 0  # 0: a free one
    server_tree: Path | None = None  # run the server from this checkout instead of ROOT
    timeout: float | None = None  # seconds for a whole cell; None: from its size

    def driver_count(self, phones: int) -> int:
        n = self.drivers or math.ceil(phones / PHONES_PER_DRIVER)
        return max(1, min(n, phones))


def cohort_size(phones: int, fraction: float = FRACTION) -> int:
    """The server's cohort of `phones` at `fraction`."""
    # imported here: `fedkey-bench load --help` imports this module, and never torch
    from fedkey.federation.strategies.selection import cohort_size as server_cohort_size

    return server_cohort_size(fraction, phones)


def server_overrides() -> dict[str, str]:
    """The server settings this bench's environment passes on to the server it starts
    (``FEDKEY_<SETTING>``, but the storage, which is the bench's own; other ``FEDKEY_`` variables,
    such as FEDKEY_DATA_DIR, set no server setting and make no other cell)."""
    from fedkey.server.settings import Settings

    settings = {f"FEDKEY_{name.upper()}" for name in Settings.model_fields} - {"FEDKEY_STORAGE"}
    return {k: v for k, v in sorted(os.environ.items()) if k in settings}


def command(cell: Cell, opts: Options) -> list[str]:
    """The command line that runs this cell alone, the server settings taken from the environment
    first (``FEDKEY_MAX_SENDING=16 fedkey-bench load ...``): another setting is another cell."""
    cmd = [f"{k}={v}" for k, v in server_overrides().items()]
    cmd += ["fedkey-bench", "load", "--phones", str(cell.phones), "--rounds", str(cell.rounds)]
    cmd += ["--label", cell.label]
    if cell.database != "sqlite":
        cmd += ["--database", cell.database]
    if opts.drivers:
        cmd += ["--drivers", str(opts.drivers)]
    if opts.server_tree is not None:
        cmd += ["--server-tree", str(opts.server_tree)]
    if cell.phones_nice:
        cmd += ["--phones-nice", str(cell.phones_nice)]
    if cell.fraction != FRACTION:
        cmd += ["--fraction", f"{cell.fraction:g}"]
    return cmd


def same_cell(recorded: str) -> str:
    """A recorded cell's command as this bench now spells it: cells recorded before the harness
    left the product (`fedkey bench load ...`, now `fedkey-bench load ...`) count as done."""
    return recorded.replace("fedkey bench load", "fedkey-bench load", 1)


def server_argv(
    cell: Cell, port: int, storage: Path, secret: str, database_url: str | None = None
) -> list[str]:
    argv = [
        sys.executable, "-m", "fedkey", "server", "--data", "demo", "--storage", str(storage),
        "--host", HOST, "--port", str(port), "--rounds", str(cell.rounds),
        "--fraction", str(cell.fraction), "--wait-devices", str(cell.phones),
        "--round-deadline", str(ROUND_DEADLINE), "--enrollment-secret", secret,
    ]  # fmt: skip
    return argv + ["--database-url", database_url] if database_url else argv


async def run_shards(cfg: PhoneConfig, phones: int, drivers: int) -> Stats:
    """The phones split over `drivers` processes; their Stats added up."""
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(
            target=shard_main, args=(cfg, list(range(i, phones, drivers)), results), daemon=True
        )
        for i in range(drivers)
    ]
    for p in procs:
        p.start()
    stats, got = Stats(), 0
    try:
        while got < drivers:
            try:
                part = await asyncio.to_thread(results.get, True, 1.0)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and results.empty():
                    raise LoadError("a driver process exited without its results") from None
                continue
            stats.merge(part)
            got += 1
    finally:
        for p in procs:
            if p.is_alive() and got < drivers:
                p.terminate()
            p.join(timeout=10)
    return stats


@dataclass
class Drive:
    watch: Watch
    stats: Stats
    metrics: list[dict]
    histograms: dict[str, dict[str, Any]]  # the server's (_histograms), empty if it was gone
    wall: float
    problem: str | None  # why the drive stopped early, if it did


async def drive(
    cell: Cell, cfg: PhoneConfig, drivers: int, server: subprocess.Popen, timeout: float, bar: Any
) -> Drive:
    watch = Watch()

    def on_round(r: int) -> None:
        bar.update(1)
        bar.set_postfix_str(f"round {r} aggregated")

    events = asyncio.create_task(watch_events(cfg.port, watch, on_round))
    prober = HealthProber(cfg.port)
    prober.start()
    phones = asyncio.create_task(run_shards(cfg, cell.phones, drivers))
    deadline = time.monotonic() + timeout
    problem = None
    stats = Stats()
    while not phones.done():
        await asyncio.wait({phones}, timeout=1.0)
        if not phones.done():
            if server.poll() is not None:
                problem = f"the server exited with code {server.returncode} during the run"
            elif time.monotonic() > deadline:
                problem = f"the cell did not finish within {timeout:.0f} s"
            if len(watch.aggregated) < cell.rounds and watch.enrolled < cell.phones:
                bar.set_postfix_str(f"{watch.enrolled}/{cell.phones} enrolled")
            if problem:
                phones.cancel()
                break
    with contextlib.suppress(asyncio.CancelledError):
        stats = await phones
    wall = time.monotonic() - watch.t0
    metrics: list[dict] = []
    histograms: dict[str, dict[str, Any]] = {}
    if server.poll() is None:
        with contextlib.suppress(HttpError, ValueError):
            metrics = (await get_json(cfg.port, "/v1/metrics")).get("rounds", [])
        with contextlib.suppress(HttpError, ValueError):
            histograms = _histograms(await get_text(cfg.port, "/metrics"), *HISTOGRAMS)
    await asyncio.to_thread(prober.finish, watch)
    events.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await events
    return Drive(watch, stats, metrics, histograms, wall, problem)


def _histograms(prometheus: str, *names: str) -> dict[str, dict[str, Any]]:
    """Prometheus histograms of the server's /metrics: name -> sum, count and the cumulative
    bucket counts (upper bound -> observations at most that)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, Any]] = {n: {"buckets": {}} for n in names}
    for family in text_string_to_metric_families(prometheus):
        if family.name not in out:
            continue
        h = out[family.name]
        for sample in family.samples:
            part = sample.name.removeprefix(family.name + "_")
            if part == "bucket":
                h["buckets"][float(sample.labels["le"])] = sample.value
            elif part in ("sum", "count"):
                h[part] = sample.value
    return out


def loop_lag(histogram: dict[str, Any]) -> dict[str, float | int | None]:
    """The server's own measure of its event loop's stalls over the whole cell (its
    fedkey_event_loop_lag_seconds): wake-ups observed, how many came over 0.1 s late, and the
    bucket bound the 99th percentile lies under."""
    buckets = sorted(histogram.get("buckets", {}).items())
    n = int(histogram.get("count", 0))
    if not n or not buckets:
        return {"n": 0, "over_0.1": None, "p99_at_most": None}
    at_01 = next((c for le, c in buckets if le >= 0.1), n)
    p99 = next((le for le, c in buckets if c >= 0.99 * n), None)
    return {"n": n, "over_0.1": int(n - at_01), "p99_at_most": p99}


# -- one cell ----------------------------------------------------------------------------------


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _log_problems(path: Path, limit: int = 12) -> dict:
    """The server log's warnings and errors (not its access lines): a count and the first few."""
    seen: Counter[str] = Counter()
    try:
        with path.open(errors="replace") as f:
            for line in f:
                if ("WARNING" in line or "ERROR" in line or "Traceback" in line) and (
                    '" 200' not in line
                ):
                    seen[line.strip()[:200]] += 1
    except OSError:
        pass
    return {"count": sum(seen.values()), "first": [line for line, _ in seen.most_common(limit)]}


def _stop_server(proc: subprocess.Popen, grace: float = 60.0) -> str:
    if proc.poll() is not None:
        return f"exited by itself ({proc.returncode})"
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"killed: not stopped {grace:.0f} s after SIGTERM"
    # uvicorn re-raises the SIGTERM it handled once it has shut down: -15 is a clean stop too.
    clean = code in (0, -signal.SIGTERM)
    return f"stopped by SIGTERM (exit {code})" if clean else f"SIGTERM: exit {code}"


def summarize(cell: Cell, d: Drive, rss: RssMonitor, drivers: int) -> dict:
    """One results.json object from a drive."""
    watch, stats = d.watch, d.stats
    times = round_times(watch, cell.rounds)
    rows = {int(row["round"]): row for row in d.metrics if row.get("round")}
    per_round: list[dict[str, Any]] = []
    for r in range(1, cell.rounds + 1):
        row = rows.get(r, {})
        span = times.get(r)
        lat = [x for t, x, _, _ in watch.health if span and span[0] <= t <= span[1]]
        seconds = None
        if r in watch.opened_at and r in watch.aggregated_at:  # the server's own clock
            seconds = watch.aggregated_at[r] - watch.opened_at[r]
        elif span:
            seconds = span[1] - span[0]
        per_round.append(
            {
                "round": r,
                "selected": len(row.get("selected") or []),
                "uploads": len(row.get("uploaded", row.get("aggregated")) or []),
                "uploads_accepted": stats.uploads.get(str(r), 0),
                "seconds": None if seconds is None else round(seconds, 2),
                "server_seconds": row.get("seconds"),
                "healthz": summary_stats(lat),
            }
        )
    first = min((s[0] for s in times.values()), default=None)
    last = max((s[1] for s in times.values()), default=None)
    in_rounds = [x for t, x, _, _ in watch.health if first and last and first <= t <= last]
    enrolling = [x for t, x, _, _ in watch.health if first and t < first]
    errors: Counter[str] = Counter(stats.errors)
    errors.update({f"healthz {k}": v for k, v in watch.health_errors.items()})
    errors.update({f"refused {k}": v for k, v in stats.rejected.items()})
    errors.update({f"gave up: {k}": v for k, v in stats.gave_up.items()})
    round_seconds = [p["seconds"] for p in per_round if p["seconds"] is not None]
    aggregation = d.histograms.get("fedkey_aggregation_seconds", {})
    return {
        "id": cell.id,
        "label": cell.label,
        "phones": cell.phones,
        "rounds": cell.rounds,
        "fraction": cell.fraction,
        "cohort": cohort_size(cell.phones, cell.fraction),
        "drivers": drivers,
        "rounds_completed": len(rows),
        "uploads_per_round": [p["uploads"] for p in per_round],
        "seconds_per_round": round_seconds,
        "enroll_seconds": round(first - watch.t0, 2) if first else None,
        # the server's aggregate + privacy + evaluate + checkpoint, per round (its histogram)
        "aggregation_seconds": round(aggregation["sum"] / aggregation["count"], 2)
        if aggregation.get("count")
        else None,
        "loop_lag": loop_lag(d.histograms.get("fedkey_event_loop_lag_seconds", {})),
        "event_stream_lag": summary_stats(watch.events_lag),
        "healthz": summary_stats(in_rounds),
        "healthz_enrolling": summary_stats(enrolling),
        "healthz_by_phase": {
            k: summary_stats(v) for k, v in split_by_phase(watch, cell.rounds).items()
        },
        "server_peak_rss": rss.peak,
        "server_peak_pss": rss.peak_pss,
        "server_children": rss.children,
        "server_rss_timeline": [[round(t - watch.t0, 1), b] for t, b in rss.timeline],
        "errors": dict(sorted(errors.items())),
        "errors_total": sum(errors.values()),
        "phones_finished": stats.events.get("finished", 0),
        "phones_gave_up": sum(stats.gave_up.values()),
        "rounds_failed": watch.failed,
        "statuses": dict(sorted(stats.statuses.items())),
        "events": dict(sorted(stats.events.items())),
        "latency": {route: summary_stats(v) for route, v in sorted(stats.latency.items())},
        "connections": stats.connections,
        "bytes_down": stats.bytes_down,
        "bytes_up": stats.bytes_up,
        "per_round": per_round,
        "event_stream_error": watch.events_error,
        "problem": d.problem,
    }


def run_cell(cell: Cell, opts: Options = Options(), progress: bool = True) -> dict:
    """Run one cell: the server (on SQLite, or on a throwaway PostgreSQL cluster started for the
    cell and stopped after it), the phones, the measurements; its results.json object."""
    if cell.database not in DATABASES:
        raise LoadError(f"--database {cell.database}: choose one of {', '.join(DATABASES)}")
    if cell.database == "sqlite":
        return _run_cell(cell, opts, progress, None)
    try:
        with postgres.cluster() as url:
            return _run_cell(cell, opts, progress, url)
    except postgres.PostgresError as e:
        raise LoadError(str(e)) from None


def _run_cell(cell: Cell, opts: Options, progress: bool, database_url: str | None) -> dict:
    from tqdm import tqdm

    tree = (opts.server_tree or ROOT).resolve()
    if not (tree / "fedkey" / "__main__.py").is_file():
        raise LoadError(f"--server-tree {tree}: not a fedkey checkout (no fedkey/__main__.py)")
    port = opts.port or free_port(HOST)
    problem = listen_problem(HOST, port)
    if problem is not None:
        raise LoadError(f"cannot listen on {HOST}:{port}: {problem}; choose another --port")
    drivers = opts.driver_count(cell.phones)
    timeout = opts.timeout or 300 + cell.phones / 20 + cell.rounds * (ROUND_DEADLINE + 120)
    secret = secrets.token_urlsafe(16)
    work = Path(tempfile.mkdtemp(prefix="fedkey-bench-load-"))
    log_path = work / "server.log"
    _raise_nofile()
    start = time.perf_counter()
    load_before = os.getloadavg()
    try:
        env = {**os.environ, **server_env({"FEDKEY_EVENT_QUEUE_SIZE": "1000000"})}
        env.pop("FEDKEY_STORAGE", None)
        with log_path.open("w") as log:
            server = subprocess.Popen(
                server_argv(cell, port, work / "storage", secret, database_url),
                cwd=tree,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        rss = RssMonitor(server.pid)
        rss.start()
        try:
            try:
                wait_healthy(f"http://{HOST}:{port}", server, timeout=180)
            except ProcessError as e:
                raise LoadError(f"{e}; its last lines:\n{_log_tail(log_path)}") from None
            cfg = PhoneConfig(HOST, port, secret, ramp=cell.phones / 1000, nice=cell.phones_nice)
            with tqdm(
                total=cell.rounds, desc=f"{cell.phones} phones", unit="round", disable=not progress
            ) as bar:
                d = asyncio.run(drive(cell, cfg, drivers, server, timeout, bar))
        finally:
            stopped = _stop_server(server)
            rss.stop()
        if d.problem:
            raise LoadError(
                f"{cell.id}: {d.problem}; the server's last lines:\n{_log_tail(log_path)}"
            )
        result = summarize(cell, d, rss, drivers)
        result["server_stop"] = stopped
        result["server_log"] = _log_problems(log_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    # The machine's 1-minute load average before and after: other work on it skews the figures.
    result["loadavg"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    result["database"] = cell.database
    result["phones_nice"] = cell.phones_nice
    result.update(provenance(tree))
    return result


def _raise_nofile() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # the server child inherits it: a socket per phone on both sides
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def provenance(tree: Path) -> dict:
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench", tree=tree)
    return {
        "server_tree": str(tree) if tree != ROOT else ".",
        "git_commit": git("rev-parse", "HEAD", tree=tree),
        "git_dirty": None if dirty is None else bool(dirty),
        "machine": machine_line(),
    }


# -- the bench -----------------------------------------------------------------------------------


def run_load(
    phones: list[int],
    rounds: int,
    label: str = "run",
    out: Path = RESULTS / "load",
    opts: Options = Options(),
    dry_run: bool = False,
    bench_command: str = "",
    progress: bool = True,
    database: str = "sqlite",
    phones_nice: int = 0,
    fraction: float = FRACTION,
) -> list[dict]:
    """Run every cell (phones x rounds x label x database x phones' nice x fraction) not yet in
    OUT/results.json, then the report."""
    if not 0 < fraction <= 1:
        raise LoadError(f"--fraction {fraction}: give a share of the phones in (0, 1]")
    if database not in DATABASES:
        raise LoadError(f"--database {database}: choose one of {', '.join(DATABASES)}")
    bench = Bench(out)
    cells = [Cell(n, rounds, label, database, phones_nice, fraction) for n in phones]
    todo = bench.pending(cells, lambda c: (c.id, command(c, opts)), dry_run, same=same_cell)
    if dry_run:
        return bench.read()
    for cell in todo:
        result = run_cell(cell, opts, progress)
        result["command"] = shlex.join(command(cell, opts))
        bench.add(result, bench_command)
        print_table([result])
        write_report(bench.read(), out, bench.commands())
    runs = bench.read()
    write_report(runs, out, bench.commands())
    done = [r for r in runs if r["id"] in {c.id for c in cells}]
    if not todo:
        print_table(done)
    return done
