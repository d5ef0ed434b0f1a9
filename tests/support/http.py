"""Helpers for the HTTP server tests: a tiny model on the demo corpus, phones driven by hand.

No tests here; tests/server/test_http_* import from it. Phones train with the same
`fedkey.device_sim.training.trainer.phone_round` as `fedkey simulate`, on the same shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from pathlib import Path
from typing import Any, TypedDict

import httpx
from fastapi.testclient import TestClient
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.common.config import DataConfig
from fedkey.common.task import RoundTask
from fedkey.corpora.dataset import device_shards, server_data
from fedkey.device_sim.training.trainer import TrainResult, phone_round
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import tokenizer_from_config
from fedkey.server.app import create_app
from fedkey.server.settings import Settings
from fedkey.testing.wait import wait_for

SECRET = "test-secret"


class DataFields(TypedDict):
    """The DataConfig fields (and Settings fields) every server test shares."""

    data: str
    max_train_tokens: int
    max_eval_sentences: int
    seed: int


DATA: DataFields = {"data": "demo", "max_train_tokens": 3000, "max_eval_sentences": 30, "seed": 0}


def make_settings(tmp_path: Path, **overrides) -> Settings:
    base: dict[str, Any] = dict(
        storage=tmp_path / "run",
        enrollment_secret=SECRET,
        hidden_size=16,
        rounds=2,
        fraction=1.0,
        local_epochs=1,
        batch_size=10,
        lr=0.5,
        ksr_sentences=5,
        round_deadline=60.0,
        upload_grace=5.0,
        **DATA,
    )
    base.update(overrides)
    return Settings(**base)


_SHARDS: dict[int, dict[str, list[list[int]]]] = {}


def shards(clients: int) -> dict[str, list[list[int]]]:
    """The phones' private shards, exactly as `fedkey simulate --partition iid` cuts them."""
    if clients not in _SHARDS:
        cfg = DataConfig(**DATA, clients=clients, partition="iid")
        corpus, tokenizer = server_data(cfg)
        _SHARDS[clients] = device_shards(cfg, tokenizer, corpus)
    return _SHARDS[clients]


def header_metadata(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["fedkey"])


@contextlib.contextmanager
def running(settings: Settings):
    """A started app (lifespan run) and its TestClient."""
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=True) as client:
        client.app_ref = app
        yield client


class Phone:
    def __init__(self, client: httpx.Client, name: str, shard: list[list[int]]):
        self.client = client
        self.name = name
        self.shard = shard
        self.token: str | None = None
        self.result: TrainResult | None = None
        self.round: int | None = None

    @property
    def trained(self) -> TrainResult:
        """The result of the last train()."""
        if self.result is None:
            raise AssertionError(f"phone {self.name} has not trained: call train() first")
        return self.result

    @property
    def num_samples(self) -> int:
        return sum(len(s) - 1 for s in self.shard)

    def enroll(self) -> Phone:
        r = self.client.post(
            "/v1/devices",
            json={"enrollment_secret": SECRET, "name": self.name, "num_samples": self.num_samples},
        )
        assert r.status_code == 200, r.text
        assert r.json()["device_id"] == self.name
        self.token = r.json()["token"]
        return self

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    def current(self, wait: float = 0) -> dict:
        r = self.client.get("/v1/rounds/current", params={"wait": wait}, headers=self.auth)
        assert r.status_code == 200, r.text
        return r.json()

    def train(self, view: dict) -> TrainResult:
        """Download the model, check its round, train on the task (as the fleet does)."""
        task = view["task"]
        r = self.client.get("/v1/model")
        assert r.status_code == 200
        assert int(r.headers["X-Fedkey-Round"]) == task["model_round"]
        meta = header_metadata(r.content)
        config = ModelConfig(**meta["model"])
        tokenizer_from_config(meta["tokenizer"])  # the phone would encode with it
        t = RoundTask.from_json(task)
        self.result = phone_round(
            config, st_load(r.content), self.shard, t.train, t.seed, t.beta, t.sigma, "cpu"
        )
        self.round = view["round"]
        return self.result

    def report_loss(self, wait: float = 0):
        return self.client.post(
            f"/v1/rounds/{self.round}/loss",
            params={"wait": wait},
            json={"train_loss": self.trained.train_loss, "num_samples": self.trained.num_tokens},
            headers=self.auth,
        )

    def body(self) -> bytes:
        return st_save({k: v.contiguous() for k, v in self.trained.state.items()})

    def upload_headers(self) -> dict:
        return {
            **self.auth,
            "X-Fedkey-Num-Samples": str(self.trained.num_tokens),
            "X-Fedkey-Train-Loss": repr(self.trained.train_loss),
        }

    def upload(self, body: bytes | None = None, headers: dict | None = None, n: int | None = None):
        return self.client.post(
            f"/v1/rounds/{self.round if n is None else n}/update",
            content=self.body() if body is None else body,
            headers=self.upload_headers() if headers is None else headers,
        )


def enroll_phones(client: httpx.Client, clients: int) -> list[Phone]:
    return [Phone(client, name, shard).enroll() for name, shard in shards(clients).items()]


def metrics(client: httpx.Client) -> list[dict]:
    r = client.get("/v1/metrics")
    assert r.status_code == 200
    return r.json()["rounds"]


def wait_round(client: httpx.Client, done: int, timeout: float = 30.0) -> list[dict]:
    """Wait until round `done` is in /v1/metrics."""
    return wait_for(
        lambda: (rows := metrics(client)) and rows[-1]["round"] >= done and rows, timeout
    )


def snapshot(client: httpx.Client, storage: Path) -> dict:
    """What a rejected request must not change: model bytes, checkpoint files, metrics."""
    model = client.get("/v1/model").content
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((storage / "checkpoints").glob("*.safetensors"))
    }
    return {
        "model": hashlib.sha256(model).hexdigest(),
        "checkpoints": files,
        "metrics": metrics(client),
        "jsonl": (storage / "metrics.jsonl").read_text(),
    }


def run_round(phones: list[Phone], *, topk: bool = False) -> dict[str, dict]:
    """Once the round is open, every selected phone trains, (reports its loss,) and uploads if
    told to. (Right after an aggregation the next round is not open yet: no one is selected.)"""

    def open_views() -> dict[str, dict]:  # {} (falsy) until every phone sees the round open
        views = {p.name: p.current() for p in phones}
        return views if all(v["state"] == "open" for v in views.values()) else {}

    views = wait_for(open_views, what="the round did not open for every phone")
    selected = [p for p in phones if views[p.name]["selected"]]
    for p in selected:
        p.train(views[p.name])
    if topk:
        for p in selected:
            assert p.report_loss().status_code == 200
        views = {p.name: p.current() for p in selected}
    for p in selected:
        if not topk or views[p.name]["upload"]:
            r = p.upload()
            assert r.status_code == 200, r.text
    return views
