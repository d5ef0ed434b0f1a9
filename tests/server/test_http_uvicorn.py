"""The real thing: `python -m fedkey.server.main` under uvicorn, SIGKILLed mid-round and restarted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from fedkey.runners.processes import free_port
from fedkey.testing.http import SECRET, Phone, shards
from fedkey.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]


def start(env: dict, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedkey.server.main"],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{env['FEDKEY_PORT']}/healthz"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {log.read_text()[-3000:]}")
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=60, every=0.2)
    return proc


def _descendants(pid: int) -> set[int]:
    """The processes below `pid` (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.slow
def test_sigkill_and_restart_finishes_the_run_once(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "FEDKEY_PORT": str(port),
        "FEDKEY_STORAGE": str(tmp_path / "run"),
        "FEDKEY_ENROLLMENT_SECRET": SECRET,
        "FEDKEY_DATA": "demo",
        "FEDKEY_MAX_TRAIN_TOKENS": "3000",
        "FEDKEY_MAX_EVAL_SENTENCES": "30",
        "FEDKEY_HIDDEN_SIZE": "16",
        "FEDKEY_ROUNDS": "2",
        "FEDKEY_FRACTION": "1.0",
        "FEDKEY_LOCAL_EPOCHS": "1",
        "FEDKEY_LR": "0.5",
        "FEDKEY_KSR_SENTENCES": "5",
        "FEDKEY_WAIT_DEVICES": "2",
        "FEDKEY_EXIT_WHEN_DONE": "true",
        "FEDKEY_FINISH_LINGER": "120",
    }
    log = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    proc = start(env, log)
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            with connect(f"ws://127.0.0.1:{port}/v1/events", open_timeout=10) as ws:
                phones = [Phone(client, n, s).enroll() for n, s in shards(2).items()]
                wait_for(lambda: phones[0].current()["state"] == "open")
                assert json.loads(ws.recv(timeout=10))["type"] == "device_enrolled"
                for p in phones:
                    view = p.current()
                    p.train(view)
                    assert p.upload().status_code == 200
                # long-polls on a real server: a few answers, each on a change, reach round 2
                t, polls = time.monotonic(), 0
                while (view := phones[0].current(wait=20))["round"] != 2:
                    polls += 1
                    assert polls < 5, view
                assert view["state"] == "open" and time.monotonic() - t < 20
                phones[0].train(view)
                receipt = phones[0].upload().json()
                phones[1].train(phones[1].current())
                # a chunked body larger than the limit is refused while it streams
                big = (b"\0" * 65536 for _ in range(10))
                r = client.post(
                    "/v1/rounds/2/update", content=big, headers=phones[1].upload_headers()
                )
                assert r.status_code == 413 and "larger" in r.json()["detail"]
        helpers = _descendants(proc.pid)  # the aggregation process and its forkserver
        assert helpers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # nothing of the killed server lives on to write into the restarted one's run
        wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in helpers), timeout=30)

        proc = start(env, log)
        with httpx.Client(base_url=base, timeout=30) as client:
            for p in phones:
                p.client = client
            assert phones[0].upload().json() == receipt
            assert phones[1].upload().status_code == 200
            # exit_when_done: the server leaves by itself, once every phone heard "finished"
            wait_for(lambda: phones[0].current()["state"] == "finished", timeout=60)
            # A long-poll held for its full wait: 1.5 s after "finished" the server is still up
            # and not shutting down (shutting down would answer it at once).
            t = time.monotonic()
            assert phones[0].current(wait=1.5)["state"] == "finished"
            assert time.monotonic() - t >= 1.5
            assert proc.poll() is None  # phone 1 has not been told yet: a retrying phone would be
            assert phones[1].current()["state"] == "finished"
            assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[2]["aggregated"] == ["device-0", "device-1"]
    assert "run finished" in log.read_text()
