"""A cluster made with the `ray` command itself, joined as the docs say: a head and a
second node started by `ray start` with token authentication on, in a clean environment (its own
HOME, no RAY_* variables), and `fedkey simulate --ray-address 127.0.0.1:PORT` run as a separate
process with nothing set up for it. It trains on both nodes and ends with the weights of
`--backend local`; without the token it fails with one line saying what to do.

Each `ray start` runs in a session of its own, and teardown stops only those process groups
(`ray stop` would stop every Ray instance on the machine); --temp-dir keeps the cluster's files
and address out of /tmp/ray, which other Ray instances here share.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedkey.runners.processes import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
ROUNDS = 2
CLIENTS = 4
# The smallest run that still trains (tests/support/workload.py), as command-line options.
RUN = [
    "simulate",
    "--data", "demo",
    "--clients", str(CLIENTS),
    "--fraction", "1",
    "--rounds", str(ROUNDS),
    "--max-train-tokens", "1500",
    "--max-eval-sentences", "20",
    "--ksr-sentences", "0",
    "--strategy", "fedavg",
    "--lr", "0.5",
]  # fmt: skip


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without RAY_* (a fixture's auth mode, an address), HOME at `home`, the
    model at 16 units (FEDKEY_HIDDEN_SIZE), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), FEDKEY_HIDDEN_SIZE="16", **extra)
    return env


def stop_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM every process of `pgid` (a `ray start` and the daemons it left), SIGKILL what is
    still there after `grace` seconds; gives up `grace` seconds later."""
    start = time.monotonic()
    while time.monotonic() - start < 2 * grace:
        late = time.monotonic() - start > grace
        try:
            os.killpg(pgid, signal.SIGKILL if late else signal.SIGTERM)
        except ProcessLookupError:
            return
        time.sleep(0.5)


@dataclass(frozen=True)
class RayStartCluster:
    address: str  # 127.0.0.1:PORT, as the user types it
    home: Path  # where `ray get-auth-token --generate` wrote .ray/auth_token
    work: Path  # a folder for the runs


@pytest.fixture(scope="module")
def ray_start_cluster() -> Iterator[RayStartCluster]:
    """`ray start --head --node-ip-address 127.0.0.1 --port P` and `ray start --address
    127.0.0.1:P`, one CPU each, with token auth: the token made as Ray's warning says (`ray
    get-auth-token --generate`), which `ray start --head` then turns auth on for; the second node
    is told RAY_AUTH_MODE=token, as Ray's `ray start --address` needs."""
    root = Path(tempfile.mkdtemp(prefix="fk-ray"))  # short: Ray's socket paths live under it
    home, temp = root / "home", root / "t"
    home.mkdir()
    port = free_port()
    address = f"127.0.0.1:{port}"
    groups: list[int] = []

    def ray(*args: str, **extra: str) -> None:
        proc = subprocess.Popen(
            [str(BIN / "ray"), *args],
            env=clean_env(home, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        groups.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            out = "timed out after 180 s"
        if proc.returncode != 0:
            tail = "\n".join(out.strip().splitlines()[-5:])
            pytest.skip(f"`ray {' '.join(args)}` failed here: {tail}")

    try:
        ray("get-auth-token", "--generate")
        assert (home / ".ray" / "auth_token").is_file()
        cluster = ("--num-cpus", "1", "--temp-dir", str(temp), "--disable-usage-stats")
        ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), *cluster)
        ray("start", "--address", address, *cluster, RAY_AUTH_MODE="token")
        yield RayStartCluster(address, home, root / "work")
    finally:
        for pgid in groups:
            stop_group(pgid)
        shutil.rmtree(root, ignore_errors=True)


def fedkey(
    *args: str, home: Path, timeout: float = 300, **extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "fedkey"), *args],
        env=clean_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[2],
    )


def checkpoints(out: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(p) for p in sorted((out / "checkpoints").glob("round_*.safetensors"))]


def test_simulate_joins_a_ray_start_cluster_with_token_auth(ray_start_cluster):
    c = ray_start_cluster
    ray_out, local_out = c.work / "ray", c.work / "local"
    ray_run = fedkey(
        *RUN, "--out", str(ray_out), "--backend", "ray", "--ray-address", c.address, home=c.home
    )
    assert ray_run.returncode == 0, ray_run.stdout[-2000:] + ray_run.stderr[-3000:]
    local = fedkey(*RUN, "--out", str(local_out), "--workers", "0", home=c.home)
    assert local.returncode == 0, local.stdout[-2000:] + local.stderr[-3000:]

    rows = [json.loads(line) for line in (ray_out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] > 0]
    assert len(trained) == ROUNDS
    nodes = set()
    for row in trained:
        assert sum(row["trained_on"].values()) == CLIENTS and row["lost"] == {}
        nodes |= set(row["trained_on"])
    assert len(nodes) == 2  # the head and the second node each trained phones

    ours, theirs = checkpoints(ray_out), checkpoints(local_out)
    assert len(ours) == len(theirs) == ROUNDS + 1
    for x, y in zip(ours, theirs, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({}, "wants an auth token and none was found"),
        ({"RAY_AUTH_TOKEN": "0" * 32}, "refused the auth token in RAY_AUTH_TOKEN"),
    ],
    ids=["no-token", "wrong-token"],
)
def test_without_the_clusters_token_simulate_says_so_in_one_line(
    ray_start_cluster, tmp_path, extra, problem
):
    """Another HOME: no ~/.ray/auth_token (or a token that is not the cluster's)."""
    c = ray_start_cluster
    result = fedkey(
        "simulate", "--data", "demo", "--clients", "2", "--rounds", "1", "--out", str(tmp_path),
        "--backend", "ray", "--ray-address", c.address,
        home=tmp_path, timeout=120, **extra,
    )  # fmt: skip
    assert result.returncode != 0
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert lines == [lines[0]], lines  # one line, no stack trace, no Ray retry log
    assert lines[0].startswith(f"error: the Ray cluster at {c.address} {problem}: ")
    assert "RAY_AUTH_TOKEN=" in lines[0] and "ray get-auth-token" in lines[0]
