"""`fedkey devices`: a fleet of simulated phones that take part in a federation over HTTP.

Each phone enrolls under its shard's name (the same names and shards as `fedkey simulate`),
long-polls the server for its view of the current round and, when selected, downloads the global
model, trains with `phone_round` using the task's seed, reports its loss, and uploads if the
server's topK decision says so. What a phone uploads depends only on the task and its shard.

Every phone is a thread of the fleet's process, so all of them keep polling; their training
goes to the same pool of `workers` processes as the in-process simulation (fedkey.device_sim.training.process_pool: one
torch thread each, every shard in every process, so the cores stay evenly loaded whichever
phones a round selects). On CUDA the processes share the GPU.

For the server's tests some phones misbehave: `dropout_rate` (a selected phone vanishes for the
round: no loss report, no upload), `slow_rate` (waits `slow_seconds` before uploading) and the
last `malicious` phones attack (fedkey.device_sim.attacks): `scale` (the update delta times 100, a valid
upload), `signflip` (the delta times -10), `backdoor` (trained on poisoned sentences, then model
replacement), `nan` (a NaN in one tensor), `shape` (one tensor dropped, another flattened). A
rejected upload is logged and the phone carries on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import torch
from tqdm import tqdm

from fedkey.corpora.dataset import device_shards
from fedkey.device_sim.attacks import SCALE_FACTOR, apply_attack
from fedkey.device_sim.client.http import DeviceClient, FedkeyError, ModelCache
from fedkey.device_sim.config import ATTACKS, FleetConfig, PhoneConfig
from fedkey.device_sim.fleets.phone import Call, DeviceReport, Op, PhoneLoop, Train, drive, failed
from fedkey.device_sim.training.process_pool import (
    LocalTask,
    TrainerPool,
    default_workers,
    run_task,
)
from fedkey.device_sim.training.trainer import TrainResult

log = logging.getLogger("fedkey.device")

Trainer = Callable[[LocalTask, dict], TrainResult]  # trains a phone's task from a global state


__all__ = [
    "ATTACKS",
    "DeviceReport",
    "FleetConfig",
    "SCALE_FACTOR",
    "PhoneConfig",
    "apply_attack",
    "run_device",
    "run_fleet",
]


# -- one phone ---------------------------------------------------------------------------------


def sync_executor(
    client: DeviceClient, trainer: Trainer, stop: threading.Event | None
) -> Callable[[Op], Any]:
    """Carry out a phone's ops (fedkey.device_sim.fleets.phone) in the calling thread: calls on its blocking
    `client`, training through `trainer`, pauses cut short by `stop`."""

    def execute(op: Op) -> Any:
        if isinstance(op, Call):
            return getattr(client, op.method)(*op.args)
        if isinstance(op, Train):
            return trainer(op.task, op.model.state)
        if stop is None:
            time.sleep(op.seconds)
            return False
        return stop.wait(op.seconds)

    return execute


def _run_phone(client, name, shard, secret, phone, trainer, stop, report) -> None:
    loop = PhoneLoop(name, shard, secret, phone, stop, report)
    drive(loop.run(), sync_executor(client, trainer, stop))


def local_trainer(lock: threading.Lock | None = None) -> Trainer:
    """Train in the calling thread (under `lock`: torch's global seed is set per training run)."""

    def train(task: LocalTask, state: dict) -> TrainResult:
        with lock if lock is not None else contextlib.nullcontext():
            return run_task(task, state)

    return train


def run_device(
    client: DeviceClient,
    name: str,
    shard: list[list[int]],
    secret: str,
    phone: PhoneConfig | None = None,
    *,
    train_lock: threading.Lock | None = None,
    stop: threading.Event | None = None,
) -> DeviceReport:
    """One phone's life: enroll as `name` with its training tokens, then follow the rounds until
    the server says "finished" (or `stop` is set). Errors other than a rejected upload or a stale
    round (ApiError, ServerUnavailable) end the phone: they are recorded in the report's `error`
    and raised."""
    report = DeviceReport(name)
    trainer = local_trainer(train_lock)
    try:
        _run_phone(client, name, shard, secret, phone or PhoneConfig(), trainer, stop, report)
    except FedkeyError as e:
        report.error = str(e)
        raise
    return report


# -- the fleet ---------------------------------------------------------------------------------


class FleetError(FedkeyError):
    """The fleet could not run at all (e.g. every phone failed the same way)."""


def _http_client(connections: int) -> httpx.Client:
    # One long-poll per phone is open at any time: no pool limit to wait on.
    return httpx.Client(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=connections + 2),
        timeout=60.0,
    )


def _phone_thread(client: DeviceClient, name, shard, secret, phone, trainer, stop, report) -> None:
    """One phone's loop in a thread of the fleet; its failures end up in its report."""
    try:
        _run_phone(client, name, shard, secret, phone, trainer, stop, report)
    except Exception as e:  # a bug must not take the other phones down silently
        failed(report, e, stop)


