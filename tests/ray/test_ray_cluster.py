"""fedkey.device_sim.ray_cluster without a cluster: the errors a person sees, found fast (Ray itself
retries an address that does not answer for minutes)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.device_sim.ray_cluster import RayOptions, RayUnavailable, connect
from fedkey.device_sim.training.backends import BACKENDS, make_backend
from fedkey.runners.processes import free_port


def test_an_address_where_nothing_listens_is_one_line_with_what_to_do():
    port = free_port()
    with pytest.raises(
        RayUnavailable, match=rf"no Ray cluster at 127.0.0.1:{port} .*ray start --head"
    ):
        connect(RayOptions(address=f"127.0.0.1:{port}"))


def test_an_address_that_is_not_host_port_is_refused():
    with pytest.raises(RayUnavailable, match="not HOST:PORT"):
        connect(RayOptions(address="nowhere"))


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"cpus_per_worker": 0.0}, "needs some CPU or GPU"),
        ({"gpus_per_worker": -1.0}, "cannot be negative"),
        ({"workers": 0}, "at least one actor"),
    ],
)
def test_options_a_trainer_cannot_have_are_refused(kw, problem):
    with pytest.raises(ValueError, match=problem):
        RayOptions(**kw)


def test_an_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="choose one of local, ray, stacked"):
        make_backend("spark")  # type: ignore[arg-type]
    assert BACKENDS == ("local", "ray", "stacked")


def test_simulate_with_no_cluster_at_the_address_says_so():
    port = free_port()
    result = CliRunner().invoke(
        app,
        ["simulate", "--data", "demo", "--backend", "ray", "--ray-address", f"127.0.0.1:{port}"],
    )
    assert result.exit_code != 0
    assert f"no Ray cluster at 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output
