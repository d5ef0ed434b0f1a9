"""End to end over real HTTP on loopback: `fedkey server` in its own process, a fleet of phones
in worker processes, the event stream, a SIGKILLed server, and the in-process simulation as the
reference the HTTP path must reproduce bit for bit."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.device_sim.fleets.thread_fleet import FleetConfig, run_fleet
from fedkey.export.metadata import load_metadata
from fedkey.runners.processes import free_port, wait_healthy
from fedkey.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[1]
SECRET = "e2e-secret"
DATA = [
    "--data",
    "demo",
    "--max-train-tokens",
    "8000",
    "--max-eval-sentences",
    "100",
    "--seed",
    "5",
]
TRAIN = ["--local-epochs", "1", "--ksr-sentences", "20"]

pytestmark = pytest.mark.slow


def start_server(storage: Path, port: int, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "fedkey",
        "server",
        "--storage",
        str(storage),
        "--port",
        str(port),
        "--enrollment-secret",
        SECRET,
        *DATA,
        *TRAIN,
        *args,
    ]
    log = storage.parent / f"{storage.name}-server.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=60)
    except RuntimeError as e:
        raise AssertionError(f"server did not come up: {e}\n{log.read_text()[-3000:]}") from e
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def fleet(port: int, count: int, **kw) -> FleetConfig:
    return FleetConfig(
        server=f"http://127.0.0.1:{port}",
        count=count,
        data="demo",
        max_train_tokens=8000,
        seed=5,
        device="cpu",
        workers=2,
        enrollment_secret=SECRET,
        **kw,
    )


def simulate(out: Path, count: int, *args: str) -> None:
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            *DATA,
            *TRAIN,
            "--clients",
            str(count),
            "--out",
            str(out),
            "--workers",
            "2",
            *args,
        ],
    )
    assert result.exit_code == 0, result.output


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path, r: int) -> bool:
    x = load_file(a / "checkpoints" / f"round_{r:04d}.safetensors")
    y = load_file(b / "checkpoints" / f"round_{r:04d}.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def collect_events(port: int, events: list, stop_flag: threading.Event) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/events") as ws:
        while not stop_flag.is_set():
            try:
                events.append(json.loads(ws.recv(timeout=0.5)))
            except TimeoutError:
                continue
            except ConnectionClosed:  # the server stopped
                return


def test_ten_phones_three_rounds_match_the_simulation(tmp_path):
    """A server and 10 phones, 3 rounds: perplexity falls, /v1/metrics and the event stream say
    what happened, the keyboard's export is the round best on validation (whichever round that
    is on this CPU), and the global weights equal `fedkey simulate`'s for the same seed."""
    port = free_port()
    args = ["--rounds", "3", "--fraction", "0.3", "--strategy", "fedatt", "--wait-devices", "10"]
    proc = start_server(tmp_path / "http", port, *args, "--export-dir", str(tmp_path / "export"))
    events: list = []
    done = threading.Event()
    listener = threading.Thread(target=collect_events, args=(port, events, done), daemon=True)
    listener.start()
    try:
        summary = run_fleet(fleet(port, 10), progress=False)
        metrics = httpx.get(f"http://127.0.0.1:{port}/v1/metrics").json()["rounds"]
        best = metrics[-1]["best_round"]  # whichever round this CPU's arithmetic made best
        wait_for(  # the export of the best round runs in the background
            lambda: any(e["type"] == "model_exported" and e.get("round") == best for e in events),
            timeout=60,
            every=0.2,
            what=f"round {best}, the best on validation, was not exported",
        )
    finally:
        done.set()
        stop(proc)
    assert summary["uploads"] == 9 and not summary["errors"]
    assert [r["round"] for r in metrics] == [0, 1, 2, 3]
    assert min(r["test_ppl"] for r in metrics[1:]) < metrics[0]["test_ppl"]  # it learned
    kinds = [e["type"] for e in events]
    assert kinds.count("device_enrolled") == 10
    assert kinds.count("round_opened") == 3 and kinds.count("update_received") == 9
    assert [e["round"] for e in events if e["type"] == "round_aggregated"] == [1, 2, 3]
    assert "run_finished" in kinds
    assert load_metadata(tmp_path / "export" / "model.onnx")["round"] == best  # the keyboard's

    simulate(tmp_path / "sim", 10, *args[:6])
    assert all(same_weights(tmp_path / "http", tmp_path / "sim", r) for r in range(4))
    assert [r["selected"] for r in rows(tmp_path / "sim")] == [r["selected"] for r in metrics]


def test_fedkey_run_starts_afresh_in_a_used_directory_and_matches_the_simulation(tmp_path):
    """`fedkey run` (server process + phone fleet, what the gpu preset and bench perf run) twice
    into one --out: the second run is a new run, not a refusal of the new phones' names."""
    args = [*DATA, *TRAIN, "--clients", "4", "--fraction", "0.5", "--rounds", "2"]
    for _ in range(2):
        result = CliRunner().invoke(
            app, ["run", *args, "--workers", "2", "--out", str(tmp_path / "http")]
        )
        assert result.exit_code == 0, result.output
        assert [r["round"] for r in rows(tmp_path / "http")] == [0, 1, 2]
    simulate(tmp_path / "sim", 4, "--fraction", "0.5", "--rounds", "2")
    assert same_weights(tmp_path / "http", tmp_path / "sim", 2)


def test_vanishing_phones_round_completes_at_deadline_with_quorum(tmp_path):
    # The deadline leaves the phones that stay time to train on a loaded machine: a round that
    # misses its quorum is drawn again, and its vanished phones may come back.
    port = free_port()
    proc = start_server(
        tmp_path / "http",
        port,
        "--rounds",
        "2",
        "--fraction",
        "1.0",
        "--wait-devices",
        "10",
        "--round-deadline",
        "20",
        "--quorum",
        "5",
    )
    try:
        summary = run_fleet(fleet(port, 10, dropout_rate=0.3), progress=False)
    finally:
        stop(proc)
    recorded = rows(tmp_path / "http")
    assert [r["round"] for r in recorded] == [0, 1, 2]
    assert summary["dropped"] > 0
    vanished = {(d, r) for d, rep in summary["per_device"].items() for r in rep["dropped_rounds"]}
    for r in recorded[1:]:
        assert len(r["selected"]) == 10
        assert 5 <= len(r["aggregated"])  # the quorum
        gone = {d for d, rnd in vanished if rnd == r["round"]}
        assert gone and not gone & set(r["aggregated"])  # aggregated at the deadline without them


def test_sigkilled_server_restarts_and_records_every_round_once(tmp_path):
    port = free_port()
    args = ["--rounds", "4", "--fraction", "0.3", "--wait-devices", "10", "--exit-when-done"]
    storage = tmp_path / "http"
    proc = start_server(storage, port, *args)
    result: dict = {}
    phones = threading.Thread(
        target=lambda: result.update(run_fleet(fleet(port, 10), progress=False))
    )
    phones.start()
    try:
        wait_for(
            (storage / "checkpoints" / "round_0002.safetensors").exists,
            timeout=120,
            what="round 2 was not checkpointed",
        )
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of the run: round 3 is open or training
        proc.wait()
        proc = start_server(storage, port, *args)
        phones.join(timeout=240)
        proc.wait(timeout=60)  # --exit-when-done
    finally:
        stop(proc)
    assert not phones.is_alive() and not result.get("errors")
    recorded = rows(storage)
    assert [r["round"] for r in recorded] == [0, 1, 2, 3, 4]  # every round exactly once
    simulate(tmp_path / "sim", 10, *args[:4])
    assert same_weights(storage, tmp_path / "sim", 4)
