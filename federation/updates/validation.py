"""Checks on what devices send: pure functions that raise ValidationError(status, message, reason).

The upload body is a safetensors file holding the device's trained weights. In the contract's
order: a body larger than the model plus a margin -> 413 (refused from its Content-Length, or
while it streams in when that header is absent or lies); bytes that are not safetensors -> 400;
wrong tensor names, shapes or dtypes -> 422; NaN or Inf -> 422; missing or malformed
X-Fedkey-Num-Samples / X-Fedkey-Train-Loss headers -> 422.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as st_load_file

from fedkey.models.checkpoint import CheckpointError, check_state
from fedkey.models.config import ModelConfig

NUM_SAMPLES_HEADER = "X-Fedkey-Num-Samples"
TRAIN_LOSS_HEADER = "X-Fedkey-Train-Loss"


class ValidationError(Exception):
    """A request the server refuses: HTTP `status`, a `message` for people, a short `reason`."""

    def __init__(
        self, status: int, message: str, reason: str, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.headers = headers  # e.g. Retry-After on a 507


def shown(value: object, limit: int = 40) -> str:
    """A value a device sent, for a reply: repr() of a string, str() of a number, cut to about
    `limit` characters so that a reply (and the event and log line it becomes) never echoes pages."""
    text = repr(value) if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 10]}... ({len(text)} characters)"


def too_large(limit: int, what: str) -> ValidationError:
    return ValidationError(
        413,
        f"upload {what} is larger than the model plus the allowed margin ({limit} bytes)",
        "too_large",
    )


def check_content_length(value: str | None, limit: int) -> None:
    """Refuse from the declared size alone, before any of the body is read."""
    if value is None:
        return
    try:
        declared = int(value)
    except ValueError:
        raise ValidationError(
            400, f"Content-Length {shown(value)} is not a number", "bad_request"
        ) from None
    if declared < 0:
        raise ValidationError(400, f"Content-Length {shown(declared)} is negative", "bad_request")
    if declared > limit:
        raise too_large(limit, f"of {shown(declared)} bytes")


#: Seconds a request body may go without a byte before it is refused (408): a phone that stalls
#: mid-body (or a slow-loris client) does not hold its connection and its temporary file forever.
BODY_IDLE_TIMEOUT = 30.0


async def idle_limited(
    chunks: AsyncIterator[bytes], deadline: float | None = None
) -> AsyncIterator[bytes]:
    """The body's chunks, refusing it (408) when ``BODY_IDLE_TIMEOUT`` seconds pass without one,
    or when the event loop's clock reaches `deadline` before its end (a body that trickles in,
    a byte just before each idle limit, would otherwise hold its connection for hours). Only
    the wait for the next chunk is timed: nothing else is cancelled."""
    loop = asyncio.get_running_loop()
    it = aiter(chunks)
    while True:
        wait = BODY_IDLE_TIMEOUT
        if deadline is not None:
            wait = min(wait, deadline - loop.time())
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _stalled(deadline is not None and loop.time() >= deadline) from None
        yield chunk


def _stalled(late: bool) -> ValidationError:
    if late:
        why = "the request body came too slowly: it did not end in time (FEDKEY_MIN_UPLOAD_RATE)"
    else:
        why = f"the request body stalled: no bytes for {BODY_IDLE_TIMEOUT:g} s"
    return ValidationError(408, f"{why}; send it again", "stalled")


async def read_limited(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """Read a JSON control body, refusing it (413) as soon as more than `limit` bytes have come
    (an upload streams to disk instead: fedkey.federation.updates.store)."""
    parts: list[bytes] = []
    total = 0
    async for chunk in idle_limited(chunks):
        total += len(chunk)
        if total > limit:
            raise ValidationError(
                413, f"the body is larger than {limit} bytes: send a small JSON object", "too_large"
            )
        if chunk:
            parts.append(chunk)
    return b"".join(parts)


def parse_json_object(raw: bytes, shape: str, reason: str) -> dict[str, Any]:
    """A JSON control message's body -> its object, or 422 saying why not (not JSON, not UTF-8,
    nested too deeply for the parser, or JSON that is not an object). `shape` describes the
    object expected, e.g. '{"train_loss": float, "num_samples": int}'."""
    try:
        body = json.loads(raw)
    except RecursionError:  # "[[[[..." under the body cap: the parser's recursion limit
        raise ValidationError(
            422, f"the body is nested too deeply: send a JSON object {shape}", reason
        ) from None
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        raise ValidationError(
            422, f"the body is not valid JSON: send a JSON object {shape}", reason
        ) from None
    if not isinstance(body, dict):
        kind = _JSON_KINDS.get(type(body), "value")
        raise ValidationError(422, f"the body must be a JSON object {shape}, not {kind}", reason)
    return body


_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def check_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """422 naming the tensor whose name, shape or dtype does not match the model."""
    try:
        check_state(state, config)
    except CheckpointError as e:
        raise ValidationError(
            422, f"the update does not fit the model: {e}", "bad_tensors"
        ) from None


def check_finite(state: dict[str, torch.Tensor]) -> None:
    """422 naming the first tensor holding a NaN or an infinity."""
    for name in sorted(state):
        t = state[name]
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise ValidationError(422, f"tensor {name!r} contains {kind} values", "non_finite")


def check_update_file(path: str | Path, config: ModelConfig) -> None:
    """The checks on an upload streamed to `path`, in the contract's order: not safetensors ->
    400, then 422 for the tensors' names, shapes, dtypes, and NaN or Inf."""
    if Path(path).stat().st_size == 0:
        raise ValidationError(
            400, "the upload body is empty: send the trained weights as safetensors", "unparseable"
        )
    try:
        state = st_load_file(str(path))
    except OSError:
        raise
    except Exception as e:  # SafetensorError, or anything else the parser trips on
        msg = str(e).strip() or type(e).__name__
        raise ValidationError(
            400, f"the upload body is not a safetensors file ({msg})", "unparseable"
        ) from None
    check_tensors(state, config)
    check_finite(state)


