"""A small fake federation server that follows the README contract, for the phone's HTTP client
(tests/device_sim/client/test_http.py) and the phones and fleet (test_fleet_phones.py).

FakeFederation runs 2 rounds of a tiny GRU with the demo corpus's word tokenizer: enrollment,
long-polled views, the model with an ETag, loss reports with a (optionally deferred) topK
decision, uploads validated as the contract says, failure injection (503s). It records everything
the phones send. FakeServer serves it under uvicorn in a thread, restartable on the same port.
The real server is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Collection
from typing import cast

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.common.task import RoundTask
from fedkey.corpora.dataset import device_shards, server_data
from fedkey.federation.engine import client_seed
from fedkey.models.checkpoint import CheckpointError, check_state, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel
from fedkey.runners.processes import free_port
from fedkey.testing.wait import wait_for

SECRET = "s3cret"
MAX_TRAIN_TOKENS = 3000
TRAIN = TrainConfig(
    epochs=1,
    batch_size=10,
    lr=0.5,
    momentum=0.5,
    clip=5.0,
    max_len=80,
    batching="columns",  # not the default: the phones must follow the task's batching
)


def data_config(n: int) -> DataConfig:
    return DataConfig(data="demo", clients=n, partition="iid", max_train_tokens=MAX_TRAIN_TOKENS)


_TOKENIZER = None


def demo_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = server_data(data_config(4))[1]
    return _TOKENIZER


def shards_for(n: int) -> dict[str, list[list[int]]]:
    return device_shards(data_config(n), demo_tokenizer())


class FakeFederation:
    """The contract, kept small: rounds 1..`rounds`, every enrolled device selected; a round
    closes when every selected device uploaded, was rejected, was told no or got a 409, or at
    its deadline."""

    def __init__(
        self,
        n_devices: int,
        *,
        rounds: int = 2,
        deadline: float = 30.0,
        beta: float = 0.0,
        decline: Collection[str] = frozenset(),
        defer: bool = False,
        stale_once: Collection[str] = frozenset(),
        dont_wait_for: Collection[str] = frozenset(),
    ):
        self.n_devices, self.rounds, self.deadline, self.beta = n_devices, rounds, deadline, beta
        self.decline, self.defer, self.stale_once = set(decline), defer, set(stale_once)
        self.dont_wait_for = set(dont_wait_for)  # e.g. a phone that drops out: no deadline wait
        self.tokenizer = demo_tokenizer()
        self.config = ModelConfig(vocab_size=self.tokenizer.vocab_size, emb_size=16, hidden_size=16)
        torch.manual_seed(0)
        self.models = {0: model_state(LanguageModel(self.config))}  # model round -> state
        self.lock = threading.Lock()
        self.tokens: dict[str, str] = {}  # token -> name
        self.enrolled: dict[str, int | None] = {}  # name -> num_samples
        self.round, self.attempt, self.state = 0, 0, "waiting"
        self.fail: Counter[str] = Counter()  # tag -> failures still to answer
        self.fail_status = 503  # what a failure answers
        self.hits: Counter[str] = Counter()
        self.model_304 = 0
        self.bodies: list[tuple[int, str, bytes]] = []  # every upload body received
        self.losses_seen: list[tuple[int, str, float, int]] = []
        self.accepted: dict[int, dict[str, bytes]] = {}
        self.rows: list[dict[str, float]] = []
        self._stale_done: set[str] = set()
        self._checkpoints: dict[int, bytes] = {}
        self.last_sent: dict[str, dict] = {}  # name -> the last view it was sent

    # -- the round engine, driven by requests ---------------------------------------------------

    def _open(self) -> None:
        self.round += 1
        self.state = "open"
        self.selected = set(self.enrolled)
        self.opened = time.monotonic()
        self.loss_at: dict[str, float] = {}
        self.uploads: dict[str, bytes] = {}
        self.receipts: dict[str, dict] = {}
        self.rejected: set[str] = set()
        self.excluded: set[str] = set()

    def tick(self) -> None:
        with self.lock:
            if self.state == "waiting" and len(self.enrolled) >= self.n_devices:
                self.rows.append({"round": 0, "val_ppl": 100.0, "test_ppl": 100.0})
                self._open()
            if self.state != "open":
                return
            done = set(self.uploads) | self.rejected | self.excluded | self.dont_wait_for
            done |= {n for n in self.loss_at if n in self.decline}
            if self.selected <= done or time.monotonic() > self.opened + self.deadline:
                states = [st_load(b) for b in self.uploads.values()]
                prev = self.models[self.round - 1]
                # sum() of tensors is a tensor (the stubs add its start value, 0, to the type)
                new = (
                    {k: cast(torch.Tensor, sum(s[k] for s in states)) / len(states) for k in prev}
                    if states
                    else prev
                )
                self.models[self.round] = new
                self.accepted[self.round] = dict(self.uploads)
                self.rows.append({"round": self.round, "val_ppl": 50.0, "test_ppl": 50.0})
                if self.round >= self.rounds:
                    self.state = "finished"
                else:
                    self._open()

    def model_round(self) -> int:
        return self.round if self.state == "finished" else max(self.round - 1, 0)

    def checkpoint(self) -> tuple[int, bytes]:
        r = self.model_round()
        if r not in self._checkpoints:
            meta = {
                "format": 1,
                "model": self.config.to_dict(),
                "tokenizer": self.tokenizer.to_config(),
                "round": r,
                "strategy": "fedavg",
            }
            state = {k: v.contiguous() for k, v in self.models[r].items()}
            self._checkpoints[r] = st_save(state, metadata={"fedkey": json.dumps(meta)})
        return r, self._checkpoints[r]

    def decision(self, name: str) -> bool | None:
        if name not in self.loss_at:
            return None
        if self.defer and time.monotonic() < self.loss_at[name] + 0.3:
            return None
        return name not in self.decline

    def view(self, name: str) -> dict:
        with self.lock:
            selected = self.state == "open" and name in self.selected and name not in self.excluded
            task = None
            if selected:
                task = RoundTask(
                    train=TRAIN,
                    seed=client_seed(0, self.round, name),
                    beta=self.beta,
                    sigma=1.0,
                    deadline=None,
                    model_round=self.round - 1,
                ).to_json()
            return {
                "round": self.round,
                "attempt": self.attempt,
                "state": self.state,
                "selected": selected,
                "task": task,
                "loss_reported": selected and name in self.loss_at,
                "uploaded": selected and name in self.uploads,
                "upload": self.decision(name) if selected else None,
            }

    def app(self) -> FastAPI:
        app = FastAPI()
        fed = self

        def tag_of(path: str) -> str:
            for prefix, tag in (
                ("/v1/devices", "enroll"),
                ("/v1/model", "model"),
                ("/v1/rounds/current", "current"),
                ("/v1/metrics", "metrics"),
            ):
                if path.startswith(prefix):
                    return tag
            return path.rsplit("/", 1)[-1]  # loss | update

        @app.middleware("http")
        async def inject(request: Request, call_next):
            tag = tag_of(request.url.path)
            fed.hits[tag] += 1
            if fed.fail[tag] > 0:
                fed.fail[tag] -= 1
                return JSONResponse({"detail": "restarting"}, status_code=fed.fail_status)
            fed.tick()
            return await call_next(request)

        def who(request: Request) -> str | None:
            auth = request.headers.get("authorization", "")
            return fed.tokens.get(auth.removeprefix("Bearer "))

        def err(status: int, detail: str) -> JSONResponse:
            return JSONResponse({"detail": detail}, status_code=status)

        @app.post("/v1/devices")
        async def enroll(request: Request):
            body = await request.json()
            if body.get("enrollment_secret") != SECRET:
                return err(401, "bad enrollment secret")
            name = body.get("name") or f"anon-{len(fed.enrolled)}"
            with fed.lock:
                if name in fed.enrolled:
                    return err(409, f"the name {name!r} is taken")
                token = hashlib.sha256(name.encode()).hexdigest()
                fed.tokens[token] = name
                fed.enrolled[name] = body.get("num_samples")
            return {"device_id": f"id-{name}", "token": token}

        @app.get("/v1/rounds/current")
        async def current(request: Request, wait: float = 0.0):
            name = who(request)
            if name is None:
                return err(401, "bad token")
            # "Changes" is relative to the last view this device was sent, so a change between
            # two polls is not missed.
            view = fed.view(name)
            end = time.monotonic() + min(wait, 60.0)
            while view == fed.last_sent.get(name) and time.monotonic() < end:
                await asyncio.sleep(0.02)
                fed.tick()
                view = fed.view(name)
            fed.last_sent[name] = view
            return view

        @app.get("/v1/model")
        async def model(request: Request):
            r, body = fed.checkpoint()
            etag = f'"{r}-{hashlib.sha256(body).hexdigest()[:16]}"'
            if request.headers.get("if-none-match") == etag:
                fed.model_304 += 1
                return Response(status_code=304, headers={"ETag": etag})
            return Response(
                body,
                media_type="application/octet-stream",
                headers={"ETag": etag, "X-Fedkey-Round": str(r)},
            )

        def check_round(name: str, n: int) -> JSONResponse | None:
            if fed.state != "open" or n != fed.round:
                return err(409, f"round {n} is not open (the open round is {fed.round})")
            if name not in fed.selected or name in fed.excluded:
                return err(403, f"{name} is not selected in round {n}")
            return None

        @app.post("/v1/rounds/{n}/loss")
        async def loss(n: int, request: Request, wait: float = 0.0):
            name = who(request)
            if name is None:
                return err(401, "bad token")
            if (bad := check_round(name, n)) is not None:
                return bad
            body = await request.json()
            with fed.lock:
                fed.loss_at.setdefault(name, time.monotonic())
                fed.losses_seen.append((n, name, body["train_loss"], body["num_samples"]))
            return {"upload": fed.decision(name)}

        @app.post("/v1/rounds/{n}/update")
        async def update(n: int, request: Request):
            name = who(request)
            if name is None:
                return err(401, "bad token")
            if (bad := check_round(name, n)) is not None:
                return bad
            if fed.decision(name) is False:
                return err(403, "topK: not an uploader this round")
            body = await request.body()
            fed.bodies.append((n, name, body))
            if name in fed.stale_once and name not in fed._stale_done:
                fed._stale_done.add(name)
                fed.excluded.add(name)
                return err(409, f"round {n} has moved on")
            if name in fed.uploads:
                if fed.uploads[name] == body:
                    return fed.receipts[name]
                return err(409, "a different update was already received")
            try:
                state = st_load(body)
            except Exception:
                return err(400, "the body is not safetensors")
            try:
                check_state(state, fed.config)
            except CheckpointError as e:
                fed.rejected.add(name)
                return err(422, str(e))
            if any(not torch.isfinite(t).all() for t in state.values()):
                fed.rejected.add(name)
                return err(422, "the update holds NaN or Inf")
            try:
                num = int(request.headers["x-fedkey-num-samples"])
                train_loss = float(request.headers["x-fedkey-train-loss"])
            except (KeyError, ValueError):
                return err(422, "missing or malformed sample-count / loss headers")
            assert num > 0 and math.isfinite(train_loss)
            receipt = {
                "receipt": f"r{n}-{name}",
                "round": n,
                "sha256": hashlib.sha256(body).hexdigest(),
                "bytes": len(body),
            }
            with fed.lock:
                fed.uploads[name] = body
                fed.receipts[name] = receipt
            return receipt

        @app.get("/v1/metrics")
        async def metrics():
            return {"rounds": list(fed.rows)}

        @app.get("/healthz")
        async def healthz():
            return {"status": "ok", "round": fed.round, "state": fed.state}

        return app


class FakeServer:
    """uvicorn serving a FakeFederation on a loopback port, in a thread; restartable."""

    def __init__(self, fed: FakeFederation, port: int | None = None):
        self.fed = fed
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None

    def start(self) -> FakeServer:
        config = uvicorn.Config(
            self.fed.app(),
            host="127.0.0.1",
            port=self.port,
            log_level="error",
            lifespan="off",
            # uvicorn annotates an int, but it is a timeout in seconds (asyncio.wait_for's)
            timeout_graceful_shutdown=0.2,  # type: ignore[arg-type]
        )
        server = self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=server.run, daemon=True)
        self.thread.start()
        wait_for(
            lambda: server.started,
            timeout=10,
            every=0.01,
            what="the fake server did not start",
        )
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=5)
            self.server = None
