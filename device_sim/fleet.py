"""`fedkey devices`: a fleet of simulated phones that take part in a federation over HTTP.

Each phone enrolls under its shard's name (the same names and shards as `fedkey simulate`),
long-polls the server for its view of the current round and, when selected, downloads the global
model, trains with `phone_round` using the task's seed, reports its loss, and uploads if the
server's topK decision says so. What a phone uploads depends only on the task and its shard.

The phones run in `workers` spawn-context processes (one torch thread each, as the in-process
simulation's pool); inside a process every phone has its own thread, so all of them keep polling,
while a lock lets only one of them train at a time (one core per process, and torch's global seed
is set per training run). On CUDA the processes share the GPU.

For the server's tests some phones misbehave: `dropout_rate` (a selected phone vanishes for the
round: no loss report, no upload), `slow_rate` (waits `slow_seconds` before uploading) and the
last `malicious` phones attack: `scale` (the update delta times 100, a valid upload), `nan` (a NaN
in one tensor), `shape` (one tensor dropped, another flattened). A rejected upload is logged and
the phone carries on.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
import torch
from tqdm import tqdm

from device_sim.client import ApiError, DeviceClient, FedkeyError, ModelCache, Stopped
from device_sim.dataset import DataConfig, device_shards
from device_sim.trainer import TrainConfig, TrainResult, phone_round

log = logging.getLogger("fedkey.device")

ATTACKS = ("scale", "nan", "shape")
SCALE_FACTOR = 100.0

__all__ = [
    "ATTACKS",
    "DeviceReport",
    "FleetConfig",
    "PhoneConfig",
    "apply_attack",
    "run_device",
    "run_fleet",
]


# -- one phone --------------------------------------------------------------------------------


@dataclass
class PhoneConfig:
    """How one phone behaves (the honest default: always there, never slow, no attack)."""

    dropout_rate: float = 0.0  # per selected round: vanish (no loss report, no upload)
    slow_rate: float = 0.0  # per selected round: wait slow_seconds before uploading
    slow_seconds: float = 5.0
    attack: str | None = None  # None | "scale" | "nan" | "shape"
    seed: int = 0  # seeds the dropout / slow draws (with the name, round and attempt)
    device: str = "auto"  # where phone_round trains
    poll_wait: float = 30.0  # long-poll of GET /v1/rounds/current
    loss_wait: float = 30.0  # wait of POST /v1/rounds/{n}/loss

    def __post_init__(self) -> None:
        if self.attack is not None and self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {ATTACKS}")
        for name in ("dropout_rate", "slow_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


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
    slowed: int = 0
    declined: int = 0  # topK said do not upload
    stale: int = 0  # 409: the round moved on before it finished
    rejections: dict[str, int] = field(default_factory=dict)
    receipts: list[dict] = field(default_factory=list)
    finished: bool = False  # saw state "finished"
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def apply_attack(
    attack: str | None, trained: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A malicious phone's upload made from its honestly trained state (inputs are not modified)."""
    if attack is None:
        return trained
    if attack == "scale":  # boosted update: global + 100 * (trained - global), a valid upload
        return {
            k: global_state[k] + SCALE_FACTOR * (v - global_state[k]) for k, v in trained.items()
        }
    names = sorted(trained)
    out = dict(trained)
    if attack == "nan":
        t = out[names[0]].clone()
        t.view(-1)[0] = float("nan")
        out[names[0]] = t
        return out
    if attack == "shape":  # the last tensor dropped, the first (multi-dimensional) one flattened
        out.pop(names[-1])
        first = next((n for n in names[:-1] if out[n].dim() > 1), names[0])
        out[first] = out[first].reshape(-1)
        return out
    raise ValueError(f"unknown attack {attack!r}; choose one of {ATTACKS}")


def _num_samples(shard: list[list[int]]) -> int:
    return sum(len(s) - 1 for s in shard)


def _train_config(task: dict) -> TrainConfig:
    return TrainConfig(
        epochs=int(task["local_epochs"]),
        batch_size=int(task["batch_size"]),
        lr=float(task["lr"]),
        momentum=float(task["momentum"]),
        clip=float(task["clip"]),
        max_len=int(task["max_len"]),
    )


