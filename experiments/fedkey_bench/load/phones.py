"""The fake phones of `fedkey-bench load`: the real phone's HTTP contract without the training.

Each phone is a coroutine with its own keep-alive HTTP/1.1 connection (fedkey.device_sim.client.async_http: h11
over asyncio streams, opened again when it closes), following fedkey.device_sim.client.http / fedkey.device_sim.fleets.thread_fleet step by step:

    enroll      POST /v1/devices (name, num_samples)
    follow      GET /v1/rounds/current?wait=S, long-polling for its view of the round to change
    selected    GET /v1/model with If-None-Match (its own ETag: an unchanged model is a 304);
                POST /v1/rounds/{n}/loss only while the upload decision is pending (FedMed topK);
                POST /v1/rounds/{n}/update with the global tensors plus a little noise
    finished    the phone stops

What a phone uploads is one of a few bodies built once per model version (fedkey_bench.load.phones.
ModelBodies: the global checkpoint's tensors plus small noise, as safetensors), so the driver's
CPU goes to HTTP and not to building tensors; only the first phone to download a version keeps the
body, the others count its bytes and drop them. A connection error, a timeout, a 503 or a 429
(Retry-After honoured) is retried with capped, jittered exponential backoff; every failed attempt
is counted by kind (`Stats.errors`), retried or not. Every loop is bounded in count, every request
in time; a phone that runs out gives up (`Stats.gave_up`).

Nothing here imports torch: the driver's processes stay small (the bench may shard phones over a
few of them, fedkey_bench.load.runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedkey.common.task import still_selected
from fedkey.device_sim.client.async_http import Connection, HttpError, Reply, raise_nofile
from fedkey.device_sim.client.protocol import (
    MAX_REENROLL,
    POLL_WAIT,
    actionable,
    round_key,
    transient_status,
)


class GaveUp(Exception):
    """A phone stopped before the run finished: its retries, steps or time ran out."""


# -- the bodies phones upload --------------------------------------------------------------------


def make_variants(checkpoint: bytes, count: int, noise: float, seed: int) -> list[bytes]:
    """`count` upload bodies from a downloaded checkpoint: its tensors plus N(0, noise^2) on every
    float tensor, as safetensors without metadata (what fedkey.device_sim.client.http.upload sends)."""
    from safetensors.numpy import load, save

    tensors = load(checkpoint)
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        out = {}
        for name, value in tensors.items():
            if value.dtype.kind == "f":
                jitter = rng.standard_normal(value.shape, dtype=np.float32) * noise
                out[name] = (value + jitter).astype(value.dtype)
            else:
                out[name] = value
        bodies.append(save(out))
    return bodies


class ModelBodies:
    """The upload bodies of each model version (by ETag), built once from the first download of
    it; the last `keep` versions are kept."""

    def __init__(self, variants: int = 8, noise: float = 1e-3, keep: int = 3) -> None:
        self.variants = variants
        self.noise = noise
        self.keep = keep
        self.bodies: dict[str, list[bytes]] = {}
        self.claimed: set[str] = set()
        self.built: dict[str, asyncio.Event] = {}

    def claim(self, etag: str | None) -> bool:
        """Whether the caller, which is downloading version `etag`, should keep the body and build
        from it (True for the first caller of a version until it builds or releases it)."""
        if etag is None or etag in self.bodies or etag in self.claimed:
            return False
        self.claimed.add(etag)
        return True

    def release(self, etag: str) -> None:
        """The claimer's download failed: let the next downloader of `etag` build."""
        if etag in self.claimed:
            self.claimed.discard(etag)
            self.built.setdefault(etag, asyncio.Event()).set()  # wake waiters to try themselves

    async def build(self, etag: str, checkpoint: bytes) -> None:
        seed = zlib.crc32(etag.encode())
        bodies = await asyncio.to_thread(make_variants, checkpoint, self.variants, self.noise, seed)
        self.bodies[etag] = bodies
        self.claimed.discard(etag)
        self.built.setdefault(etag, asyncio.Event()).set()
        for old in list(self.bodies)[: -self.keep]:
            del self.bodies[old]
            self.built.pop(old, None)

    async def wait(self, etag: str, timeout: float) -> bool:
        """Wait until `etag`'s bodies are built (True) or its claimer gave up / time ran out."""
        if etag in self.bodies:
            return True
        event = self.built.setdefault(etag, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
        if etag not in self.bodies and event.is_set():
            self.built[etag] = asyncio.Event()  # the next claimer's turn
        return etag in self.bodies

    def body(self, etag: str, index: int) -> bytes:
        versions = self.bodies[etag]
        return versions[index % len(versions)]


# -- what a shard of phones measures ---------------------------------------------------------------


@dataclass
class Stats:
    """What the phones of one driver process saw; `merge` adds up shards. Plain data (pickled
    from a shard process to the bench)."""

    errors: Counter[str] = field(default_factory=Counter)  # failed attempts by kind
    statuses: Counter[str] = field(default_factory=Counter)  # "GET /v1/model 200" -> count
    uploads: Counter[str] = field(default_factory=Counter)  # round -> accepted uploads
    events: Counter[str] = field(default_factory=Counter)  # enrolled, finished, stale, ...
    gave_up: Counter[str] = field(default_factory=Counter)  # why phones stopped early
    rejected: Counter[str] = field(default_factory=Counter)  # "403 detail" -> count
    latency: dict[str, list[float]] = field(default_factory=dict)  # route -> seconds
    bytes_down: int = 0
    bytes_up: int = 0
    connections: int = 0

    def took(self, route: str, seconds: float) -> None:
        self.latency.setdefault(route, []).append(seconds)

    def merge(self, other: Stats) -> None:
        for name in ("errors", "statuses", "uploads", "events", "gave_up", "rejected"):
            getattr(self, name).update(getattr(other, name))
        for route, values in other.latency.items():
            self.latency.setdefault(route, []).extend(values)
        self.bytes_down += other.bytes_down
        self.bytes_up += other.bytes_up
        self.connections += other.connections


@dataclass(frozen=True)
class PhoneConfig:
    """How the fake phones behave (every field plain data: it is pickled to shard processes)."""

    host: str
    port: int
    secret: str
    poll_wait: float = POLL_WAIT  # long-poll of GET /v1/rounds/current (device_sim's default)
    loss_wait: float = 30.0
    request_timeout: float = 120.0  # seconds for a reply, on top of a long-poll's wait
    retry_seconds: float = 300.0  # how long one request's transient failures are retried
    max_retries: int = 50  # ... and how many times
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    ramp: float = 0.0  # phones start at uniform random times within this many seconds
    max_steps: int = 2000  # views one phone acts on or waits for
    variants: int = 8  # distinct upload bodies per model version
    noise: float = 1e-3
    # The driver processes' nice value above the bench's. In a deployment the phones are other
    # machines; here they share the server's two cores, and with nice > 0 the server wins a CPU
    # whenever both want one, so /healthz measures the server rather than the phones' CPU.
    nice: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(np.ceil(q / 100 * len(ordered))) - 1))
    return ordered[rank]


