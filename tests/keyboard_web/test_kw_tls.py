"""`fedkey keyboard --tls-cert --tls-key`: the page and its WebSockets over HTTPS, so keystrokes
do not travel in clear."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
from websockets.asyncio.client import connect

from fedkey.runners.processes import free_port, wait_healthy
from fedkey.testing.tls import self_signed

ROOT = Path(__file__).resolve().parents[2]


def test_the_keyboard_serves_https(models, tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "fedkey", "keyboard", "--model", str(models.word),
           "--tls-cert", str(cert), "--tls-key", str(key), "--port", str(port)]  # fmt: skip
    log = (tmp_path / "keyboard.log").open("a")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        wait_healthy(url, proc, timeout=60, path="/api/info", name="the keyboard")
        assert httpx.get(f"{url}/api/info").json()["suggestions"] is True

        async def suggest() -> dict:
            context = ssl.create_default_context(cafile=str(cert))
            async with connect(f"wss://127.0.0.1:{port}/ws/suggest", ssl=context) as ws:
                await ws.send(json.dumps({"text": "see you "}))
                return json.loads(await ws.recv())

        assert len(asyncio.run(suggest())["suggestions"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
