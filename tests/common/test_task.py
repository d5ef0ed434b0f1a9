"""The round task's JSON codec (fedkey.common.task): the keys the HTTP contract names, a lossless round
trip, and a ValueError naming the field for a task that is missing one or has it ill-typed."""

from __future__ import annotations

import json

import pytest

from fedkey.common.config import TrainConfig
from fedkey.common.task import TASK_KEYS, RoundTask

TASK = RoundTask(
    train=TrainConfig(
        epochs=2,
        batch_size=7,
        lr=0.25,
        momentum=0.9,
        clip=0.0,
        max_len=40,
        batching="columns",
        precision="bf16",
    ),
    seed=1234567890123,
    beta=0.1,
    sigma=2.0,
    deadline=1_700_000_000.5,
    model_round=3,
)

#: The contract (README, "The HTTP contract": the `task` of GET /v1/rounds/current), in order.
CONTRACT_KEYS = [
    "local_epochs",
    "batch_size",
    "lr",
    "momentum",
    "clip",
    "max_len",
    "batching",
    "precision",
    "seed",
    "beta",
    "sigma",
    "deadline",
    "model_round",
]


def test_to_json_is_the_contract():
    assert TASK.to_json() == {
        "local_epochs": 2,
        "batch_size": 7,
        "lr": 0.25,
        "momentum": 0.9,
        "clip": 0.0,
        "max_len": 40,
        "batching": "columns",
        "precision": "bf16",
        "seed": 1234567890123,
        "beta": 0.1,
        "sigma": 2.0,
        "deadline": 1_700_000_000.5,
        "model_round": 3,
    }
    assert list(TASK.to_json()) == CONTRACT_KEYS == list(TASK_KEYS)


def test_round_trip_through_json_text():
    back = RoundTask.from_json(json.loads(json.dumps(TASK.to_json())))
    assert back == TASK
    assert back.to_json() == TASK.to_json()
    no_deadline = RoundTask(
        TrainConfig(), seed=0, beta=0.0, sigma=1.0, deadline=None, model_round=0
    )
    assert RoundTask.from_json(no_deadline.to_json()) == no_deadline


def test_whole_numbers_are_read_as_floats_and_extra_keys_ignored():
    d = {**TASK.to_json(), "lr": 1, "deadline": 1_700_000_000, "future_field": [1, 2]}
    task = RoundTask.from_json(d)
    assert isinstance(task.train.lr, float) and task.train.lr == 1.0
    assert isinstance(task.deadline, float) and task.deadline == 1_700_000_000.0


@pytest.mark.parametrize("key", CONTRACT_KEYS)
def test_a_missing_field_is_named(key):
    d = TASK.to_json()
    del d[key]
    with pytest.raises(ValueError, match=f"missing field '{key}'"):
        RoundTask.from_json(d)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("local_epochs", "1"),
        ("local_epochs", 1.0),
        ("batch_size", None),
        ("lr", "fast"),
        ("momentum", True),
        ("clip", [5.0]),
        ("max_len", 80.5),
        ("batching", 3),
        ("batching", "words"),
        ("precision", 16),
        ("precision", "fp16"),
        ("seed", True),
        ("seed", 1.5),
        ("beta", None),
        ("sigma", "1"),
        ("deadline", "soon"),
        ("model_round", None),
    ],
)
def test_an_ill_typed_field_is_named(key, value):
    with pytest.raises(ValueError, match=f"field '{key}'"):
        RoundTask.from_json({**TASK.to_json(), key: value})


@pytest.mark.parametrize("value", [None, [], "task", 3])
def test_not_an_object(value):
    with pytest.raises(ValueError, match="expected a JSON object"):
        RoundTask.from_json(value)
