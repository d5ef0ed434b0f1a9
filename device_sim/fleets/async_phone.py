"""Phones as asyncio tasks: thousands of them in one event loop (one Ray actor of the Ray fleet,
fedkey.device_sim.fleets.ray_fleet), each an idle coroutine and a keep-alive connection while it long-polls.

`AsyncDeviceClient` is fedkey.device_sim.client.http's DeviceClient over the lean h11 connection of
fedkey.device_sim.client.async_http: the same requests, the same retries (client.Backoff: capped exponential
backoff with jitter, Retry-After honoured, for `retry_seconds`), the same errors (ApiError for the
server's 4xx, ServerUnavailable when the retries are spent, Stopped when the fleet stops), the
same upload bytes (client.upload_request). `run_phone` drives the phone's protocol
(fedkey.device_sim.fleets.phone.PhoneLoop, shared with the thread fleet) with it, so an asyncio phone sends
what a thread phone sends; its training goes wherever its `train` coroutine sends it (a Ray
trainer actor in the Ray fleet, a worker thread in `thread_trainer`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

from fedkey.device_sim.client.async_http import Connection, HttpError, Reply, split_url
from fedkey.device_sim.client.http import (
    ApiError,
    ClientBase,
    FedkeyError,
    GlobalModel,
    Stopped,
    checkpoint_of,
    detail_of,
    retry_after,
    transient_status,
    upload_request,
)
from fedkey.device_sim.config import PhoneConfig
from fedkey.device_sim.fleets.phone import (
    Call,
    DeviceReport,
    Op,
    PhoneLoop,
    Steps,
    Train,
    advance,
    failed,
)
from fedkey.device_sim.training.process_pool import LocalTask, run_task
from fedkey.device_sim.training.trainer import TrainResult

log = logging.getLogger("fedkey.device")

#: Trains a phone's task from a downloaded global model, asynchronously.
AsyncTrainer = Callable[[LocalTask, GlobalModel], Awaitable[TrainResult]]

__all__ = [
    "AsyncDeviceClient",
    "AsyncModelCache",
    "AsyncTrainer",
    "drive_async",
    "pause",
    "run_phone",
    "thread_trainer",
]


class AsyncModelCache:
    """The last downloaded model and its ETag, shared by the phones of one event loop: one
    download per model version serves all of them (the others wait on the lock, then get a 304)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.etag: str | None = None
        self.model: GlobalModel | None = None


async def pause(stop: asyncio.Event | None, seconds: float) -> bool:
    """Sleep `seconds`; True (at once) when `stop` is set meanwhile."""
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass
    return stop.is_set()