def summarize(cfg, workers, reports, crashes, rounds_completed, interrupted, seconds) -> dict:
    """The fleet's summary (what `fedkey devices` prints) from its phones' reports (dicts);
    FleetError when every phone failed (nothing of the run worked: say why once)."""
    rejections: Counter[str] = Counter()
    for r in reports.values():
        rejections.update(r["rejections"])
    total = {
        k: sum(r[k] for r in reports.values())
        for k in ("selected", "trained", "uploads", "dropped", "slowed", "declined", "stale")
    }
    summary = {
        "server": cfg.server,
        "devices": cfg.count,
        "workers": workers,
        "rounds_completed": rounds_completed,
        "rounds_seen": sorted({x for r in reports.values() for x in r["rounds_seen"]}),
        **total,
        "rejections": dict(rejections),
        "precision": sorted({r["precision"] for r in reports.values() if r["precision"]}),
        "finished": sum(bool(r["finished"]) for r in reports.values()),
        "errors": {n: r["error"] for n, r in sorted(reports.items()) if r["error"]}
        | {f"crash-{i}": c for i, c in enumerate(crashes)},
        "interrupted": interrupted,
        "seconds": round(seconds, 2),
        "per_device": dict(sorted(reports.items())),
    }
    if not interrupted and reports and all(r["error"] for r in reports.values()):
        first = next(iter(summary["errors"].items()))
        raise FleetError(f"every phone failed; {first[0]}: {first[1]}")
    return summary


def fleet_phones(cfg: FleetConfig, tokenizer) -> list[tuple[str, list[list[int]], PhoneConfig]]:
    """Every phone of the fleet: (name, private shard, behaviour). The shards are those of
    `fedkey simulate --clients N` (encoded with the server's tokenizer); the last
    `cfg.malicious` phones attack."""
    shards = device_shards(cfg.data_config(), tokenizer)
    if cfg.name_prefix:  # e.g. several fleet containers against one server
        shards = {f"{cfg.name_prefix}-{k.split('-', 1)[1]}": v for k, v in shards.items()}
    names = list(shards)
    bad = set(names[len(names) - cfg.malicious :]) if cfg.malicious else set()
    return [(n, shards[n], cfg.phone_config(n in bad)) for n in names]


class RoundsBar:
    """The fleet's progress bar: rounds completed (GET /v1/metrics), the last perplexities and
    the uploads so far (`uploads()`)."""

    def __init__(
        self, cfg: FleetConfig, http: httpx.Client, uploads: Callable[[], int], progress: bool
    ) -> None:
        self.url = cfg.server.rstrip("/") + "/v1/metrics"
        self.http = http
        self.uploads = uploads
        self.completed: int | None = None
        self.bar = tqdm(
            desc=f"{cfg.count} phones on {cfg.server}", unit="round", disable=not progress
        )

    def poll(self) -> None:
        try:
            rows = self.http.get(self.url, timeout=5.0).json().get("rounds", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            return  # the server may be restarting; the phones retry on their own
        if not rows:
            return
        last = max(rows, key=lambda row: row.get("round", 0))
        n = int(last.get("round", 0))
        if self.completed is None or n != self.completed:
            self.completed = n
            self.bar.n = n
            post: dict[str, object] = {
                k: f"{last[k]:.1f}" for k in ("val_ppl", "test_ppl") if k in last
            }
            post["uploads"] = self.uploads()
            self.bar.set_postfix(dict(sorted(post.items())))  # sorted, as tqdm orders **kwargs
            self.bar.refresh()

    def write(self, line: str) -> None:
        self.bar.write(line)

    def close(self) -> None:
        self.poll()
        self.bar.close()


def fleet_pool(cfg: FleetConfig) -> TrainerPool:
    """The training processes of `cfg`'s phones: start them early, their start takes seconds."""
    workers = default_workers() if cfg.workers is None else cfg.workers
    return TrainerPool(min(workers, cfg.count))


def run_fleet(cfg: FleetConfig, progress: bool = True, pool: TrainerPool | None = None) -> dict:
    """Run `cfg.count` phones against the server until it finishes (or Ctrl-C); returns a summary:
    uploads, rejections by reason, rounds seen and completed, per-device reports, errors.

    Every phone is a thread of this process that polls, downloads, reports and uploads; their
    training goes to `pool` (default: `fleet_pool(cfg)`, closed at the end; a pool passed in is
    the caller's to close), so the cores stay evenly loaded whichever phones a round selects, as
    in `fedkey simulate`. (fedkey.device_sim.fleets.ray_fleet runs the same phones on a Ray cluster.)
    """
    start = time.monotonic()
    torch.set_num_threads(1)
    own_pool = pool is None
    if pool is None:
        pool = fleet_pool(cfg)
    http = _http_client(cfg.count)
    stop = threading.Event()
    reports: dict[str, DeviceReport] = {}
    interrupted = False
    try:
        probe = DeviceClient(cfg.server, http, retry_seconds=cfg.retry_seconds)
        model = probe.download_model()  # the server's tokenizer encodes the private shards
        cache = ModelCache()  # one download per round serves every phone
        threads = []
        for name, shard, phone in fleet_phones(cfg, model.tokenizer):
            client = DeviceClient(
                cfg.server, http, cache=cache, retry_seconds=cfg.retry_seconds, stop=stop
            )
            reports[name] = DeviceReport(name)
            args = (client, name, shard, cfg.enrollment_secret, phone, pool.train, stop)
            threads.append(
                threading.Thread(
                    target=_phone_thread, args=(*args, reports[name]), name=name, daemon=True
                )
            )
        bar = RoundsBar(cfg, http, lambda: sum(r.uploads for r in reports.values()), progress)
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                bar.poll()
                for t in threads:
                    t.join(timeout=2.0 / len(threads))
        except KeyboardInterrupt:
            interrupted = True
            bar.write("interrupted: stopping the phones")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=1.0)
            bar.close()
    finally:
        if own_pool:
            pool.close()
        http.close()

    done = {n: r.to_dict() for n, r in reports.items()}
    seconds = time.monotonic() - start
    return summarize(cfg, pool.workers, done, [], bar.completed, interrupted, seconds)