class Phone:
    """One fake phone: fedkey.device_sim.fleets.phone's loop (enroll, follow, act when selected; the same
    decisions, fedkey.device_sim.client.protocol) over its own connection, uploading noisy copies of the global
    model instead of training."""

    def __init__(self, index: int, cfg: PhoneConfig, stats: Stats, models: ModelBodies) -> None:
        self.index = index
        self.cfg = cfg
        self.stats = stats
        self.models = models
        self.name = f"load-{index:05d}"
        self.num_samples = 50 + index % 100
        self.conn = Connection(cfg.host, cfg.port)
        self.token: str | None = None
        self.etag: str | None = None
        self.model_round: int | None = None
        self.handled: set[tuple[int, int]] = set()
        self.tries: Counter[tuple[int, int]] = Counter()
        self.reenrolled = 0
        self.jitter = random.Random(index)

    async def run(self) -> None:
        try:
            if self.cfg.ramp > 0:
                await asyncio.sleep(self.jitter.uniform(0, self.cfg.ramp))
            await self.enroll()
            await self.follow()
        except GaveUp as e:
            self.stats.gave_up[str(e)] += 1
        finally:
            self.stats.connections += self.conn.opened
            self.conn.close()

    # -- transport -------------------------------------------------------------------------------

    async def call(
        self,
        route: str,
        method: str,
        target: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
        wait: float = 0.0,
        keep: Callable[[dict[str, str]], bool] | None = None,
        auth: bool = True,
    ) -> Reply:
        """A request with retries of transient failures; returns the first non-transient reply
        (its status may be a 4xx: the caller decides). Every failed attempt is counted."""
        hs = list(headers or [])
        if auth:
            hs.append(("Authorization", f"Bearer {self.token}"))
        started = time.monotonic()
        for attempt in range(self.cfg.max_retries + 1):
            retry_after = 0.0
            t0 = time.perf_counter()
            try:
                reply = await self.conn.request(
                    method, target, hs, body, self.cfg.request_timeout + wait, keep
                )
            except HttpError as e:
                kind = e.kind
            else:
                self.stats.statuses[f"{method} {route} {reply.status}"] += 1
                if not transient_status(reply.status):
                    if reply.status < 400 and not wait:
                        self.stats.took(f"{method} {route}", time.perf_counter() - t0)
                    return reply
                kind = f"http_{reply.status}"
                with contextlib.suppress(ValueError):
                    retry_after = float(reply.headers.get("retry-after", 0))
            self.stats.errors[f"{kind} ({method} {route})"] += 1
            if time.monotonic() - started > self.cfg.retry_seconds:
                break
            delay = min(self.cfg.backoff_max, self.cfg.backoff_initial * 2**attempt)
            delay = max(delay * self.jitter.uniform(0.5, 1.0), min(retry_after, 60.0))
            await asyncio.sleep(delay)
        raise GaveUp(f"{method} {route}: retries spent (last: {kind})")

    async def bearer(self, route: str, method: str, target: str, **kwargs: Any) -> Reply:
        """A call with the device token; a 401 enrolls again (as fedkey.device_sim.fleets.thread_fleet) and retries."""
        reply = await self.call(route, method, target, **kwargs)
        if reply.status == 401 and self.reenrolled < MAX_REENROLL:
            self.reenrolled += 1
            self.stats.events["reenrolled"] += 1
            await self.enroll()
            reply = await self.call(route, method, target, **kwargs)
        return reply

    # -- the contract ----------------------------------------------------------------------------

    async def enroll(self) -> None:
        for suffix in ("", "-b", "-c"):
            body = json.dumps(
                {
                    "enrollment_secret": self.cfg.secret,
                    "name": self.name + suffix,
                    "num_samples": self.num_samples,
                }
            ).encode()
            headers = [("Content-Type", "application/json")]
            reply = await self.call("/v1/devices", "POST", "/v1/devices", headers, body, auth=False)
            if reply.status == 200:
                self.token = str(reply.json()["token"])
                self.stats.events["enrolled"] += 1
                return
            if reply.status != 409:
                raise GaveUp(f"POST /v1/devices: {reply.status} {reply.detail()}")
            # 409: an earlier attempt was enrolled but its reply was lost: another name.
            self.stats.errors["enroll_reply_lost (POST /v1/devices)"] += 1
        raise GaveUp("POST /v1/devices: every name taken")

    async def current(self, wait: float) -> dict[str, Any]:
        target = f"/v1/rounds/current?wait={max(wait, 0.0):g}"
        reply = await self.bearer("/v1/rounds/current", "GET", target, wait=wait)
        if reply.status != 200:
            raise GaveUp(f"GET /v1/rounds/current: {reply.status} {reply.detail()}")
        view: dict[str, Any] = reply.json()
        return view

    async def download(self) -> int | None:
        """GET /v1/model with this phone's ETag -> the model's round; the version's upload bodies
        are built (by the first phone that downloads it) before it returns."""
        for _ in range(3):
            headers = [("If-None-Match", self.etag)] if self.etag else []
            claimed: list[str] = []

            def keep(h: dict[str, str], claimed: list[str] = claimed) -> bool:
                etag = h.get("etag")
                if etag is not None and self.models.claim(etag):
                    claimed.append(etag)
                    return True
                return False

            reply: Reply | None = None
            try:
                reply = await self.call("/v1/model", "GET", "/v1/model", headers, keep=keep)
            finally:
                if claimed and (reply is None or reply.status != 200):
                    self.models.release(claimed[0])
            if reply.status == 304:
                self.stats.events["model_304"] += 1
                if self.etag is None or self.etag not in self.models.bodies:
                    self.etag = None  # its bodies are gone (an old version): download it whole
                    continue
                return self.model_round
            if reply.status != 200:
                raise GaveUp(f"GET /v1/model: {reply.status} {reply.detail()}")
            etag = reply.headers.get("etag")
            if etag is None:
                raise GaveUp("GET /v1/model: no ETag")
            self.stats.events["model_200"] += 1
            self.stats.bytes_down += reply.size
            if claimed:
                try:
                    await self.models.build(etag, reply.body)
                except Exception as e:
                    self.models.release(etag)
                    raise GaveUp(f"GET /v1/model: not a safetensors file ({e})") from None
            elif not await self.models.wait(etag, self.cfg.request_timeout):
                self.etag = None  # its builder failed: download it again and build
                continue
            self.etag = etag
            self.model_round = int(reply.headers.get("x-fedkey-round", "-1"))
            return self.model_round
        raise GaveUp("GET /v1/model: no usable download")

    async def follow(self) -> None:
        view = await self.current(0)
        for _ in range(self.cfg.max_steps):
            if view.get("state") == "finished":
                self.stats.events["finished"] += 1
                return
            key = round_key(view)
            if actionable(view, key, self.handled, self.tries):
                self.tries[key] += 1
                newer = await self.participate(view, key)
                view = newer if newer is not None else await self.current(0)
                continue
            started, before = time.monotonic(), view
            view = await self.current(self.cfg.poll_wait)
            if view == before and time.monotonic() - started < 0.05:
                await asyncio.sleep(min(0.5, self.cfg.poll_wait))  # a server that does not wait
        raise GaveUp(f"still not finished after {self.cfg.max_steps} views")

    async def participate(self, view: dict[str, Any], key: tuple[int, int]) -> dict | None:
        """Act on a task (download, loss report if pending, upload); a newer view when one was
        fetched on the way."""
        r, attempt = key
        self.stats.events["selected"] += 1
        model_round = await self.download()
        if model_round != view["task"].get("model_round"):
            self.stats.events["model_behind"] += 1
            await asyncio.sleep(0.2)
            return None
        loss = 4.0 + self.jitter.random()
        decision = view.get("upload")
        if decision is None and not view.get("loss_reported"):
            body = json.dumps({"train_loss": loss, "num_samples": self.num_samples}).encode()
            reply = await self.bearer(
                "/v1/rounds/{n}/loss",
                "POST",
                f"/v1/rounds/{r}/loss?wait={self.cfg.loss_wait:g}",
                headers=[("Content-Type", "application/json")],
                body=body,
                wait=self.cfg.loss_wait,
            )
            if reply.status != 200:
                self.refused(reply, key, "loss")
                return None
            decision = reply.json().get("upload")
        for _ in range(100):
            if decision is not None:
                break
            newer = await self.current(self.cfg.loss_wait)
            if not still_selected(newer, r, attempt) or newer.get("uploaded"):
                return newer
            decision = newer.get("upload")
        if decision is not True:
            self.handled.add(key)
            self.stats.events["declined" if decision is False else "undecided"] += 1
            return None
        assert self.etag is not None
        body = self.models.body(self.etag, self.index)
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("X-Fedkey-Num-Samples", str(self.num_samples)),
            ("X-Fedkey-Train-Loss", repr(loss)),
        ]
        reply = await self.bearer(
            "/v1/rounds/{n}/update", "POST", f"/v1/rounds/{r}/update", headers=headers, body=body
        )
        if reply.status != 200:
            self.refused(reply, key, "update")
            return None
        self.stats.uploads[str(r)] += 1
        self.stats.bytes_up += len(body)
        return None

    def refused(self, reply: Reply, key: tuple[int, int], what: str) -> None:
        self.handled.add(key)
        if (
            reply.status == 409
        ):  # the round moved on: not an error (fedkey.device_sim.fleets.thread_fleet's "stale")
            self.stats.events[f"stale_{what}"] += 1
        else:
            self.stats.rejected[f"{what} {reply.status} {reply.detail()}"] += 1


async def run_phones(cfg: PhoneConfig, indexes: Iterable[int], stats: Stats) -> None:
    """Run the phones `indexes` in this event loop until every one finished or gave up."""
    models = ModelBodies(cfg.variants, cfg.noise)
    phones = [Phone(i, cfg, stats, models) for i in indexes]
    results = await asyncio.gather(*(p.run() for p in phones), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            stats.gave_up[f"crashed: {type(result).__name__}: {result}"] += 1


def shard_main(cfg: PhoneConfig, indexes: list[int], queue: Any) -> None:
    """A driver process's life: its phones in one event loop, then their Stats on `queue`."""
    raise_nofile()
    if cfg.nice > 0:
        os.nice(cfg.nice)
    stats = Stats()
    try:
        asyncio.run(run_phones(cfg, indexes, stats))
    finally:
        queue.put(stats)
