"""The real federation server for the phone tests (tests/device_sim, tests/ray): uvicorn in a
thread on a loopback port, a tiny model on the demo corpus (fedkey.testing.http.make_settings)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from fedkey.device_sim.config import FleetConfig
from fedkey.runners.processes import free_port
from fedkey.server.main import build_server
from fedkey.testing.http import DATA, SECRET, make_settings
from fedkey.testing.wait import wait_for


@contextmanager
def real_server(tmp: Path, phones: int, **settings) -> Iterator[tuple[str, Path]]:
    """A server that opens round 1 once `phones` enrolled (2 rounds, fp32 unless `settings`
    say otherwise); yields (url, storage)."""
    port = free_port()
    options = {"wait_devices": phones, "precision": "fp32", **settings}
    config = make_settings(tmp, port=port, **options)
    uvicorn_server = build_server(config, log_level="warning")
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout=60, every=0.05, what="the server did not start")
        yield url, config.storage
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=30)


def fleet_config(url: str, phones: int, **overrides) -> FleetConfig:
    """The fleet whose shards are the server's (DATA), phones training on the CPU."""
    fields = {
        "server": url,
        "count": phones,
        "data": DATA["data"],
        "max_train_tokens": DATA["max_train_tokens"],
        "seed": DATA["seed"],
        "device": "cpu",
        "workers": 0,
        "enrollment_secret": SECRET,
        "retry_seconds": 20,
        "poll_wait": 5,
        **overrides,
    }
    return FleetConfig(**fields)


def final_weights(storage: Path, rounds: int = 2) -> dict[str, torch.Tensor]:
    """The global model after `rounds` rounds, from the server's checkpoint."""
    path = storage / "checkpoints" / f"round_{rounds:04d}.safetensors"
    wait_for(path.exists, timeout=30, what=f"no checkpoint {path.name}")
    return load_file(path)
