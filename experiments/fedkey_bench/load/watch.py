"""What `fedkey-bench load` (fedkey_bench.load.runner) watches while the phones drive the server: the server's
memory (VmRSS of it and its children, its VmHWM), the rounds' transitions from its event stream
(WS /v1/events), /healthz latency from a prober on its own connection, and the per-round and
per-phase figures computed from them. Split from fedkey_bench.load.runner, which runs the cells."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedkey_bench.common.provenance import proc_kb
from fedkey_bench.load.phones import Connection, HttpError, percentile

HOST = "127.0.0.1"

# -- the server's memory ---------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                for child in (task / "children").read_text().split():
                    out.append(int(child))
                    todo.append(int(child))
    return out


class RssMonitor(threading.Thread):
    """Samples the RSS of `pid` and its descendants every `interval` seconds; `peak` is the
    largest sum seen or the server's own VmHWM, whichever is larger. `peak_pss`: the largest sum
    of their PSS, which counts the pages the aggregation process shares with its forkserver (the
    torch libraries) once, where the RSS sum counts them in each."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True, name="rss-monitor")
        self.pid = pid
        self.interval = interval
        self.stopping = threading.Event()
        self.peak_tree = 0
        self.peak_pss = 0
        self.hwm = 0
        self.children = 0
        self.timeline: list[tuple[float, int]] = []  # (monotonic, tree RSS), one a second

    def sample(self) -> None:
        kids = _descendants(self.pid)
        self.children = max(self.children, len(kids))
        procs = [self.pid, *kids]
        tree = sum(proc_kb(f"{p}/status", "VmRSS") for p in procs)
        self.peak_tree = max(self.peak_tree, tree)
        self.peak_pss = max(self.peak_pss, sum(proc_kb(f"{p}/smaps_rollup", "Pss") for p in procs))
        self.hwm = max(self.hwm, proc_kb(f"{self.pid}/status", "VmHWM"))
        now = time.monotonic()
        if not self.timeline or now - self.timeline[-1][0] >= 1.0:
            self.timeline.append((now, tree))

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)

    @property
    def peak(self) -> int:
        return max(self.peak_tree, self.hwm)


# -- what the bench process watches ----------------------------------------------------------------


@dataclass
class Watch:
    """Round transitions (from the event stream), /healthz samples, the phones' stats."""

    t0: float = field(default_factory=time.monotonic)
    opened: dict[int, float] = field(default_factory=dict)  # round -> first opening
    aggregated: dict[int, float] = field(default_factory=dict)
    # the same, by the server's clock (the events' "time"): a round's seconds
    opened_at: dict[int, float] = field(default_factory=dict)
    aggregated_at: dict[int, float] = field(default_factory=dict)
    # round -> the server's time of its last accepted upload: aggregation starts then
    last_upload_at: dict[int, float] = field(default_factory=dict)
    failed: list[dict] = field(default_factory=list)  # round_failed events
    finished: float | None = None
    enrolled: int = 0
    events_error: str | None = None
    events_lag: list[float] = field(default_factory=list)  # seconds from publish to arrival
    # (monotonic, latency s, round or None, state or the error kind)
    health: list[tuple[float, float, int | None, str]] = field(default_factory=list)
    health_errors: Counter[str] = field(default_factory=Counter)


async def watch_events(port: int, watch: Watch, on_round: Any) -> None:
    """Follow WS /v1/events: when rounds open, fail and are aggregated."""
    from websockets.asyncio.client import connect

    try:
        async with connect(
            f"ws://{HOST}:{port}/v1/events", ping_interval=None, max_size=1 << 22
        ) as ws:
            async for message in ws:
                event = json.loads(message)
                kind, now = event.get("type"), time.monotonic()
                r = event.get("round")
                at = event.get("time")
                if isinstance(at, float):
                    watch.events_lag.append(time.time() - at)
                if kind == "round_opened" and isinstance(r, int):
                    watch.opened.setdefault(r, now)
                    if isinstance(at, float):
                        watch.opened_at.setdefault(r, at)
                elif kind == "round_aggregated" and isinstance(r, int):
                    watch.aggregated[r] = now
                    if isinstance(at, float):
                        watch.aggregated_at[r] = at
                    on_round(r)
                elif kind == "update_received" and isinstance(r, int) and isinstance(at, float):
                    watch.last_upload_at[r] = max(at, watch.last_upload_at.get(r, at))
                elif kind == "round_failed":
                    watch.failed.append({k: event.get(k) for k in ("round", "attempt", "reason")})
                elif kind == "run_finished":
                    watch.finished = now
                elif kind == "device_enrolled":
                    watch.enrolled = int(event.get("devices") or watch.enrolled + 1)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the event stream is a convenience: /healthz samples are the fallback
        watch.events_error = f"{type(e).__name__}: {e}"


