"""`fedkey devices --backend ray` on a real two-node Ray cluster on this machine: the phones'
hosts and their training on both nodes, the final global weights bitwise those of the thread
fleet with the same seed; a phone host killed mid-run costs only its phones."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from fedkey.device_sim.fleets.thread_fleet import run_fleet
from fedkey.testing.wait import wait_for
from tests.device_sim.real_server import final_weights, fleet_config, real_server

ray = pytest.importorskip("ray")

PHONES = 4

pytestmark = pytest.mark.slow


@pytest.fixture
def trainers(two_nodes) -> Iterator:
    """One trainer actor per node (fedkey.device_sim.training.ray_pool), the driver connected to the cluster."""
    from fedkey.device_sim.ray_cluster import RayOptions
    from fedkey.device_sim.training.ray_pool import RayTrainerPool

    pool = RayTrainerPool(RayOptions(address=two_nodes.address))
    try:
        assert {p.node_id for p in pool.ready()} == two_nodes.node_ids
        yield pool
    finally:
        pool.close()


def test_a_fleet_over_two_nodes_gives_the_thread_fleets_weights(two_nodes, trainers, tmp_path):
    from fedkey.device_sim.fleets.ray_fleet import run_ray_fleet

    with real_server(tmp_path / "threads", PHONES) as (url, storage):
        want_summary = run_fleet(fleet_config(url, PHONES), progress=False)
        want = final_weights(storage)

    hosts: list[dict] = []
    with real_server(tmp_path / "ray", PHONES) as (url, storage):
        cfg = fleet_config(url, PHONES)
        summary = run_ray_fleet(
            cfg, trainers.handles, trainers.workers, progress=False, on_hosts=hosts.extend
        )
        got = final_weights(storage)

    assert summary["errors"] == {} and summary["finished"] == PHONES
    assert summary["uploads"] == want_summary["uploads"] == 2 * PHONES
    assert summary.keys() == want_summary.keys()
    assert {h["node"] for h in hosts} == two_nodes.node_ids  # a phone host on each node ...
    assert [h["phones"] for h in hosts] == [2, 2] and all(h["trained"] == 4 for h in hosts)
    trained_on: Counter[str] = Counter()
    for h in hosts:
        trained_on.update(h["trained_on"])
    assert set(trained_on) == two_nodes.node_ids  # ... and phones trained on each node
    assert sum(trained_on.values()) == 2 * PHONES
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_dead_phone_host_costs_only_its_phones(trainers, tmp_path, monkeypatch):
    from fedkey.device_sim.fleets import ray_fleet

    hosts: list = []
    start_hosts = ray_fleet.start_hosts
    monkeypatch.setattr(
        ray_fleet, "start_hosts", lambda cfg, plans: hosts.extend(start_hosts(cfg, plans)) or hosts
    )

    def kill_the_second_host() -> None:
        wait_for(lambda: len(hosts) == 2, timeout=60, what="the hosts did not start")
        wait_for(
            lambda: ray.get(hosts[1].status.remote())["enrolled"] == 2,
            timeout=60,
            what="the second host's phones did not enroll",
        )
        ray.kill(hosts[1])

    # The server closes a round at its deadline with the uploads it has (a quorum of 1); 20 s
    # leaves the surviving phones time to train and upload on a loaded machine (at 8 s one of
    # their four uploads missed its round twice while five processes shared two cores).
    with real_server(tmp_path / "ray", PHONES, round_deadline=20.0, quorum=1) as (url, storage):
        killer = threading.Thread(target=kill_the_second_host, daemon=True)
        killer.start()
        summary = ray_fleet.run_ray_fleet(
            fleet_config(url, PHONES), trainers.handles, trainers.workers, progress=False
        )
        killer.join(timeout=5)
        final_weights(storage)  # both rounds completed without the lost phones

    lost = {n for n, r in summary["per_device"].items() if r["error"]}
    assert lost == {"device-1", "device-3"}  # the second host's phones (round-robin)
    assert all("its phone host died" in summary["per_device"][n]["error"] for n in lost)
    assert [k for k in summary["errors"] if k.startswith("crash-")] == ["crash-0"]
    assert summary["finished"] == 2 and summary["uploads"] == 4  # the others, both rounds
    assert summary["rounds_completed"] == 2
