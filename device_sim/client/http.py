"""The phone's side of the HTTP contract (docs/how-to/http-federation.md; the generated HTTP API reference): one `DeviceClient` per phone.

Control messages are JSON, tensors are safetensors bytes. Transient failures (the server is
restarting: connection refused or reset, a 5xx, a 429, a timeout; or a body that stalled on the
way, 408) are retried with capped exponential backoff for up to `retry_seconds`; any other 4xx is
the server's answer and is raised at once as an `ApiError` carrying the status and the server's
"detail" message.

The model download is cached by ETag: the client sends `If-None-Match` and a 304 reuses the cached
state. A `ModelCache` can be shared by the phones of one process (they all train on the same
global model), so one download per round serves all of them.
"""

from __future__ import annotations

import json
import logging
import random
import struct
import threading
import time
from typing import Any, NamedTuple

import httpx
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.device_sim.client.protocol import transient_status
from fedkey.models.checkpoint import CheckpointError, check_state
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import Tokenizer, tokenizer_from_config

log = logging.getLogger("fedkey.device")

__all__ = [
    "ApiError",
    "Backoff",
    "ClientBase",
    "DeviceClient",
    "FedkeyError",
    "GlobalModel",
    "ModelCache",
    "ServerUnavailable",
    "Stopped",
    "checkpoint_of",
    "detail_of",
    "parse_checkpoint",
    "retry_after",
    "transient_status",
    "upload_request",
]


class FedkeyError(Exception):
    """Anything that goes wrong talking to the federation server."""


class ApiError(FedkeyError):
    """The server answered with an error status (4xx; 5xx only once the retries are spent)."""

    def __init__(self, status: int, detail: str, method: str = "", path: str = ""):
        self.status = status
        self.detail = detail
        self.method = method
        self.path = path
        super().__init__(f"{method} {path} -> {status}: {detail}".strip())


class ServerUnavailable(FedkeyError):
    """Transient failures went on for longer than the retry budget."""

    def __init__(self, message: str, status: int | None = None, detail: str = ""):
        self.status = status  # the last HTTP status, or None when the server could not be reached
        self.detail = detail
        super().__init__(message)


class Stopped(FedkeyError):
    """The phone was asked to stop while it was waiting to retry."""


class GlobalModel(NamedTuple):
    round: int
    config: ModelConfig
    tokenizer: Tokenizer
    state: dict[str, torch.Tensor]


class ModelCache:
    """The last downloaded model and its ETag; thread-safe, shareable between phones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.etag: str | None = None
        self.model: GlobalModel | None = None


def _safetensors_metadata(body: bytes) -> dict[str, str]:
    if len(body) < 8:
        raise CheckpointError("the model download is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", body[:8])
    try:
        header = json.loads(body[8 : 8 + n])
    except ValueError as e:
        raise CheckpointError(f"the model download has no readable safetensors header: {e}") from e
    return header.get("__metadata__") or {}


def parse_checkpoint(body: bytes, round_header: str | None = None) -> GlobalModel:
    """A checkpoint file's bytes -> (round, model config, tokenizer, state), checked."""
    meta_raw = _safetensors_metadata(body)
    if "fedkey" not in meta_raw:
        raise CheckpointError(
            "the model download is not a fedkey checkpoint (no 'fedkey' metadata)"
        )
    meta = json.loads(meta_raw["fedkey"])
    config = ModelConfig(**meta["model"])
    tokenizer = tokenizer_from_config(meta["tokenizer"])
    state = st_load(body)
    check_state(state, config)
    rnd = int(round_header) if round_header is not None else int(meta.get("round", 0))
    return GlobalModel(rnd, config, tokenizer, state)


def detail_of(body: bytes, reason: str = "") -> str:
    """The server's "detail" message of an error reply's body (else the body, shortened)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace") or reason
    if isinstance(data, dict) and "detail" in data:
        d = data["detail"]
        return d if isinstance(d, str) else json.dumps(d)
    return json.dumps(data)[:500]


def retry_after(value: str | None) -> float:
    """A Retry-After header's seconds (0 when absent or not a number of seconds)."""
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