async def probe_health(port: int, stop: Any) -> tuple[list[tuple], Counter[str]]:
    """GET /healthz every 0.1-0.25 s on its own connection until `stop` (a multiprocessing
    Event) is set: (the samples of Watch.health, the error kinds counted)."""
    conn = Connection(HOST, port)
    jitter = random.Random(0)
    health: list[tuple[float, float, int | None, str]] = []
    errors: Counter[str] = Counter()
    try:
        while not stop.is_set():
            t = time.monotonic()
            try:
                reply = await conn.request("GET", "/healthz", timeout=60.0)
                took = time.monotonic() - t
                if reply.status != 200:
                    raise HttpError(f"http_{reply.status}")
                data = reply.json()
                health.append((t, took, data.get("round"), str(data.get("state"))))
            except HttpError as e:
                health.append((t, time.monotonic() - t, None, e.kind))
                errors[e.kind] += 1
            await asyncio.sleep(jitter.uniform(0.1, 0.25))
    finally:
        conn.close()
    return health, errors


def _prober_main(port: int, stop: Any, out: Any) -> None:
    out.put(asyncio.run(probe_health(port, stop)))


class HealthProber:
    """probe_health in a process of its own, as the issue asks ("from a separate process"): in
    the bench's process it shared an event loop with the event stream's reader, whose bursts
    (a thousand update_received events as a round collects) delayed the timing of its replies.
    Its samples' times are time.monotonic(), which is the same clock in every process."""

    def __init__(self, port: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.out: Any = ctx.Queue()
        self.proc = ctx.Process(
            target=_prober_main, args=(port, self.stop, self.out), daemon=True, name="prober"
        )

    def start(self) -> None:
        self.proc.start()

    def finish(self, watch: Watch, timeout: float = 90.0) -> None:
        """Stop probing and add the samples to `watch` (blocking: call it in a thread). A prober
        that died leaves one error, `prober_died`, instead of its samples."""
        self.stop.set()
        try:
            health, errors = self.out.get(timeout=timeout)
        except queue.Empty:
            watch.health_errors["prober_died"] += 1
        else:
            watch.health.extend(health)
            watch.health_errors.update(errors)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()


async def get_text(port: int, path: str) -> str:
    conn = Connection(HOST, port)
    try:
        reply = await conn.request("GET", path, timeout=120.0)
    finally:
        conn.close()
    if reply.status != 200:
        raise HttpError(f"http_{reply.status}", reply.detail())
    return reply.body.decode()


async def get_json(port: int, path: str) -> Any:
    return json.loads(await get_text(port, path))


def summary_stats(values: list[float]) -> dict[str, float | int | None]:
    """Count, p50, p99 and max of latencies in seconds (rounded to 0.1 ms; None when empty)."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "n": len(values),
        "p50": r(percentile(values, 50)),
        "p99": r(percentile(values, 99)),
        "max": r(max(values) if values else None),
    }


def round_times(watch: Watch, rounds: int) -> dict[int, tuple[float, float]]:
    """round -> (opened, aggregated) on this process's monotonic clock: the events' server times
    (the same machine's clock: a WS event may arrive late), else both from the /healthz samples,
    else both when the events arrived."""
    out: dict[int, tuple[float, float]] = {}
    offset = time.time() - time.monotonic()
    for r in range(1, rounds + 1):
        opened: float | None
        done: float | None
        if r in watch.opened_at and r in watch.aggregated_at:
            opened, done = watch.opened_at[r] - offset, watch.aggregated_at[r] - offset
        else:  # both ends from the /healthz samples (timely) where there are some: an event that
            # arrived late (a lagging stream drops its oldest) is not set against a timely one
            opened = next((t for t, _, n, s in watch.health if n == r and s == "open"), None)
            done = next(
                (t for t, _, n, s in watch.health if n is not None and (n > r or s == "finished")),
                None,
            )
            if opened is None or done is None:
                opened, done = watch.opened.get(r), watch.aggregated.get(r)
        if opened is not None and done is not None and done >= opened:
            out[r] = (opened, done)
    return out


def split_by_phase(watch: Watch, rounds: int) -> dict[str, list[float]]:
    """The /healthz latencies during the rounds, by what the server was doing: "collecting" (a
    round open, uploads arriving) or "aggregating" (from the round's last upload to its
    aggregated event: the engine's worker thread, evaluation and checkpoint included). A probe
    whose request overlapped an aggregation counts as aggregating."""
    offset = time.time() - time.monotonic()
    spans = []
    for r in range(1, rounds + 1):
        if r in watch.last_upload_at and r in watch.aggregated_at:
            spans.append((watch.last_upload_at[r] - offset, watch.aggregated_at[r] - offset))
    times = round_times(watch, rounds)
    out: dict[str, list[float]] = {"collecting": [], "aggregating": []}
    for t, x, _, _ in watch.health:
        if not any(a <= t <= b for a, b in times.values()):
            continue
        busy = any(t <= b and t + x >= a for a, b in spans)
        out["aggregating" if busy else "collecting"].append(x)
    return out
