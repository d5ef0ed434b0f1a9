"""One client against everyone else, on loopback against a real `fedkey server` process: 100 new
connections every 2 s left silent (up to 1,500), 20 whose request heads come a byte a second,
and an enrolled device that opens 10 uploads at once and sends each a byte a second, while 100
honest phones take part in every round. The honest phones' uploads are all taken, the run
finishes, /healthz answers throughout, and the silent and slow connections are closed by the
server.

The server's limits are set low so that each attack would succeed without its defence: 4 upload
bodies read at once (FEDKEY_MAX_RECEIVING), 700 connections (FEDKEY_LIMIT_CONCURRENCY), which the
silent ones would pass within 15 s if nothing closed them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedkey.federation.updates.validation import NUM_SAMPLES_HEADER, TRAIN_LOSS_HEADER
from fedkey.runners.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
SECRET = "attack-suite-secret"
HONEST = 100
ROUNDS = 1
LIMITS = {
    "FEDKEY_MAX_RECEIVING": "4",
    "FEDKEY_LIMIT_CONCURRENCY": "700",
    "FEDKEY_HEAD_TIMEOUT": "2",
}


def start_server(storage: Path, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "fedkey", "server", "--storage", str(storage), "--port", str(port),
        "--enrollment-secret", SECRET, "--data", "demo", "--max-train-tokens", "3000",
        "--max-eval-sentences", "20", "--ksr-sentences", "5", "--rounds", str(ROUNDS),
        "--fraction", "1.0", "--wait-devices", str(HONEST + 1), "--round-deadline", "15",
    ]  # fmt: skip
    log = (storage.parent / "server.log").open("a")
    env = {**os.environ, **LIMITS}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=60)
    return proc


async def patiently(call, *args, **kw) -> httpx.Response:
    """A request retried while the server is busy (503, 429) or the connection fails, as a
    phone does, for at most a minute."""
    for _ in range(300):
        try:
            r = await call(*args, **kw)
            if r.status_code not in (429, 503):
                return r
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"no answer to {args[0]} in a minute")


async def enroll(client: httpx.AsyncClient, name: str) -> dict:
    body = {"enrollment_secret": SECRET, "name": name, "num_samples": 10}
    r = await patiently(client.post, "/v1/devices", json=body)
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


class Bodies:
    """The upload of each round, made once for every phone: the global model, nudged (an
    honest-looking update without training), in a thread."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.of: dict[int, bytes] = {}

    async def get(self, client: httpx.AsyncClient, auth: dict, n: int) -> bytes:
        async with self.lock:
            if n not in self.of:
                model = (await patiently(client.get, "/v1/model", headers=auth)).content
                self.of[n] = await asyncio.to_thread(nudged, model)
            return self.of[n]


def nudged(model: bytes) -> bytes:
    state = st_load(model)
    return st_save({k: v + 1e-3 * torch.randn_like(v) for k, v in state.items()})


async def honest_phone(url: str, name: str, bodies: Bodies) -> list[int]:
    """Enroll, then upload in every round it is asked to; -> the rounds whose upload was taken."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        auth = await enroll(client, name)
        taken: list[int] = []
        while True:
            view = (
                await patiently(client.get, "/v1/rounds/current", params={"wait": 20}, headers=auth)
            ).json()
            if view["state"] == "finished":
                return taken
            if view["selected"] and view["task"] and not view["uploaded"]:
                headers = {**auth, NUM_SAMPLES_HEADER: "10", TRAIN_LOSS_HEADER: "3.0"}
                body = await bodies.get(client, auth, view["round"])
                path = f"/v1/rounds/{view['round']}/update"
                r = await patiently(client.post, path, content=body, headers=headers)
                if r.status_code == 200:
                    taken.append(view["round"])


async def trickle(size: int):
    """A body of `size` bytes, one a second."""
    for _ in range(size):
        yield b"\0"
        await asyncio.sleep(1.0)


async def mallory(url: str, stop: asyncio.Event) -> None:
    """An enrolled device that, once selected, opens 10 uploads at once and trickles each."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        auth = await enroll(client, "mallory")
        while not stop.is_set():
            view = (await patiently(client.get, "/v1/rounds/current", headers=auth)).json()
            if view["selected"] and view["task"]:
                break
            await asyncio.sleep(0.2)
        size = len(await Bodies().get(client, auth, view["round"]))
        headers = {**auth, NUM_SAMPLES_HEADER: "10", TRAIN_LOSS_HEADER: "3.0",
                   "Content-Length": str(size)}  # fmt: skip
        path = f"/v1/rounds/{view['round']}/update"
        uploads = [
            asyncio.create_task(client.post(path, content=trickle(size), headers=headers))
            for _ in range(10)
        ]
        await stop.wait()
        for task in uploads:
            task.cancel()
        await asyncio.gather(*uploads, return_exceptions=True)


async def silent(port: int, stop: asyncio.Event) -> list:
    """100 connections every 2 s, each left silent, until `stop` (at most 15 waves); -> them."""
    conns: list = []
    for _ in range(15):
        if stop.is_set():
            break
        conns += [await asyncio.open_connection("127.0.0.1", port) for _ in range(100)]
        await asyncio.sleep(2.0)
    return conns


async def slow_heads(port: int, count: int, stop: asyncio.Event) -> list:
    """`count` connections typing a request head a byte a second until `stop`; -> them."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    for byte in head:
        if stop.is_set():
            break
        for _, writer in conns:
            if not writer.is_closing():
                writer.write(bytes([byte]))
        await asyncio.sleep(1.0)
    return conns


async def closed_by_server(conns: list, within: float = 15.0) -> int:
    """How many of `conns` the server closes within `within` seconds (each read to its end)."""

    async def ends(reader: asyncio.StreamReader) -> bool:
        try:
            while await reader.read(1 << 16):
                pass
        except ConnectionError:
            pass
        return True

    try:
        async with asyncio.timeout(within):
            done = await asyncio.gather(*(ends(reader) for reader, _ in conns))
    except TimeoutError:
        done = [reader.at_eof() for reader, _ in conns]
    for _, writer in conns:
        writer.close()
    return sum(done)


async def healthz(url: str, stop: asyncio.Event) -> list[int]:
    statuses = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            statuses.append((await client.get("/healthz")).status_code)
            await asyncio.sleep(0.5)
    return statuses


@pytest.mark.slow
def test_one_client_cannot_stall_the_others(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tmp_path / "run", port)

    async def attack() -> tuple[list[list[int]], list[int], int, int]:
        stop = asyncio.Event()
        idle = asyncio.create_task(silent(port, stop))
        heads = asyncio.create_task(slow_heads(port, 20, stop))
        health = asyncio.create_task(healthz(url, stop))
        evil = asyncio.create_task(mallory(url, stop))
        bodies = Bodies()
        phones = [honest_phone(url, f"phone-{i:03d}", bodies) for i in range(HONEST)]
        async with asyncio.timeout(240):  # a bound on the whole test, not a speed target
            taken = await asyncio.gather(*phones)
        stop.set()
        await evil
        silent_conns, slow_conns = await idle, await heads
        closed = await closed_by_server(silent_conns), await closed_by_server(slow_conns)
        assert len(silent_conns) >= 300  # the attack ran through the rounds
        return taken, await health, closed[0] - len(silent_conns), closed[1]

    try:
        taken, health, idle_open, heads_closed = asyncio.run(attack())
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    assert all(rounds == list(range(1, ROUNDS + 1)) for rounds in taken), taken
    assert health and set(health) == {200}
    assert idle_open == 0 and heads_closed == 20