class Backoff:
    """One request's retries: capped exponential backoff with jitter (so a fleet does not hammer a
    restarting server in step), at least the server's Retry-After, for up to `retry_seconds` from
    the first failure. Both phone clients (this module's and fedkey.device_sim.fleets.async_phone's) use it."""

    def __init__(
        self,
        method: str,
        path: str,
        retry_seconds: float,
        initial: float,
        maximum: float,
        jitter: random.Random,
    ) -> None:
        self.what = f"{method} {path}"
        self.retry_seconds = retry_seconds
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self.deadline: float | None = None
        self.attempt = 0

    def next_delay(self, problem: str, status: int | None, wait_at_least: float = 0.0) -> float:
        """Seconds to wait before the next attempt after a transient failure (`problem`);
        ServerUnavailable once the budget is spent."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.retry_seconds
            log.warning(
                "%s failed (%s); retrying for up to %.0f s", self.what, problem, self.retry_seconds
            )
        if now >= self.deadline:
            message = f"{self.what}: the server stayed unavailable for {self.retry_seconds:.0f} s (last: {problem})"
            raise ServerUnavailable(message, status, problem)
        delay = min(self.maximum, self.initial * 2**self.attempt) * self.jitter.uniform(0.5, 1.0)
        delay = min(max(delay, min(wait_at_least, self.maximum)), self.deadline - now)
        self.attempt += 1
        return max(delay, 0.0)

    def answered(self) -> None:
        """The request got a final answer: say so when it took retries."""
        if self.attempt:
            log.info("%s: the server answers again", self.what)


def upload_request(
    state: dict[str, torch.Tensor], num_samples: int, train_loss: float
) -> tuple[bytes, dict[str, str]]:
    """The body (safetensors) and headers of POST /v1/rounds/{n}/update."""
    body = st_save({k: v.detach().cpu().contiguous() for k, v in state.items()})
    headers = {
        "Content-Type": "application/octet-stream",
        "X-Fedkey-Num-Samples": str(int(num_samples)),
        "X-Fedkey-Train-Loss": repr(float(train_loss)),
    }
    return body, headers


def checkpoint_of(body: bytes, round_header: str | None) -> GlobalModel:
    """The model download's body as a GlobalModel; FedkeyError when it is not a usable one."""
    try:
        return parse_checkpoint(body, round_header)
    except (CheckpointError, ValueError, KeyError, TypeError) as e:
        raise FedkeyError(f"GET /v1/model: the download is not a usable model: {e}") from e


class ClientBase:
    """What both phone clients (this module's DeviceClient, fedkey.device_sim.fleets.async_phone's
    AsyncDeviceClient) keep and decide alike: the device token, the retry budget and backoff
    (`retry_seconds`; doubling from `backoff_initial` up to `backoff_max` seconds, with jitter),
    the reply timeout (`timeout`; long-polls get their wait on top) and the fleet's `stop`."""

    def __init__(
        self,
        token: str | None,
        retry_seconds: float,
        backoff_initial: float,
        backoff_max: float,
        timeout: float,
        stop: Any,
    ) -> None:
        self.token = token
        self.device_id: str | None = None
        self.retry_seconds = retry_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.timeout = timeout
        self.stop = stop
        self._jitter = random.Random()  # timing only: never touches what is trained or uploaded

    def _start(self, method: str, path: str, auth: bool, headers: dict | None) -> dict[str, str]:
        """A request's headers (with the bearer token when `auth`), checking a phone that was
        stopped or never enrolled."""
        out = dict(headers or {})
        if auth:
            if self.token is None:
                raise FedkeyError(f"{method} {path} needs a device token: enroll first")
            out["Authorization"] = f"Bearer {self.token}"
        return out

    def _backoff(self, method: str, path: str) -> Backoff:
        return Backoff(
            method, path, self.retry_seconds, self.backoff_initial, self.backoff_max, self._jitter
        )

    def _check_stop(self, method: str, path: str) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"stopped before {method} {path}")

    @staticmethod
    def _enrollment(secret: str, name: str | None, num_samples: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"enrollment_secret": secret}
        if name is not None:
            body["name"] = name
        if num_samples is not None:
            body["num_samples"] = int(num_samples)
        return body

    def _enrolled(self, reply: dict) -> tuple[str, str]:
        self.device_id, self.token = str(reply["device_id"]), str(reply["token"])
        return self.device_id, self.token


