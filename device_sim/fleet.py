"""`fedkey devices`: a fleet of simulated phones that take part in a federation over HTTP.

Each phone enrolls under its shard's name (the same names and shards as `fedkey simulate`),
long-polls the server for its view of the current round and, when selected, downloads the global
model, trains with `phone_round` using the task's seed, reports its loss, and uploads if the
server's topK decision says so. What a phone uploads depends only on the task and its shard.

Every phone is a thread of the fleet's process, so all of them keep polling; their training
goes to the same pool of `workers` processes as the in-process simulation (device_sim.pool: one
torch thread each, every shard in every process, so the cores stay evenly loaded whichever
phones a round selects). On CUDA the processes share the GPU.

For the server's tests some phones misbehave: `dropout_rate` (a selected phone vanishes for the
round: no loss report, no upload), `slow_rate` (waits `slow_seconds` before uploading) and the
last `malicious` phones attack (device_sim.attacks): `scale` (the update delta times 100, a valid
upload), `signflip` (the delta times -10), `backdoor` (trained on poisoned sentences, then model
replacement), `nan` (a NaN in one tensor), `shape` (one tensor dropped, another flattened). A
rejected upload is logged and the phone carries on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
import torch
from tqdm import tqdm

from common.task import RoundTask, still_selected
from corpora.dataset import device_shards
from device_sim.attacks import SCALE_FACTOR, apply_attack, backdoor_task, boost_factor
from device_sim.client import ApiError, DeviceClient, FedkeyError, ModelCache, Stopped
from device_sim.config import ATTACKS, FleetConfig, PhoneConfig
from device_sim.pool import LocalTask, TrainerPool, default_workers, run_task
from device_sim.trainer import TrainResult

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


# -- one phone --------------------------------------------------------------------------------


@dataclass
class DeviceReport:
    """What one phone did; `rejections` maps "status detail" to a count."""

    name: str
    device_id: str | None = None
    rounds_seen: list[int] = field(default_factory=list)
    selected: int = 0  # (round, attempt) views in which it was selected and acted
    trained: int = 0
    uploads: int = 0  # accepted uploads
    dropped: int = 0  # vanished on purpose (dropout_rate)
    dropped_rounds: list[int] = field(default_factory=list)
    slowed: int = 0
    declined: int = 0  # topK said do not upload
    stale: int = 0  # 409: the round moved on before it finished
    rejections: dict[str, int] = field(default_factory=dict)
    receipts: list[dict] = field(default_factory=list)
    finished: bool = False  # saw state "finished"
    error: str | None = None
    precision: str | None = None  # what its last training ran in (the task's, resolved here)

    def to_dict(self) -> dict:
        return asdict(self)


def _num_samples(shard: list[list[int]]) -> int:
    return sum(len(s) - 1 for s in shard)


class _Phone:
    """The loop of one phone; see run_device."""

    MAX_REENROLL = 3
    MAX_TRIES = 3  # acting on one (round, attempt): a server that restarted may have lost an upload

    def __init__(self, client, name, shard, secret, phone, trainer, stop, report):
        self.client: DeviceClient = client
        self.name = name
        self.shard = shard
        self.secret = secret
        self.phone: PhoneConfig = phone
        self.trainer: Trainer = trainer
        self.stop = stop
        self.report: DeviceReport = report
        self.num_samples = _num_samples(shard)
        self.handled: set[tuple[int, int]] = set()  # (round, attempt) this phone is done with
        self.trained: tuple[tuple, TrainResult] | None = None  # the last training, by task
        self.reenrolled = 0
        self.tries: Counter[tuple[int, int]] = Counter()
        self.selected: set[tuple[int, int]] = set()

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def enroll(self) -> None:
        device_id, _ = self.client.enroll(self.secret, self.name, self.num_samples)
        self.report.device_id = device_id

    def call(self, fn, *args, **kwargs):
        """A bearer call; a 401 (the server lost this device, e.g. a restart on a fresh store)
        re-enrolls under the same name and tries once more."""
        try:
            return fn(*args, **kwargs)
        except ApiError as e:
            if e.status != 401 or self.reenrolled >= self.MAX_REENROLL:
                raise
            self.reenrolled += 1
            log.warning("%s: %s; enrolling again", self.name, e)
            self.enroll()
            return fn(*args, **kwargs)

    def pause(self, seconds: float) -> bool:
        """Sleep; True when stopped meanwhile."""
        if self.stop is None:
            time.sleep(seconds)
            return False
        return self.stop.wait(seconds)

    def run(self) -> None:
        try:
            self.follow()
        except Stopped:
            return  # asked to stop while waiting on the server: not an error

    def follow(self) -> None:
        self.enroll()
        view = self.call(self.client.current, 0)
        while not self.stopped():
            self.see(view)
            if view.get("state") == "finished":
                self.report.finished = True
                return
            key = (int(view["round"]), int(view.get("attempt") or 0))
            if self.trained is not None and self.trained[0][0] != key:
                self.trained = None  # a new round: free the last trained weights
            if self.actionable(view, key):
                self.tries[key] += 1
                try:
                    newer = self.participate(view, key)
                except ApiError as e:
                    self.handled.add(key)
                    if e.status == 409:  # the round moved on: not an error
                        self.report.stale += 1
                        log.info("%s: round %d moved on (%s)", self.name, key[0], e.detail)
                    else:  # e.g. 403 on the loss report: the server does not want this phone
                        self.reject(e, key[0], "loss report")
                    newer = None
                view = newer if newer is not None else self.call(self.client.current, 0)
                continue
            started, before = time.monotonic(), view
            view = self.call(self.client.current, self.phone.poll_wait)
            if view == before and time.monotonic() - started < 0.05:
                self.pause(min(0.5, self.phone.poll_wait))  # a server that does not long-poll

    def reject(self, e: ApiError, r: int, what: str) -> None:
        reason = f"{e.status} {e.detail}"
        self.report.rejections[reason] = self.report.rejections.get(reason, 0) + 1
        log.warning("%s: %s for round %d rejected: %s", self.name, what, r, reason)

    def see(self, view: dict) -> None:
        r = view.get("round")
        if isinstance(r, int) and (not self.report.rounds_seen or self.report.rounds_seen[-1] != r):
            self.report.rounds_seen.append(r)

    def actionable(self, view: dict, key: tuple[int, int]) -> bool:
        return (
            view.get("state") == "open"
            and bool(view.get("selected"))
            and view.get("task") is not None
            and not view.get("uploaded")
            and view.get("upload") is not False
            and key not in self.handled
            and self.tries[key] < self.MAX_TRIES
        )

    def train(self, task: RoundTask, key: tuple[int, int], model) -> TrainResult:
        task_key = (key, model.round, repr(task))
        if self.trained is not None and self.trained[0] == task_key:
            return self.trained[1]
        local = LocalTask(
            device_id=self.name,
            shard=self.shard,
            seed=task.seed,
            model_config=model.config,
            train=task.train,
            beta=task.beta,
            sigma=task.sigma,
            device=self.phone.device,
        )
        if self.phone.attack == "backdoor":  # its shard mixed with poisoned sentences
            local = backdoor_task(local, model.tokenizer, self.phone.backdoor)
        result = self.trainer(local, model.state)
        if self.phone.attack == "backdoor":  # it declares its own shard's size, as if honest
            result = dataclasses.replace(result, num_tokens=self.num_samples)
        self.report.trained += 1
        self.report.precision = result.precision
        self.trained = (task_key, result)
        return result

    def participate(self, view: dict, key: tuple[int, int]) -> dict | None:
        """Act on a task; returns a newer view when one was fetched on the way."""
        r, attempt = key
        task = RoundTask.from_json(view["task"])
        draws = random.Random(f"fedkey-phone:{self.phone.seed}:{self.name}:{r}:{attempt}")
        vanish = draws.random() < self.phone.dropout_rate
        slow = draws.random() < self.phone.slow_rate
        self.selected.add(key)
        self.report.selected = len(self.selected)
        if vanish:
            self.report.dropped += 1
            self.report.dropped_rounds.append(r)
            self.handled.add(key)
            log.info("%s: vanishes from round %d (dropout)", self.name, r)
            return None
        model = self.client.download_model()
        want = task.model_round
        if model.round != want:
            # The global model is not the one the task is for: look at the round again.
            log.info("%s: task wants model %s, server has %s", self.name, want, model.round)
            self.tries[key] -= 1
            self.pause(0.2)
            return None
        result = self.train(task, key, model)
        decision = view.get("upload")
        if not view.get("loss_reported"):
            decision = self.call(
                self.client.report_loss,
                r,
                result.train_loss,
                result.num_tokens,
                self.phone.loss_wait,
            )
        while decision is None:
            if self.stopped():
                return None
            newer = self.call(self.client.current, self.phone.loss_wait)
            self.see(newer)
            if not still_selected(newer, r, attempt) or newer.get("uploaded"):
                return newer
            decision = newer.get("upload")
        if decision is False:
            self.handled.add(key)
            self.report.declined += 1
            return None
        if slow:
            self.report.slowed += 1
            log.info(
                "%s: slow, waiting %.1f s before uploading", self.name, self.phone.slow_seconds
            )
            if self.pause(self.phone.slow_seconds):
                return None
        boost = boost_factor(self.phone.backdoor, cohort=1)  # the fleet sets boost (its size)
        state = apply_attack(self.phone.attack, result.state, model.state, boost)
        try:
            receipt = self.call(self.client.upload, r, state, result.num_tokens, result.train_loss)
        except ApiError as e:
            if e.status == 409:
                raise
            self.handled.add(key)
            self.reject(e, r, "upload")
            return None
        # Not `handled`: if a restarted server lost the upload, its view says so and the phone
        # sends the same bytes again (at most MAX_TRIES times).
        self.report.uploads += 1
        self.report.receipts.append(receipt)
        return None


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
    p = _Phone(
        client,
        name,
        shard,
        secret,
        phone or PhoneConfig(),
        local_trainer(train_lock),
        stop,
        report,
    )
    try:
        p.run()
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
        _Phone(client, name, shard, secret, phone, trainer, stop, report).run()
    except FedkeyError as e:
        if not stop.is_set():
            report.error = str(e)
            log.error("%s: %s", name, e)
    except Exception as e:  # a bug must not take the other phones down silently
        report.error = f"{type(e).__name__}: {e}"
        log.exception("%s crashed", name)


def _summarize(cfg, workers, reports, crashes, rounds_completed, interrupted, seconds) -> dict:
    rejections: Counter[str] = Counter()
    for r in reports.values():
        rejections.update(r["rejections"])
    total = {
        k: sum(r[k] for r in reports.values())
        for k in ("selected", "trained", "uploads", "dropped", "slowed", "declined", "stale")
    }
    return {
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
    in `fedkey simulate`.
    """
    start = time.monotonic()
    torch.set_num_threads(1)
    own_pool = pool is None
    if pool is None:
        pool = fleet_pool(cfg)
    http = _http_client(cfg.count)
    stop = threading.Event()
    reports: dict[str, DeviceReport] = {}
    rounds_completed: int | None = None
    interrupted = False
    try:
        probe = DeviceClient(cfg.server, http, retry_seconds=cfg.retry_seconds)
        model = probe.download_model()  # the server's tokenizer encodes the private shards
        shards = device_shards(cfg.data_config(), model.tokenizer)
        if cfg.name_prefix:  # e.g. several fleet containers against one server
            shards = {f"{cfg.name_prefix}-{k.split('-', 1)[1]}": v for k, v in shards.items()}
        names = list(shards)
        bad = set(names[len(names) - cfg.malicious :]) if cfg.malicious else set()
        cache = ModelCache()  # one download per round serves every phone
        threads = []
        for name in names:
            client = DeviceClient(
                cfg.server, http, cache=cache, retry_seconds=cfg.retry_seconds, stop=stop
            )
            reports[name] = DeviceReport(name)
            args = (
                client,
                name,
                shards[name],
                cfg.enrollment_secret,
                cfg.phone_config(name in bad),
                pool.train,
                stop,
                reports[name],
            )
            threads.append(
                threading.Thread(target=_phone_thread, args=args, name=name, daemon=True)
            )
        bar = tqdm(desc=f"{cfg.count} phones on {cfg.server}", unit="round", disable=not progress)

        def poll_metrics() -> None:
            nonlocal rounds_completed
            try:
                rows = http.get(cfg.server.rstrip("/") + "/v1/metrics", timeout=5.0).json()
                rows = rows.get("rounds", [])
            except (httpx.HTTPError, ValueError):
                return  # the server may be restarting; the phones retry on their own
            if not rows:
                return
            last = max(rows, key=lambda row: row.get("round", 0))
            n = int(last.get("round", 0))
            if rounds_completed is None or n != rounds_completed:
                rounds_completed = n
                bar.n = n
                post: dict[str, object] = {
                    k: f"{last[k]:.1f}" for k in ("val_ppl", "test_ppl") if k in last
                }
                post["uploads"] = sum(r.uploads for r in reports.values())
                bar.set_postfix(dict(sorted(post.items())))  # sorted, as tqdm orders **kwargs
                bar.refresh()

        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                poll_metrics()
                for t in threads:
                    t.join(timeout=2.0 / len(threads))
        except KeyboardInterrupt:
            interrupted = True
            bar.write("interrupted: stopping the phones")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=1.0)
            poll_metrics()
            bar.close()
    finally:
        if own_pool:
            pool.close()
        http.close()

    done = {n: r.to_dict() for n, r in reports.items()}
    summary = _summarize(
        cfg, pool.workers, done, [], rounds_completed, interrupted, time.monotonic() - start
    )
    if not interrupted and done and all(r["error"] for r in done.values()):
        first = next(iter(summary["errors"].items()))
        raise FleetError(f"every phone failed; {first[0]}: {first[1]}")
    return summary
