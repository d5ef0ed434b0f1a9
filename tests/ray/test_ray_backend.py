"""The ray training backend on a real two-node cluster (tests/ray/conftest.py): simulate trains
phones on both nodes and ends with bitwise the weights of the local backend; a trainer actor
killed mid-round costs no update (its task is retried on the other actor); train-central runs as
one task on the cluster with the same weights."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedkey.corpora.dataset import prepare
from fedkey.device_sim.ray_cluster import RayOptions
from fedkey.device_sim.training.process_pool import LocalTask, run_task
from fedkey.device_sim.training.ray_pool import RayTrainerPool
from fedkey.federation.engine import client_seed
from fedkey.models.checkpoint import build_model, model_state
from fedkey.runners.baselines import train_central
from fedkey.runners.simulate import SimulationConfig, simulate
from fedkey.testing.workload import DATA, FED, tiny

pytestmark = pytest.mark.slow


def checkpoints(out: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(p) for p in sorted((out / "checkpoints").glob("round_*.safetensors"))]


def assert_same_weights(a: Path, b: Path) -> None:
    ours, theirs = checkpoints(a), checkpoints(b)
    assert len(ours) == len(theirs) == FED.rounds + 1
    for x, y in zip(ours, theirs, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    """The reference: the same simulation with the local backend (in this process)."""
    out = tmp_path_factory.mktemp("local")
    simulate(SimulationConfig(DATA, FED, tiny, str(out), workers=0, progress=False))
    return out


def test_simulate_on_two_nodes_trains_on_both_with_the_local_weights(
    two_nodes, local_run, tmp_path
):
    rows = simulate(
        SimulationConfig(
            DATA,
            FED,
            tiny,
            str(tmp_path),
            progress=False,
            backend="ray",
            ray=RayOptions(address=two_nodes.address),
        )
    )
    for row in rows[1:]:
        assert set(row["trained_on"]) == two_nodes.node_ids  # each node trained phones
        assert sum(row["trained_on"].values()) == DATA.clients
        assert row["lost"] == {}
    assert_same_weights(tmp_path, local_run)


def test_simulate_on_a_local_ray_instance_gives_the_local_weights(local_run, tmp_path):
    """--backend ray with no --ray-address: a private one-node Ray instance on 127.0.0.1."""
    import ray

    assert not ray.is_initialized()
    simulate(
        SimulationConfig(
            DATA,
            FED,
            tiny,
            str(tmp_path),
            progress=False,
            backend="ray",
            ray=RayOptions(num_cpus=1),
        )
    )
    assert not ray.is_initialized()  # the instance it started is stopped again
    assert_same_weights(tmp_path, local_run)


def round_tasks(n: int = 6) -> tuple[list[LocalTask], dict[str, torch.Tensor]]:
    prepared = prepare(replace(DATA, clients=n))
    config = tiny(prepared.tokenizer.vocab_size)
    torch.manual_seed(0)
    state = model_state(build_model(config))
    tasks = [
        LocalTask(d, prepared.shards[d], client_seed(0, 1, d), config, FED.train)
        for d in sorted(prepared.shards)
    ]
    return tasks, state


def test_an_actor_killed_mid_round_costs_no_update(two_nodes):
    tasks, state = round_tasks()
    expected = {t.device_id: run_task(t, state) for t in tasks}
    pool = RayTrainerPool(RayOptions(address=two_nodes.address))
    try:
        pids = {p.pid for p in pool.ready()}
        assert len(pids) == 2
        got, killed = {}, None
        for device, result in pool.stream(tasks, state):
            got[device] = result
            if killed is None:  # one phone back, the others still queued or training
                killed = (pids - {pool.placements[device].pid}).pop()
                os.kill(killed, signal.SIGKILL)
        assert pool.retried >= 1 and pool.lost == {}
        assert set(got) == set(expected)
        for d, result in got.items():
            assert result is not None, d
            for k, v in expected[d].state.items():
                assert torch.equal(result.state[k], v), (d, k)
        # The run goes on: the replacement actor trains the next round.
        assert len(pool.run(tasks, state)) == len(tasks)
        assert killed not in {p.pid for p in pool.ready()}
    finally:
        pool.close()


def test_train_central_on_the_cluster_gives_the_local_weights(two_nodes, tmp_path):
    central = replace(DATA, clients=2)
    args = (central, FED.train, tiny)
    train_central(*args, str(tmp_path / "local"), epochs=1, progress=False, ksr_sentences=0)
    train_central(
        *args,
        str(tmp_path / "ray"),
        epochs=1,
        progress=False,
        ksr_sentences=0,
        backend="ray",
        ray=RayOptions(address=two_nodes.address),
    )
    for x, y in zip(checkpoints(tmp_path / "local"), checkpoints(tmp_path / "ray"), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