class DeviceClient(ClientBase):
    """One phone's connection to the server at `base_url` through the (shareable) `http` client.

    `retry_seconds`: how long transient failures of one request are retried before
    `ServerUnavailable`; the backoff doubles from `backoff_initial` up to `backoff_max` seconds
    (with jitter, so a fleet does not hammer a restarting server in step). `stop`: an event that
    interrupts the backoff waits (`Stopped`). `timeout`: seconds for connect / write / a reply
    (long-polls get their wait on top).
    """

    def __init__(
        self,
        base_url: str,
        http: httpx.Client,
        *,
        token: str | None = None,
        cache: ModelCache | None = None,
        retry_seconds: float = 300.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
        timeout: float = 60.0,
        stop: threading.Event | None = None,
    ):
        super().__init__(token, retry_seconds, backoff_initial, backoff_max, timeout, stop)
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.cache = cache if cache is not None else ModelCache()

    # -- transport -------------------------------------------------------------------------------

    def _timeout(self, wait: float = 0.0) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, read=self.timeout + max(wait, 0.0))

    def _sleep(self, seconds: float) -> None:
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            raise Stopped("stopped while waiting to retry")

    def request(
        self,
        method: str,
        path: str,
        *,
        auth: bool = True,
        wait: float = 0.0,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send with retries; returns a response whose status is < 400, raises otherwise."""
        headers = self._start(method, path, auth, headers)
        url = self.base_url + path
        backoff = self._backoff(method, path)
        while True:
            self._check_stop(method, path)
            at_least = 0.0
            try:
                resp = self.http.request(
                    method, url, headers=headers, timeout=self._timeout(wait), **kwargs
                )
            except httpx.UnsupportedProtocol:
                raise
            except httpx.TransportError as e:
                status, problem = None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if resp.status_code < 400:
                    backoff.answered()
                    return resp
                detail = detail_of(resp.content, resp.reason_phrase)
                if not transient_status(resp.status_code):
                    raise ApiError(resp.status_code, detail, method, path)
                status, problem = resp.status_code, f"{resp.status_code}: {detail}"
                at_least = retry_after(resp.headers.get("Retry-After"))
            self._sleep(backoff.next_delay(problem, status, at_least))

    # -- the contract ----------------------------------------------------------------------------

    def enroll(
        self, secret: str, name: str | None = None, num_samples: int | None = None
    ) -> tuple[str, str]:
        """POST /v1/devices -> (device_id, token); the token is kept for the later calls."""
        body = self._enrollment(secret, name, num_samples)
        return self._enrolled(self.request("POST", "/v1/devices", auth=False, json=body).json())

    def current(self, wait: float = 0.0) -> dict:
        """GET /v1/rounds/current, long-polling up to `wait` seconds for this device's view to change."""
        params = {"wait": f"{max(wait, 0.0):g}"}
        return self.request("GET", "/v1/rounds/current", params=params, wait=wait).json()

    def download_model(self) -> GlobalModel:
        """GET /v1/model -> (round, model config, tokenizer, state); cached by ETag (304 reuses it).

        The returned state is shared with the cache (and the other phones of the cache): read it,
        never modify it in place.
        """
        cache = self.cache
        with cache.lock:
            headers = {}
            if cache.etag is not None and cache.model is not None:
                headers["If-None-Match"] = cache.etag
            resp = self.request("GET", "/v1/model", auth=False, headers=headers)
            if resp.status_code == 304:
                if cache.model is None:
                    raise FedkeyError("the server answered 304 Not Modified but nothing is cached")
                return cache.model
            model = checkpoint_of(resp.content, resp.headers.get("X-Fedkey-Round"))
            cache.etag = resp.headers.get("ETag")
            cache.model = model
            return model

    def report_loss(
        self, round_idx: int, loss: float, num_samples: int, wait: float = 0.0
    ) -> bool | None:
        """POST /v1/rounds/{n}/loss -> the topK upload decision (None: still pending)."""
        reply = self.request(
            "POST",
            f"/v1/rounds/{round_idx}/loss",
            params={"wait": f"{max(wait, 0.0):g}"},
            json={"train_loss": float(loss), "num_samples": int(num_samples)},
            wait=wait,
        ).json()
        return reply.get("upload")

    def upload(
        self,
        round_idx: int,
        state: dict[str, torch.Tensor],
        num_samples: int,
        train_loss: float,
    ) -> dict:
        """POST /v1/rounds/{n}/update with the state as a raw safetensors body -> the receipt.

        Retrying is safe: the server answers a repeated identical upload with the same receipt.
        """
        body, headers = upload_request(state, num_samples, train_loss)
        return self.request(
            "POST", f"/v1/rounds/{round_idx}/update", content=body, headers=headers
        ).json()

    def health(self) -> dict:
        return self.request("GET", "/healthz", auth=False).json()

    def metrics(self) -> list[dict]:
        """GET /v1/metrics -> the metrics rows (one per completed round, round 0 the initial model)."""
        return self.request("GET", "/v1/metrics", auth=False).json().get("rounds", [])
