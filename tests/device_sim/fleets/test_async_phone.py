"""The asyncio phone's client (fedkey.device_sim.fleets.async_phone.AsyncDeviceClient) against the fake federation
server of tests/support/fake_server.py: the blocking client's contract (tests/device_sim/
test_client_http.py) over the lean h11 connection, and one model download shared by the phones of
an event loop. The phones' protocol itself runs both ways in test_fleet_phones.py; against the
real server in test_aphone_server.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load as st_load

from fedkey.device_sim.client.http import ApiError, FedkeyError, ServerUnavailable, Stopped
from fedkey.device_sim.fleets.async_phone import AsyncDeviceClient, AsyncModelCache, pause
from fedkey.testing.fake_server import SECRET, FakeFederation, FakeServer


@pytest.fixture
def fed():
    federation = FakeFederation(n_devices=1, deadline=60)
    srv = FakeServer(federation).start()
    federation.url = srv.url
    yield federation
    srv.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_enroll_and_typed_errors_without_retry(fed):
    async def main():
        client = AsyncDeviceClient(fed.url, retry_seconds=5)
        device_id, token = await client.enroll(SECRET, "device-0", 123)
        assert (device_id, client.token) == ("id-device-0", token)
        with pytest.raises(ApiError) as bad:
            await AsyncDeviceClient(fed.url).enroll("wrong", "device-1")
        assert bad.value.status == 401 and bad.value.detail == "bad enrollment secret"
        with pytest.raises(ApiError) as taken:
            await AsyncDeviceClient(fed.url).enroll(SECRET, "device-0")
        assert "POST /v1/devices -> 409" in str(taken.value)
        return await client.current(wait=0)

    view = run(main())
    assert fed.enrolled == {"device-0": 123}
    assert fed.hits["enroll"] == 3  # 4xx are answers, not retried
    assert view["state"] == "open" and view["round"] == 1 and view["selected"]


def test_one_download_serves_the_phones_of_a_loop(fed):
    async def main():
        cache = AsyncModelCache()
        clients = [AsyncDeviceClient(fed.url, cache=cache) for _ in range(5)]
        return await asyncio.gather(*(c.download_model() for c in clients))

    models = run(main())
    assert fed.hits["model"] == 5 and fed.model_304 == 4  # one body, four 304s
    assert all(m.state is models[0].state for m in models)
    assert all(torch.equal(models[0].state[k], v) for k, v in fed.models[0].items())
    assert models[0].config == fed.config and models[0].round == 0


def test_503s_are_retried_then_given_up(fed):
    async def main():
        fed.fail["model"] = 2
        client = AsyncDeviceClient(fed.url, retry_seconds=10, backoff_initial=0.01)
        assert (await client.download_model()).round == 0
        fed.fail["enroll"] = 1000
        quick = AsyncDeviceClient(fed.url, retry_seconds=0.3, backoff_initial=0.01)
        with pytest.raises(ServerUnavailable) as gone:
            await quick.enroll(SECRET, "device-0")
        return gone.value

    gone = run(main())
    assert fed.hits["model"] == 3
    assert gone.status == 503 and "restarting" in str(gone)


def test_refused_connections_are_retried_until_the_server_is_up():
    fed = FakeFederation(n_devices=1)
    srv = FakeServer(fed)  # its port chosen, nothing listening yet

    async def main():
        client = AsyncDeviceClient(srv.url, retry_seconds=20, backoff_initial=0.05, backoff_max=0.2)
        attempts, connect = [], client.conn._open

        async def counted() -> None:
            attempts.append(1)
            await connect()

        client.conn._open = counted  # type: ignore[method-assign]
        enroll = asyncio.create_task(client.enroll(SECRET, "device-0", 5))
        while len(attempts) < 4:  # refused, refused, ...
            assert not enroll.done(), enroll
            await asyncio.sleep(0.01)
        await asyncio.to_thread(srv.start)  # the server comes up while the phone retries
        return await enroll

    try:
        assert run(main())[0] == "id-device-0"
    finally:
        srv.stop()


def test_stop_ends_the_retries():
    fed = FakeFederation(n_devices=1)
    srv = FakeServer(fed)  # nothing listening: every attempt is refused

    async def main():
        stop = asyncio.Event()
        client = AsyncDeviceClient(srv.url, retry_seconds=60, backoff_initial=5.0, stop=stop)
        enroll = asyncio.create_task(client.enroll(SECRET, "device-0", 5))
        await asyncio.sleep(0.2)  # refused once, now in its first backoff wait
        stop.set()
        with pytest.raises(Stopped):
            await enroll
        assert await pause(stop, 60.0)  # a stopped pause returns at once

    run(main())


def test_loss_and_upload_errors_carry_status_and_detail(fed):
    async def main():
        client = AsyncDeviceClient(fed.url, retry_seconds=5)
        await client.enroll(SECRET, "device-0", 10)
        with pytest.raises(ApiError) as stale:
            await client.report_loss(7, 1.0, 10)
        assert stale.value.status == 409 and "not open" in stale.value.detail
        assert await client.report_loss(1, 3.5, 10, wait=1) is True
        state = {k: v.clone() for k, v in fed.models[0].items()}
        state["embedding.weight"][0, 0] = float("nan")
        with pytest.raises(ApiError) as nan:
            await client.upload(1, state, 10, 3.5)
        assert nan.value.status == 422 and "NaN" in nan.value.detail
        fed.rejected.clear()
        good = {k: v + 0.01 for k, v in fed.models[0].items()}
        return good, await client.upload(1, good, 10, 3.5)

    good, receipt = run(main())
    n, name, body = fed.bodies[-1]
    assert (n, name) == (1, "device-0") and receipt["bytes"] == len(body)
    assert all(torch.equal(st_load(body)[k], v) for k, v in good.items())


def test_a_url_that_is_not_http_is_refused_in_one_line():
    with pytest.raises(FedkeyError, match="not an http"):
        AsyncDeviceClient("127.0.0.1:8000")
