"""Phones (run_device) and the fleet (run_fleet) against the fake server of tests/support:
uploads equal phone_round in-process bit for bit; 409, topK "no", dropout, attacks, restarts.
The phone tests run each phone both ways: as a thread with the blocking client (the thread
fleet's) and as an asyncio task with the async client (the Ray fleet's, fedkey.device_sim.fleets.async_phone)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch
from safetensors.torch import load as st_load

from fedkey.device_sim.client.http import DeviceClient
from fedkey.device_sim.fleets.async_phone import AsyncDeviceClient, run_phone, thread_trainer
from fedkey.device_sim.fleets.phone import DeviceReport
from fedkey.device_sim.fleets.thread_fleet import (
    SCALE_FACTOR,
    FleetConfig,
    FleetError,
    PhoneConfig,
    apply_attack,
    run_device,
    run_fleet,
)
from fedkey.device_sim.training.trainer import phone_round
from fedkey.federation.engine import client_seed
from fedkey.testing.fake_server import SECRET, TRAIN, FakeFederation, FakeServer, shards_for
from fedkey.testing.wait import wait_for

FAST = {"poll_wait": 5.0, "loss_wait": 2.0, "device": "cpu"}


def expected_upload(fed: FakeFederation, shard, name: str, r: int) -> dict[str, torch.Tensor]:
    """What phone_round gives in-process for the task the fake sent in round r."""
    res = phone_round(
        fed.config,
        fed.models[r - 1],
        shard,
        TRAIN,
        seed=client_seed(0, r, name),
        beta=fed.beta,
        sigma=1.0,
        device="cpu",
    )
    return res.state


def phones_in_threads(url: str, shards: dict, phones: dict[str, PhoneConfig]) -> dict:
    """Each phone in its own thread (one training at a time), as a fleet worker does."""
    lock, reports, errors = threading.Lock(), {}, {}
    http = httpx.Client()

    def one(name):
        client = DeviceClient(url, http, retry_seconds=10, backoff_initial=0.02)
        try:
            reports[name] = run_device(
                client, name, shards[name], SECRET, phones[name], train_lock=lock
            )
        except Exception as e:  # surfaced by the assertion below
            errors[name] = e

    threads = [threading.Thread(target=one, args=(n,)) for n in phones]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    http.close()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return reports


def phones_in_a_loop(url: str, shards: dict, phones: dict[str, PhoneConfig]) -> dict:
    """Every phone an asyncio task of one event loop (each its own connection and model cache),
    training in a worker thread one at a time, as a phone host of the Ray fleet runs them."""
    reports = {n: DeviceReport(n) for n in phones}

    async def main() -> None:
        train = thread_trainer()
        clients = {
            n: AsyncDeviceClient(url, retry_seconds=10, backoff_initial=0.02) for n in phones
        }
        await asyncio.gather(
            *(
                run_phone(clients[n], n, shards[n], SECRET, phones[n], train, None, reports[n])
                for n in phones
            )
        )

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert {n: r.error for n, r in reports.items() if r.error} == {}
    return reports


@pytest.fixture(params=["thread", "asyncio"])
def run_phones(request):
    return phones_in_threads if request.param == "thread" else phones_in_a_loop


def test_uploads_are_bitwise_phone_round_of_the_task(run_phones):
    shards = shards_for(3)
    fed = FakeFederation(n_devices=3, beta=0.01, defer=True)  # randomization, deferred topK
    srv = FakeServer(fed).start()
    try:
        reports = run_phones(srv.url, shards, {n: PhoneConfig(**FAST) for n in shards})
    finally:
        srv.stop()
    assert list(shards) == ["device-0", "device-1", "device-2"]
    assert fed.enrolled == {n: sum(len(s) - 1 for s in sh) for n, sh in shards.items()}
    assert fed.state == "finished" and sorted(fed.accepted) == [1, 2]
    for r in (1, 2):
        assert sorted(fed.accepted[r]) == list(shards)
        for name, body in fed.accepted[r].items():
            got, want = st_load(body), expected_upload(fed, shards[name], name, r)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want), (r, name)
    for rep in reports.values():
        assert rep.finished and rep.uploads == 2 and rep.trained == 2 and not rep.rejections
        assert rep.rounds_seen[-2:] == [1, 2]
    # The loss reports carried the shard's training tokens.
    assert {(r, n, k) for r, n, _, k in fed.losses_seen} == {
        (r, n, fed.enrolled[n]) for r in (1, 2) for n in shards
    }
    assert fed.hits["model"] == 6  # one download per phone and round (each its own cache)


def test_stale_round_topk_no_dropout_and_attacks(run_phones):
    shards = shards_for(6)
    fed = FakeFederation(
        n_devices=6, decline={"device-0"}, stale_once={"device-1"}, dont_wait_for={"device-2"}
    )
    phones = {
        "device-0": PhoneConfig(**FAST),  # topK says no
        "device-1": PhoneConfig(**FAST),  # its round-1 upload gets 409
        "device-2": PhoneConfig(dropout_rate=1.0, **FAST),
        "device-3": PhoneConfig(attack="nan", **FAST),
        "device-4": PhoneConfig(attack="shape", **FAST),
        "device-5": PhoneConfig(attack="scale", slow_rate=1.0, slow_seconds=0.1, **FAST),
    }
    srv = FakeServer(fed).start()
    try:
        reports = run_phones(srv.url, shards, phones)
    finally:
        srv.stop()
    assert fed.state == "finished"
    sent = {}
    for r, name, body in fed.bodies:
        sent.setdefault(name, []).append((r, body))
    loss_from = {n for _, n, _, _ in fed.losses_seen}

    r0 = reports["device-0"]
    assert r0.declined == 2 and r0.uploads == 0 and "device-0" not in sent

    r1 = reports["device-1"]
    assert r1.stale == 1 and r1.uploads == 1 and r1.finished
    assert [r for r, _ in sent["device-1"]] == [1, 2]  # the 409 was not retried
    assert sorted(fed.accepted[2]) == ["device-1", "device-5"]

    r2 = reports["device-2"]
    assert r2.dropped >= 1 and r2.trained == 0 and r2.finished and r2.uploads == 0
    assert "device-2" not in sent and "device-2" not in loss_from

    r3, r4 = reports["device-3"], reports["device-4"]
    assert [r for r, _ in sent["device-3"]] == [1, 2]
    assert all(any(t.isnan().any() for t in st_load(b).values()) for _, b in sent["device-3"])
    assert r3.rejections == {"422 the update holds NaN or Inf": 2} and r3.finished
    assert [r for r, _ in sent["device-4"]] == [1, 2]
    assert sum(r4.rejections.values()) == 2 and all(k.startswith("422") for k in r4.rejections)
    assert len(st_load(sent["device-4"][0][1])) == len(fed.models[0]) - 1

    r5 = reports["device-5"]
    assert r5.uploads == 2 and r5.slowed == 2
    g = fed.models[0]
    honest = expected_upload(fed, shards["device-5"], "device-5", 1)
    got = st_load(fed.accepted[1]["device-5"])
    assert all(torch.equal(got[k], g[k] + SCALE_FACTOR * (honest[k] - g[k])) for k in g)


def test_attacks_do_not_touch_their_inputs():
    g = {"a": torch.zeros(2, 3), "b": torch.ones(3)}
    t = {"a": torch.full((2, 3), 0.5), "b": torch.full((3,), 2.0)}
    before = {k: v.clone() for k, v in t.items()}
    assert torch.equal(apply_attack("scale", t, g)["b"], torch.full((3,), 101.0))
    assert apply_attack("nan", t, g)["a"].isnan().sum() == 1
    shape = apply_attack("shape", t, g)
    assert list(shape) == ["a"] and shape["a"].shape == (6,)
    assert apply_attack(None, t, g) is t
    assert all(torch.equal(t[k], before[k]) for k in t)
    with pytest.raises(ValueError):
        PhoneConfig(attack="bogus")


def test_fleet_in_spawned_workers_with_a_malicious_phone():
    shards = shards_for(4)
    fed = FakeFederation(n_devices=4)
    srv = FakeServer(fed).start()
    cfg = FleetConfig(
        server=srv.url,
        count=4,
        max_train_tokens=3000,
        device="cpu",
        workers=2,
        enrollment_secret=SECRET,
        malicious=1,
        attack="nan",
        retry_seconds=20,
        poll_wait=5,
    )
    try:
        summary = run_fleet(cfg, progress=False)
    finally:
        srv.stop()
    assert sorted(fed.enrolled) == list(shards)
    assert summary["errors"] == {} and not summary["interrupted"]
    assert summary["uploads"] == 6 and summary["finished"] == 4
    assert summary["rejections"] == {"422 the update holds NaN or Inf": 2}
    assert summary["per_device"]["device-3"]["rejections"]  # the last phone is the malicious one
    assert summary["rounds_completed"] == 2 and summary["rounds_seen"][-2:] == [1, 2]
    for name in ("device-0", "device-2"):
        got = st_load(fed.accepted[2][name])
        want = expected_upload(fed, shards[name], name, 2)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_fleet_survives_a_server_restart_mid_round(monkeypatch):
    refused = []  # requests of the phones (in this process) that found nothing listening
    send = httpx.HTTPTransport.handle_request

    def counting(self, request):
        try:
            return send(self, request)
        except httpx.ConnectError:
            refused.append(request.url.path)
            raise

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", counting)
    fed = FakeFederation(n_devices=2, defer=True)
    srv = FakeServer(fed).start()
    cfg = FleetConfig(
        server=srv.url,
        count=2,
        max_train_tokens=3000,
        device="cpu",
        workers=0,  # in this process
        enrollment_secret=SECRET,
        retry_seconds=20,
        poll_wait=5,
    )
    out = {}
    t = threading.Thread(target=lambda: out.update(s=run_fleet(cfg, progress=False)))
    fed.fail["update"] = 10**6  # hold the round open: uploads fail until the restart
    t.start()
    try:
        wait_for(lambda: fed.hits["update"] >= 2, timeout=20)
        srv.stop()  # the server goes away (connections refused) ...
        wait_for(lambda: refused, timeout=20, what="no phone tried the stopped server")
        fed.fail["update"] = 0
        srv.start()  # ... and comes back on the same port with its state
        t.join(timeout=30)
    finally:
        srv.stop()
    assert not t.is_alive()
    s = out["s"]
    assert s["errors"] == {} and s["uploads"] == 4 and s["rounds_completed"] == 2


def test_fleet_with_a_wrong_secret_fails_loudly():
    fed = FakeFederation(n_devices=2)
    srv = FakeServer(fed).start()
    cfg = FleetConfig(
        server=srv.url, count=2, max_train_tokens=3000, workers=0, enrollment_secret="nope"
    )
    try:
        with pytest.raises(FleetError, match="401: bad enrollment secret"):
            run_fleet(cfg, progress=False)
    finally:
        srv.stop()
