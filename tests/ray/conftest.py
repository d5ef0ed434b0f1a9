"""A real two-node Ray cluster on this machine, shared by every test under tests/ray/.

ray.cluster_utils.Cluster starts a head (GCS, raylet, object store) and a second node (its own
raylet and object store) as separate processes, both bound to 127.0.0.1 with one CPU each, so
one trainer actor fits per node and work has to cross nodes. It is started once per session and
stopped at its end, only its own processes (never `ray stop`, which would stop every Ray
instance on the machine). Tests that need it skip with the reason when Ray cannot start here.

It runs with token authentication (RAY_AUTH_MODE=token, the token in ~/.ray/auth_token), as
`ray start --head` and a local `ray.init()` do since Ray 2.60: a process's auth mode is fixed
once Ray has read it, so a test that starts a local instance (which turns token auth on) and
then joins this cluster needs the cluster to agree.

Connect a driver with `connect(RayOptions(address=two_nodes.address))` and close the session at
the end of the test (fedkey.device_sim.ray_cluster); the cluster outlives it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fedkey.device_sim.ray_cluster import LOCALHOST


@dataclass(frozen=True)
class TwoNodes:
    """The running test cluster: the head's HOST:PORT and the two nodes' Ray node ids."""

    address: str
    head_node_id: str
    worker_node_id: str

    @property
    def node_ids(self) -> set[str]:
        return {self.head_node_id, self.worker_node_id}


@pytest.fixture(scope="session")
def two_nodes() -> Iterator[TwoNodes]:
    """A head and a second node, `--num-cpus 1` each, on 127.0.0.1 (see the module docstring)."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError as e:  # pragma: no cover - ray is pinned
        pytest.skip(f"Ray is not installed: {e}")
    from ray._private.authentication.authentication_token_setup import (
        ensure_token_if_auth_enabled,
    )
    from ray._raylet import Config  # type: ignore[attr-defined]  # compiled; its .pyi omits it

    mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray caches the mode: read it again, as ray.init does
    cluster = None
    try:
        ensure_token_if_auth_enabled()  # creates ~/.ray/auth_token if there is none
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": 1,
                "node_ip_address": LOCALHOST,
                "include_dashboard": False,
            },
        )
        worker = cluster.add_node(num_cpus=1, node_ip_address=LOCALHOST)
        cluster.wait_for_nodes()
    except Exception as e:
        if cluster is not None:
            cluster.shutdown()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        pytest.skip(f"could not start a two-node Ray cluster here: {first}")
    assert cluster.head_node is not None
    try:
        yield TwoNodes(
            address=str(cluster.address),
            head_node_id=cluster.head_node.node_id,
            worker_node_id=worker.node_id,
        )
    finally:
        import ray

        if ray.is_initialized():  # a test left its driver connected
            ray.shutdown()
        cluster.shutdown()
        if mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = mode
        Config.initialize("")