class AsyncDeviceClient(ClientBase):
    """One phone's keep-alive connection to the server at `base_url`; see the module docstring.

    `timeout`: seconds for a reply (long-polls get their wait on top); `stop`: an event that ends
    the backoff waits (`Stopped`). The arguments are DeviceClient's."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        cache: AsyncModelCache | None = None,
        retry_seconds: float = 300.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        timeout: float = 60.0,
        stop: asyncio.Event | None = None,
    ) -> None:
        try:
            host, port, self.prefix, tls = split_url(base_url)
        except ValueError as e:
            raise FedkeyError(f"the server's URL: {e}") from None
        super().__init__(token, retry_seconds, backoff_initial, backoff_max, timeout, stop)
        self.conn = Connection(host, port, connect_timeout=timeout, tls=tls)
        self.cache = cache if cache is not None else AsyncModelCache()

    def close(self) -> None:
        self.conn.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        auth: bool = True,
        wait: float = 0.0,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        body: bytes = b"",
    ) -> Reply:
        """Send with retries; returns a reply whose status is < 400, raises otherwise."""
        hs = self._start(method, path, auth, headers)
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        backoff = self._backoff(method, path)
        while True:
            self._check_stop(method, path)
            at_least = 0.0
            try:
                reply = await self.conn.request(
                    method, target, hs.items(), body, self.timeout + max(wait, 0.0)
                )
            except HttpError as e:
                status, problem = None, str(e)
            else:
                if reply.status < 400:
                    backoff.answered()
                    return reply
                detail = detail_of(reply.body)
                if not transient_status(reply.status):
                    raise ApiError(reply.status, detail, method, path)
                status, problem = reply.status, f"{reply.status}: {detail}"
                at_least = retry_after(reply.headers.get("retry-after"))
            if await pause(self.stop, backoff.next_delay(problem, status, at_least)):
                raise Stopped("stopped while waiting to retry")

    # -- the contract (DeviceClient's methods) ----------------------------------------------------

    async def enroll(
        self, secret: str, name: str | None = None, num_samples: int | None = None
    ) -> tuple[str, str]:
        """POST /v1/devices -> (device_id, token); the token is kept for the later calls."""
        data = self._enrollment(secret, name, num_samples)
        reply = await self.request("POST", "/v1/devices", auth=False, **_json(data))
        return self._enrolled(reply.json())

    async def current(self, wait: float = 0.0) -> dict:
        """GET /v1/rounds/current, long-polling up to `wait` s for this device's view to change."""
        params = {"wait": f"{max(wait, 0.0):g}"}
        view: dict = (
            await self.request("GET", "/v1/rounds/current", params=params, wait=wait)
        ).json()
        return view

    async def download_model(self) -> GlobalModel:
        """GET /v1/model, cached by ETag in the shared cache (read the state, never modify it)."""
        cache = self.cache
        async with cache.lock:
            headers = {}
            if cache.etag is not None and cache.model is not None:
                headers["If-None-Match"] = cache.etag
            reply = await self.request("GET", "/v1/model", auth=False, headers=headers)
            if reply.status == 304:
                if cache.model is None:
                    raise FedkeyError("the server answered 304 Not Modified but nothing is cached")
                return cache.model
            # Parsing a checkpoint is CPU work: off the loop, so the other phones keep polling.
            model = await asyncio.to_thread(
                checkpoint_of, reply.body, reply.headers.get("x-fedkey-round")
            )
            cache.etag = reply.headers.get("etag")
            cache.model = model
            return model

    async def report_loss(
        self, round_idx: int, loss: float, num_samples: int, wait: float = 0.0
    ) -> bool | None:
        """POST /v1/rounds/{n}/loss -> the topK upload decision (None: still pending)."""
        data = {"train_loss": float(loss), "num_samples": int(num_samples)}
        reply = await self.request(
            "POST",
            f"/v1/rounds/{round_idx}/loss",
            params={"wait": f"{max(wait, 0.0):g}"},
            wait=wait,
            **_json(data),
        )
        decision: bool | None = reply.json().get("upload")
        return decision

    async def upload(
        self, round_idx: int, state: dict, num_samples: int, train_loss: float
    ) -> dict:
        """POST /v1/rounds/{n}/update with the state as a raw safetensors body -> the receipt."""
        body, headers = await asyncio.to_thread(upload_request, state, num_samples, train_loss)
        reply = await self.request(
            "POST", f"/v1/rounds/{round_idx}/update", headers=headers, body=body
        )
        receipt: dict = reply.json()
        return receipt


def _json(data: dict) -> dict[str, Any]:
    return {"headers": {"Content-Type": "application/json"}, "body": json.dumps(data).encode()}


# -- the phone -------------------------------------------------------------------------------------


async def drive_async(steps: Steps, execute: Callable[[Op], Awaitable[Any]]) -> None:
    """fedkey.device_sim.fleets.phone.drive for coroutines: run a phone's protocol, awaiting each op."""
    value: Any = None
    error: Exception | None = None
    while (op := advance(steps, value, error)) is not None:
        try:
            value, error = await execute(op), None
        except Exception as e:
            value, error = None, e


def thread_trainer(lock: threading.Lock | None = None) -> AsyncTrainer:
    """Train in a worker thread of this process, one at a time (torch's global seed is set per
    training run): for a few phones without Ray (tests, `fedkey_bench.fleet_memory`'s idle phones)."""
    lock = lock if lock is not None else threading.Lock()

    def locked(task: LocalTask, state: dict) -> TrainResult:
        with lock:
            return run_task(task, state)

    async def train(task: LocalTask, model: GlobalModel) -> TrainResult:
        return await asyncio.to_thread(locked, task, model.state)

    return train


async def run_phone(
    client: AsyncDeviceClient,
    name: str,
    shard: list[list[int]],
    secret: str,
    phone: PhoneConfig,
    train: AsyncTrainer,
    stop: asyncio.Event | None,
    report: DeviceReport,
) -> None:
    """One phone's life as a coroutine (enroll, follow the rounds until "finished" or `stop`);
    its failures end up in `report.error`, never in the other phones of the loop."""

    async def execute(op: Op) -> Any:
        if isinstance(op, Call):
            return await getattr(client, op.method)(*op.args)
        if isinstance(op, Train):
            return await train(op.task, op.model)
        return await pause(stop, op.seconds)

    try:
        await drive_async(PhoneLoop(name, shard, secret, phone, stop, report).run(), execute)
    except Exception as e:
        failed(report, e, stop)
    finally:
        client.close()