class _Phone:
    """The loop of one phone; see run_device."""

    MAX_REENROLL = 3
    MAX_TRIES = 3  # acting on one (round, attempt): a server that restarted may have lost an upload

    def __init__(self, client, name, shard, secret, phone, train_lock, stop, report):
        self.client: DeviceClient = client
        self.name = name
        self.shard = shard
        self.secret = secret
        self.phone: PhoneConfig = phone
        self.lock = train_lock if train_lock is not None else contextlib.nullcontext()
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

    def train(self, task: dict, key: tuple[int, int], model) -> TrainResult:
        task_key = (key, model.round, tuple(sorted((k, str(v)) for k, v in task.items())))
        if self.trained is not None and self.trained[0] == task_key:
            return self.trained[1]
        with self.lock:
            result = phone_round(
                model.config,
                model.state,
                self.shard,
                _train_config(task),
                seed=int(task["seed"]),
                beta=float(task.get("beta") or 0.0),
                sigma=float(task.get("sigma") if task.get("sigma") is not None else 1.0),
                device=self.phone.device,
            )
        self.report.trained += 1
        self.trained = (task_key, result)
        return result

    def participate(self, view: dict, key: tuple[int, int]) -> dict | None:
        """Act on a task; returns a newer view when one was fetched on the way."""
        r, attempt = key
        task = view["task"]
        draws = random.Random(f"fedkey-phone:{self.phone.seed}:{self.name}:{r}:{attempt}")
        vanish = draws.random() < self.phone.dropout_rate
        slow = draws.random() < self.phone.slow_rate
        self.selected.add(key)
        self.report.selected = len(self.selected)
        if vanish:
            self.report.dropped += 1
            self.handled.add(key)
            log.info("%s: vanishes from round %d (dropout)", self.name, r)
            return None
        model = self.client.download_model()
        want = task.get("model_round")
        if want is not None and model.round != int(want):
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
            same = (
                newer.get("state") == "open"
                and newer.get("round") == r
                and int(newer.get("attempt") or 0) == attempt
                and newer.get("selected")
            )
            if not same or newer.get("uploaded"):
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
        state = apply_attack(self.phone.attack, result.state, model.state)
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
    p = _Phone(client, name, shard, secret, phone or PhoneConfig(), train_lock, stop, report)
    try:
        p.run()
    except FedkeyError as e:
        report.error = str(e)
        raise
    return report


# -- the fleet ---------------------------------------------------------------------------------


@dataclass
class FleetConfig:
    server: str = "http://127.0.0.1:8000"
    count: int = 10  # N phones: device_shards(clients=N), names device-0.. as in `fedkey simulate`
    # The data fields must match the server's, so that the shards are those of `fedkey simulate`.
    data: str = "demo"
    partition: str = "iid"
    alpha: float = 0.5
    max_train_tokens: int | None = None
    paper_protocol: bool = False
    seed: int = 0  # the partition's seed, and the seed of the dropout / slow draws
    device: str = "auto"  # auto | cpu | cuda (the processes share the GPU)
    # Processes, one torch thread each; None: min(cpus, 8); 0: the phones run in this process.
    workers: int | None = None
    enrollment_secret: str = ""
    dropout_rate: float = 0.0
    slow_rate: float = 0.0
    slow_seconds: float = 5.0
    malicious: int = 0  # the last `malicious` phones attack
    attack: str = "scale"  # scale | nan | shape
    retry_seconds: float = 300.0  # how long a phone keeps retrying an unavailable server
    poll_wait: float = 30.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if not 0 <= self.malicious <= self.count:
            raise ValueError(f"malicious must be in [0, count={self.count}], got {self.malicious}")
        if self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {ATTACKS}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")

    def data_config(self) -> DataConfig:
        return DataConfig(
            data=self.data,
            paper_protocol=self.paper_protocol,
            clients=self.count,
            partition=self.partition,
            alpha=self.alpha,
            max_train_tokens=self.max_train_tokens,
            seed=self.seed,
        )

    def phone_config(self, malicious: bool) -> PhoneConfig:
        return PhoneConfig(
            dropout_rate=self.dropout_rate,
            slow_rate=self.slow_rate,
            slow_seconds=self.slow_seconds,
            attack=self.attack if malicious else None,
            seed=self.seed,
            device=self.device,
            poll_wait=self.poll_wait,
            loss_wait=self.poll_wait,
        )


