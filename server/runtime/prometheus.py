"""Prometheus metrics of `fedkey server`: counters and gauges of the round lifecycle."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Seconds between two wake-ups of watch_loop_lag.
LOOP_LAG_EVERY = 0.1


class Telemetry:
    """Prometheus metrics in a registry of their own (several apps can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.uploads_accepted = Counter(
            "fedkey_uploads_accepted", "Updates accepted (duplicates not counted)", registry=r
        )
        self.uploads_rejected = Counter(
            "fedkey_uploads_rejected",
            "Updates (kind=update) and loss reports (kind=loss) refused",
            ["reason", "kind"],
            registry=r,
        )
        self.loss_reports = Counter("fedkey_loss_reports", "Loss reports accepted", registry=r)
        self.rounds_completed = Counter(
            "fedkey_rounds_completed", "Rounds aggregated into the global model", registry=r
        )
        self.rounds_failed = Counter(
            "fedkey_rounds_failed", "Round attempts that missed their quorum", registry=r
        )
        self.current_round = Gauge("fedkey_current_round", "The round open or next", registry=r)
        self.devices = Gauge("fedkey_devices_enrolled", "Enrolled devices", registry=r)
        self.enroll_limited = Counter(
            "fedkey_enroll_rate_limited",
            "Enrollment attempts answered 429 (per-IP rate limit)",
            registry=r,
        )
        self.storage_full = Counter(
            "fedkey_storage_full",
            "Writes the full disk refused: uploads answered 507 (what=update), aggregations "
            "postponed (what=aggregation)",
            ["what"],
            registry=r,
        )
        self.downloads_dropped = Counter(
            "fedkey_model_downloads_dropped",
            "GET /v1/model answers not sent whole: why=busy (no download slot, "
            "FEDKEY_MAX_SENDING, came free in time: 503 + Retry-After), why=stalled (the reader "
            "read nothing for FEDKEY_SEND_TIMEOUT s: the connection was closed mid-body)",
            ["why"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "fedkey_event_loop_lag_seconds",
            f"How late the event loop ran a wake-up due every {LOOP_LAG_EVERY:g} s: what any "
            "request waited before the loop could start on it",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.aggregation_seconds = Histogram(
            "fedkey_aggregation_seconds",
            "Aggregate + privacy + evaluate + checkpoint, per round",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )


async def watch_loop_lag(lag: Histogram, stopped: asyncio.Event) -> None:
    """Until `stopped`, observe how late the loop wakes a sleep of LOOP_LAG_EVERY seconds. A late
    wake-up is a stalled loop (a long callback, a garbage collection, the GIL or the CPU held by
    another), which every request in flight waited for as well."""
    loop = asyncio.get_running_loop()
    while not stopped.is_set():
        due = loop.time() + LOOP_LAG_EVERY
        await asyncio.sleep(LOOP_LAG_EVERY)
        lag.observe(max(0.0, loop.time() - due))
