"""The phone's HTTP client against the small fake federation server of tests/support/fake_server.py
(it follows the README contract): enrollment, typed errors, the model's ETag cache, retries of
503s and refused connections, loss and upload errors. The real server is tested elsewhere.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from safetensors.torch import load as st_load

from fedkey.device_sim.client.http import ApiError, DeviceClient, ServerUnavailable
from fedkey.federation.engine import client_seed
from fedkey.testing.fake_server import SECRET, FakeFederation, FakeServer
from fedkey.testing.wait import wait_for


@pytest.fixture
def http():
    with httpx.Client() as c:
        yield c


def serve(fed: FakeFederation):
    return FakeServer(fed).start()


# -- the client -----------------------------------------------------------------------------------


def test_enroll_then_typed_errors_without_retry(http):
    fed = FakeFederation(n_devices=2)
    srv = serve(fed)
    try:
        client = DeviceClient(srv.url, http, retry_seconds=5)
        device_id, token = client.enroll(SECRET, "device-0", 123)
        assert (device_id, client.token) == ("id-device-0", token)
        assert fed.enrolled == {"device-0": 123}

        with pytest.raises(ApiError) as bad:
            DeviceClient(srv.url, http, retry_seconds=5).enroll("wrong", "device-1")
        assert bad.value.status == 401 and bad.value.detail == "bad enrollment secret"
        with pytest.raises(ApiError) as taken:
            DeviceClient(srv.url, http, retry_seconds=5).enroll(SECRET, "device-0")
        assert taken.value.status == 409 and "taken" in taken.value.detail
        assert "POST /v1/devices -> 409" in str(taken.value)
        assert fed.hits["enroll"] == 3  # 4xx are answers, not retried

        view = client.current(wait=0)
        assert view["state"] == "waiting" and not view["selected"]
    finally:
        srv.stop()


def test_model_download_is_cached_by_etag(http):
    fed = FakeFederation(n_devices=1)
    srv = serve(fed)
    try:
        client = DeviceClient(srv.url, http)
        first = client.download_model()
        assert first.round == 0 and first.config == fed.config
        assert first.tokenizer.to_config() == fed.tokenizer.to_config()
        assert all(torch.equal(first.state[k], v) for k, v in fed.models[0].items())
        second = client.download_model()
        assert fed.model_304 == 1 and fed.hits["model"] == 2
        assert second.state is first.state
    finally:
        srv.stop()


def test_transient_503s_are_retried_then_given_up(http):
    fed = FakeFederation(n_devices=1)
    srv = serve(fed)
    try:
        fed.fail["model"] = 2
        client = DeviceClient(srv.url, http, retry_seconds=10, backoff_initial=0.01)
        assert client.download_model().round == 0
        assert fed.hits["model"] == 3

        fed.fail["enroll"] = 1000
        quick = DeviceClient(srv.url, http, retry_seconds=0.3, backoff_initial=0.01)
        with pytest.raises(ServerUnavailable) as gone:
            quick.enroll(SECRET, "device-0")
        assert gone.value.status == 503 and "restarting" in str(gone.value)
    finally:
        srv.stop()


def test_an_upload_whose_body_stalled_408_is_sent_again(http):
    fed = FakeFederation(n_devices=1, deadline=60)
    srv = serve(fed)
    try:
        client = DeviceClient(srv.url, http, retry_seconds=10, backoff_initial=0.01)
        client.enroll(SECRET, "device-0", 10)
        fed.fail_status, fed.fail["update"] = (
            408,
            2,
        )  # the server's "no bytes for 30 s; send it again"
        receipt = client.upload(1, {k: v + 0.01 for k, v in fed.models[0].items()}, 10, 3.5)
        assert receipt["round"] == 1 and fed.hits["update"] == 3 and len(fed.bodies) == 1
    finally:
        srv.stop()


def test_connection_refused_until_the_server_is_up(http):
    fed = FakeFederation(n_devices=1)
    srv = FakeServer(fed)  # port chosen, nothing listening yet
    attempts = []  # every request the client sends (each one refused while nothing listens)
    http.event_hooks["request"].append(attempts.append)
    client = DeviceClient(srv.url, http, retry_seconds=20, backoff_initial=0.05, backoff_max=0.2)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=client.enroll(SECRET, "device-0", 5)))
    t.start()
    wait_for(lambda: len(attempts) >= 4, timeout=10, what="the client did not retry")
    assert t.is_alive()  # still retrying
    srv.start()
    try:
        t.join(timeout=10)
        assert out["r"][0] == "id-device-0"
    finally:
        srv.stop()


def test_loss_and_upload_errors_carry_status_and_detail(http):
    fed = FakeFederation(n_devices=1, deadline=60)
    srv = serve(fed)
    try:
        client = DeviceClient(srv.url, http, retry_seconds=5)
        client.enroll(SECRET, "device-0", 10)
        view = client.current(wait=0)
        assert view["state"] == "open" and view["round"] == 1 and view["selected"]
        assert view["task"]["seed"] == client_seed(0, 1, "device-0")
        with pytest.raises(ApiError) as stale:
            client.report_loss(7, 1.0, 10)
        assert stale.value.status == 409 and "not open" in stale.value.detail
        assert client.report_loss(1, 3.5, 10, wait=1) is True

        state = {k: v.clone() for k, v in fed.models[0].items()}
        state["embedding.weight"][0, 0] = float("nan")
        with pytest.raises(ApiError) as nan:
            client.upload(1, state, 10, 3.5)
        assert nan.value.status == 422 and "NaN" in nan.value.detail

        good = {k: v + 0.01 for k, v in fed.models[0].items()}
        fed.rejected.clear()
        receipt = client.upload(1, good, 10, 3.5)
        assert receipt["round"] == 1 and receipt["bytes"] == len(fed.bodies[-1][2])
        n, name, body = fed.bodies[-1]
        assert (n, name) == (1, "device-0")
        assert all(torch.equal(st_load(body)[k], v) for k, v in good.items())
    finally:
        srv.stop()