class FleetError(FedkeyError):
    """The fleet could not run at all (e.g. every phone failed the same way)."""


def _http_client(connections: int) -> httpx.Client:
    # One long-poll per phone is open at any time: no pool limit to wait on.
    return httpx.Client(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=connections + 2),
        timeout=60.0,
    )


def _run_group(
    index: int,
    server: str,
    phones: list[tuple[str, list[list[int]], PhoneConfig]],
    secret: str,
    retry_seconds: float,
    stop,
    emit,
) -> None:
    """The phones of one process, one thread each; emits ("report", dict) per phone, then
    ("done", index)."""
    http = _http_client(len(phones))
    cache = ModelCache()  # one download per round serves every phone of the process
    lock = threading.Lock()  # one phone trains at a time (one core, torch's global seed)
    local_stop = threading.Event()
    reports: dict[str, DeviceReport] = {}
    sent: set[str] = set()

    def phone_thread(name, shard, phone):
        client = DeviceClient(
            server, http, cache=cache, retry_seconds=retry_seconds, stop=local_stop
        )
        report = DeviceReport(name)
        reports[name] = report
        p = _Phone(client, name, shard, secret, phone, lock, local_stop, report)
        try:
            p.run()
        except FedkeyError as e:
            if not local_stop.is_set():
                report.error = str(e)
                log.error("%s: %s", name, e)
        except Exception as e:  # a bug must not take the other phones down silently
            report.error = f"{type(e).__name__}: {e}"
            log.exception("%s crashed", name)

    threads = [
        threading.Thread(target=phone_thread, args=ph, name=ph[0], daemon=True) for ph in phones
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            if not t.is_alive() and t.name not in sent:
                sent.add(t.name)
                emit(("report", reports[t.name].to_dict()))
        if stop.is_set():
            local_stop.set()
            for t in threads:
                t.join(timeout=0.2)
            break
        stop.wait(0.2)
    for name, _, _ in phones:  # stopped: what the phones still running did so far
        if name not in sent and name in reports:
            for _ in range(3):
                try:
                    emit(("report", reports[name].to_dict()))
                    break
                except RuntimeError:  # changed while being copied
                    time.sleep(0.01)
    emit(("done", index))
    if not local_stop.is_set():
        http.close()


def _worker(
    index: int,
    server: str,
    phones: list[tuple[str, list[list[int]], PhoneConfig]],
    secret: str,
    retry_seconds: float,
    log_level: int,
    stop,
    results,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and sets `stop`
    torch.set_num_threads(1)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s [worker {index}] %(levelname)s %(message)s"
    )
    try:
        _run_group(index, server, phones, secret, retry_seconds, stop, results.put)
    except BaseException as e:  # report instead of dying silently
        results.put(("crash", index, f"worker {index}: {type(e).__name__}: {e}"))
        raise
    finally:
        results.close()
        results.join_thread()
    # Everything is reported. Phone threads may still be inside a long-poll after a stop, and a
    # torch interpreter takes seconds to tear down: leave at once.
    logging.shutdown()
    os._exit(0)


def _start_ignoring_sigint(procs) -> None:
    """Start the workers with SIGINT blocked: a spawned child inherits the signal mask, so a
    Ctrl-C in the terminal (sent to the whole process group) reaches only the parent, even while
    a child is still importing torch; the parent then stops them through the stop event. A
    Ctrl-C during the start stays pending and is delivered to the parent right after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


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
        "finished": sum(bool(r["finished"]) for r in reports.values()),
        "errors": {n: r["error"] for n, r in sorted(reports.items()) if r["error"]}
        | {f"crash-{i}": c for i, c in enumerate(crashes)},
        "interrupted": interrupted,
        "seconds": round(seconds, 2),
        "per_device": dict(sorted(reports.items())),
    }


def run_fleet(cfg: FleetConfig, progress: bool = True) -> dict:
    """Run `cfg.count` phones against the server until it finishes (or Ctrl-C); returns a summary:
    uploads, rejections by reason, rounds seen and completed, per-device reports, errors."""
    start = time.monotonic()
    torch.set_num_threads(1)
    http = _http_client(2)
    try:
        probe = DeviceClient(cfg.server, http, retry_seconds=cfg.retry_seconds)
        model = probe.download_model()  # the server's tokenizer encodes the private shards
        shards = device_shards(cfg.data_config(), model.tokenizer)
        names = list(shards)
        bad = set(names[len(names) - cfg.malicious :]) if cfg.malicious else set()
        phones = [(n, shards[n], cfg.phone_config(n in bad)) for n in names]
        workers = _default_workers() if cfg.workers is None else cfg.workers
        workers = min(workers, len(phones))
        groups = [phones[i::workers] for i in range(workers)] if workers > 0 else [phones]
        log_level = logging.getLogger().getEffectiveLevel()

        if workers > 0:
            ctx = mp.get_context("spawn")  # fork after torch has started is unsafe
            stop = ctx.Event()
            results = ctx.Queue()
            procs = [
                ctx.Process(
                    target=_worker,
                    args=(
                        i,
                        cfg.server,
                        group,
                        cfg.enrollment_secret,
                        cfg.retry_seconds,
                        log_level,
                        stop,
                        results,
                    ),
                    name=f"fedkey-phones-{i}",
                )
                for i, group in enumerate(groups)
            ]
        else:
            stop = threading.Event()
            results = queue.Queue()
            procs = [
                threading.Thread(
                    target=_run_group,
                    args=(
                        0,
                        cfg.server,
                        phones,
                        cfg.enrollment_secret,
                        cfg.retry_seconds,
                        stop,
                        results.put,
                    ),
                    daemon=True,
                )
            ]

        reports: dict[str, dict] = {}
        crashes: list[str] = []
        done: set[int] = set()  # groups that reported "done" (or crashed)
        dead_since: dict[int, float] = {}
        rounds_completed: int | None = None
        interrupted = False
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
                post = {k: f"{last[k]:.1f}" for k in ("val_ppl", "test_ppl") if k in last}
                uploads = sum(r["uploads"] for r in reports.values())
                bar.set_postfix(**post, **({"uploads": uploads} if reports else {}))
                bar.refresh()

        def handle(msg) -> None:
            if msg[0] == "report":
                reports[msg[1]["name"]] = msg[1]
            elif msg[0] == "done":
                done.add(msg[1])
                log.debug("phone group %d is done", msg[1])
            elif msg[0] == "crash":
                done.add(msg[1])
                crashes.append(msg[2])

        def drain(timeout: float) -> None:
            try:
                handle(results.get(timeout=timeout))
            except queue.Empty:
                return

        _start_ignoring_sigint(procs)
        try:
            last_poll = 0.0
            while len(done) < len(procs):
                drain(0.5)
                if time.monotonic() - last_poll > 2.0:
                    poll_metrics()
                    last_poll = time.monotonic()
                for i, p in enumerate(procs):
                    if i in done or p.is_alive():
                        continue
                    # Dead without "done": give its last messages a moment to arrive.
                    if time.monotonic() - dead_since.setdefault(i, time.monotonic()) > 3.0:
                        code = getattr(p, "exitcode", None)
                        crashes.append(f"worker {i}: exited (code {code}) without reporting")
                        done.add(i)
        except KeyboardInterrupt:
            interrupted = True
            bar.write("interrupted: stopping the phones")
            stop.set()
            until = time.monotonic() + 5.0
            while len(done) < len(procs) and time.monotonic() < until:
                with contextlib.suppress(KeyboardInterrupt):
                    drain(0.2)
        finally:
            log.debug("stopping the phone groups")
            stop.set()
            for p in procs:
                p.join(timeout=5.0 if workers > 0 else 1.0)
                if workers > 0 and p.is_alive():
                    p.terminate()
                    p.join()
            while True:  # reports that arrived late
                try:
                    msg = results.get_nowait()
                except (queue.Empty, OSError, ValueError):
                    break
                handle(msg)
            poll_metrics()
            bar.close()
    finally:
        http.close()

    summary = _summarize(
        cfg, workers, reports, crashes, rounds_completed, interrupted, time.monotonic() - start
    )
    if not interrupted and reports and all(r["error"] for r in reports.values()):
        first = next(iter(summary["errors"].items()))
        raise FleetError(f"every phone failed; {first[0]}: {first[1]}")
    return summary
