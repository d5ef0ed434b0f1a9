"""The HTTP API's bodies and answers as pydantic models (docs/how-to/http-federation.md; the generated HTTP API reference).

Answers are `response_model`s: the coordinator's dicts are validated against them and keep keys
the model does not name (`extra="allow"`), so a field added on the coordinator's side is still
answered. Request bodies are parsed by hand (fedkey.federation.updates.validation: its messages are the contract);
the request models only describe them in OpenAPI (`json_body`). Every error is an `ErrorBody`
(`errors` lists a route's statuses for `responses=`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from fedkey.common.config import Batching, Precision
from fedkey.federation.updates.validation import NUM_SAMPLES_HEADER, TRAIN_LOSS_HEADER
from fedkey.server.devices import DEVICE_NAME
from fedkey.server.enrollment import DEFAULT_TOKEN_TTL, MAX_MINT, MAX_TTL


class _Answer(BaseModel):
    """An answer: keys the model does not name are answered as they are."""

    model_config = ConfigDict(extra="allow")


# -- requests (documented; parsed by fedkey.federation.updates.validation and the coordinator) ------------------------


class EnrollRequest(BaseModel):
    """POST /v1/devices."""

    enrollment_secret: str = Field(
        description="the server's shared enrollment secret, or a single-use enrollment token the "
        "operator minted (POST /v1/enrollment-tokens)"
    )
    name: str | None = Field(
        None,
        pattern=DEVICE_NAME.pattern,
        description="the device id to take (default: a random dev-<hex>)",
    )
    num_samples: Annotated[int, Field(ge=0)] | None = Field(
        None, description="training sentences on the device (default 1; --max-samples caps)"
    )


class LossReport(BaseModel):
    """POST /v1/rounds/{n}/loss."""

    train_loss: float = Field(description="the local training loss (finite)")
    num_samples: int = Field(ge=1, description="samples trained on (--max-samples caps)")


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON request body a route reads itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the trained weights as a safetensors file (at most the model's size "
        "plus a margin)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    "parameters": [
        {
            "name": NUM_SAMPLES_HEADER,
            "in": "header",
            "required": True,
            "description": "samples trained on (--max-samples caps)",
            "schema": {"type": "integer", "minimum": 1},
        },
        {
            "name": TRAIN_LOSS_HEADER,
            "in": "header",
            "required": True,
            "description": "the local training loss, a finite number",
            "schema": {"type": "number"},
        },
    ],
}


# -- answers ---------------------------------------------------------------------------------------


class EnrollResponse(_Answer):
    device_id: str
    token: str = Field(description="the bearer token of this device (shown once)")


class MintRequest(BaseModel):
    """POST /v1/enrollment-tokens."""

    count: Annotated[int, Field(ge=1, le=MAX_MINT)] = Field(description="how many tokens")
    ttl: Annotated[float, Field(gt=0, le=MAX_TTL)] = Field(
        DEFAULT_TOKEN_TTL, description="seconds each token stays usable"
    )


class MintResponse(_Answer):
    tokens: list[str] = Field(description="single-use enrollment tokens (shown once)")
    expires_at: float = Field(description="when they expire (unix seconds)")


class RevokeResponse(_Answer):
    device_id: str
    revoked: bool


class Task(_Answer):
    """A selected device's task (fedkey.common.task.RoundTask.to_json)."""

    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    clip: float
    max_len: int
    batching: Batching
    precision: Precision = Field(description="auto: the phone resolves it for its hardware")
    seed: int = Field(description="seeds the device's training and noise")
    beta: float
    sigma: float
    deadline: float | None = Field(description="the round's deadline, unix seconds")
    model_round: int = Field(description="the round of the global model the task trains from")


class RoundView(_Answer):
    """GET /v1/rounds/current: this device's view of the round."""

    round: int
    attempt: int
    state: str = Field(description="starting, waiting, open, aggregating or finished")
    selected: bool
    task: Task | None = Field(description="the task, when selected")
    loss_reported: bool
    uploaded: bool
    upload: bool | None = Field(description="whether to upload (topK: null while pending)")


class LossAnswer(_Answer):
    upload: bool | None = Field(
        description="the topK decision: null while pending (poll /v1/rounds/current)"
    )


class UploadReceipt(_Answer):
    receipt: str
    round: int
    sha256: str
    bytes: int


class Health(_Answer):
    status: str
    round: int
    state: str


class MetricsRows(_Answer):
    rounds: list[dict[str, Any]] = Field(description="one row a round, as in metrics.jsonl")


class ErrorBody(BaseModel):
    """Every error: a message a person understands."""

    detail: str


# -- the error statuses of each route (responses=) -------------------------------------------------

OVERLOADED = (
    "busy: the database (a JSON body, with Retry-After), or uvicorn's connection limit "
    "(FEDKEY_LIMIT_CONCURRENCY, a plain-text body); retry later"
)
#: The 503's Retry-After, for `errors` and the routes that add a 503 of their own.
RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "schema": {"type": "integer"},
    }
}


#: The 408 of a body that stopped arriving (fedkey.federation.updates.validation.BODY_IDLE_TIMEOUT), for `errors`.
STALLED = "the body stalled: no bytes for 30 s (send it again)"
#: The 507 of a write the full disk refused (fedkey.server.runtime.disk_full), for `errors`.
FULL_DISK = "the server's disk is full: the {what} was not stored; retry after Retry-After"


#: The ErrorBody schema in the OpenAPI document.
ERROR_BODY_REF = {"$ref": "#/components/schemas/ErrorBody"}


def errors(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status with its one-line description and an ErrorBody (429
    and 507 with Retry-After), plus the 503 any route may get: the server's own (an ErrorBody with
    Retry-After) or uvicorn's past its connection limit (plain text)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status, description in described.items():
        out[status] = {"model": ErrorBody, "description": description}
        if status in (429, 507):
            out[status]["headers"] = RETRY_AFTER
    out[503] = {
        "description": OVERLOADED,
        "content": {
            "application/json": {"schema": ERROR_BODY_REF},
            "text/plain": {"schema": {"type": "string"}},
        },
        "headers": RETRY_AFTER,
    }
    return out


def json_errors(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """errors(described) for a route whose own answer is not JSON (GET /metrics, text): its
    error bodies are still ErrorBody JSON, which FastAPI would otherwise list under the route's
    media type."""
    out = errors(described)
    for status in described:
        del out[status]["model"]
        out[status]["content"] = {"application/json": {"schema": ERROR_BODY_REF}}
    return out
