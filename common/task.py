"""The round task: what the server tells a selected phone to do in a round, and its JSON codec.

The server's view of the open round (`GET /v1/rounds/current`) carries it under "task"; the
keys are the HTTP contract (docs/how-to/http-federation.md; the generated HTTP API reference):

    {"local_epochs", "batch_size", "lr", "momentum", "clip", "max_len", "batching", "precision",
     "seed", "beta", "sigma", "deadline", "model_round"}

The first eight are the phone's `TrainConfig` ("local_epochs" is its `epochs`; "precision" is
"auto", "fp32" or "bf16", and the phone resolves "auto" for its own hardware, fedkey.models.precision,
so a server run with an explicit one gets the same arithmetic from every phone); "seed" seeds the
phone's training and noise, "beta" and "sigma" are the seed papers' client-side randomization
(each device adds beta * N(0, sigma^2) before upload), "deadline" is the round's deadline (epoch
seconds, or null), "model_round" the round of the global model the task trains from. Standard
library only: the server and the phones both import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedkey.common.config import BATCHINGS, PRECISIONS, TrainConfig

#: JSON key -> TrainConfig field, in the order the task lists them.
TRAIN_KEYS: dict[str, str] = {
    "local_epochs": "epochs",
    "batch_size": "batch_size",
    "lr": "lr",
    "momentum": "momentum",
    "clip": "clip",
    "max_len": "max_len",
    "batching": "batching",
    "precision": "precision",
}
#: Every key of a task's JSON, in order.
TASK_KEYS: tuple[str, ...] = (
    *TRAIN_KEYS,
    "seed",
    "beta",
    "sigma",
    "deadline",
    "model_round",
)


@dataclass
class RoundTask:
    """One selected phone's task in one round."""

    train: TrainConfig
    seed: int
    beta: float
    sigma: float
    deadline: float | None
    model_round: int

    def to_json(self) -> dict[str, Any]:
        """The task as the server sends it (the keys of TASK_KEYS, in that order)."""
        t = self.train
        return {
            "local_epochs": t.epochs,
            "batch_size": t.batch_size,
            "lr": t.lr,
            "momentum": t.momentum,
            "clip": t.clip,
            "max_len": t.max_len,
            "batching": t.batching,
            "precision": t.precision,
            "seed": self.seed,
            "beta": self.beta,
            "sigma": self.sigma,
            "deadline": self.deadline,
            "model_round": self.model_round,
        }

    @classmethod
    def from_json(cls, d: Any) -> RoundTask:
        """The task of a server's JSON; ValueError naming the field that is missing or ill-typed.
        Keys it does not know are ignored (a newer server may send more)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"round task: expected a JSON object, got {type(d).__name__}")
        batching = _field(d, "batching", str, "a string")
        if batching not in BATCHINGS:
            raise ValueError(
                f"round task: field 'batching' must be one of {BATCHINGS}, got {batching!r}"
            )
        precision = _field(d, "precision", str, "a string")
        if precision not in PRECISIONS:
            raise ValueError(
                f"round task: field 'precision' must be one of {PRECISIONS}, got {precision!r}"
            )
        train = TrainConfig(
            epochs=_int(d, "local_epochs"),
            batch_size=_int(d, "batch_size"),
            lr=_float(d, "lr"),
            momentum=_float(d, "momentum"),
            clip=_float(d, "clip"),
            max_len=_int(d, "max_len"),
            batching=batching,
            precision=precision,
        )
        deadline = None if _field(d, "deadline", object, "") is None else _float(d, "deadline")
        return cls(
            train=train,
            seed=_int(d, "seed"),
            beta=_float(d, "beta"),
            sigma=_float(d, "sigma"),
            deadline=deadline,
            model_round=_int(d, "model_round"),
        )


def _field(d: Mapping, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in d:
        raise ValueError(f"round task: missing field {key!r}")
    value = d[key]
    if isinstance(value, bool) and kind is not bool and kind is not object:
        raise ValueError(f"round task: field {key!r} must be {what}, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(
            f"round task: field {key!r} must be {what}, got {type(value).__name__} {value!r}"
        )
    return value


def _int(d: Mapping, key: str) -> int:
    return _field(d, key, int, "an integer")


def _float(d: Mapping, key: str) -> float:
    return float(_field(d, key, (int, float), "a number"))


def still_selected(view: Mapping[str, Any], round_idx: int, attempt: int) -> bool:
    """Whether a view of the round (GET /v1/rounds/current) still has this phone selected in
    the open round `round_idx`, attempt `attempt`: a phone waiting for FedMed's topK decision
    gives up when it is not (the round moved on, or was opened again)."""
    return bool(
        view.get("state") == "open"
        and view.get("round") == round_idx
        and int(view.get("attempt") or 0) == attempt
        and view.get("selected")
    )