def check_num_samples(n: int, max_samples: int, what: str, reason: str) -> None:
    """A declared sample count weighs a phone's update in FedAvg: past the server's cap it is
    refused (the cap also keeps it inside the database's 64-bit integers)."""
    if n > max_samples:
        raise ValidationError(
            422,
            f"{what} {shown(n)} is more than this server accepts ({max_samples}, --max-samples)",
            reason,
        )


def parse_num_samples(value: str | None, max_samples: int = 2**62) -> int:
    """X-Fedkey-Num-Samples: a positive integer, at most ``max_samples``."""
    if value is None:
        raise ValidationError(
            422, f"missing header {NUM_SAMPLES_HEADER} (a positive integer)", "bad_headers"
        )
    try:
        n = int(value.strip())
    except ValueError:
        raise ValidationError(
            422,
            f"header {NUM_SAMPLES_HEADER} must be a positive integer, got {shown(value)}",
            "bad_headers",
        ) from None
    if n <= 0:
        raise ValidationError(
            422,
            f"header {NUM_SAMPLES_HEADER} must be a positive integer, got {shown(n)}",
            "bad_headers",
        )
    check_num_samples(n, max_samples, f"header {NUM_SAMPLES_HEADER}", "bad_headers")
    return n


def parse_train_loss(value: str | None) -> float:
    """X-Fedkey-Train-Loss: a finite float (repr() of the loss round-trips it exactly)."""
    if value is None:
        raise ValidationError(
            422, f"missing header {TRAIN_LOSS_HEADER} (a finite number)", "bad_headers"
        )
    try:
        loss = float(value.strip())
    except ValueError:
        raise ValidationError(
            422,
            f"header {TRAIN_LOSS_HEADER} must be a finite number, got {shown(value)}",
            "bad_headers",
        ) from None
    if not math.isfinite(loss):
        raise ValidationError(
            422,
            f"header {TRAIN_LOSS_HEADER} must be a finite number, got {shown(value)}",
            "bad_headers",
        )
    return loss


def check_loss_report(train_loss: float, num_samples: int, max_samples: int = 2**62) -> None:
    """The JSON body of POST /v1/rounds/{n}/loss: a finite loss and a positive sample count of at
    most ``max_samples``."""
    if not math.isfinite(train_loss):
        raise ValidationError(
            422, f"train_loss must be a finite number, got {train_loss}", "bad_loss"
        )
    if num_samples <= 0:
        raise ValidationError(
            422, f"num_samples must be a positive integer, got {shown(num_samples)}", "bad_loss"
        )
    check_num_samples(num_samples, max_samples, "num_samples", "bad_loss")
