"""Asyncio phones (fedkey.device_sim.fleets.async_phone, the Ray fleet's phones without Ray) against the real server
(uvicorn on loopback, a tiny model on the demo corpus): two rounds end with the same global
weights, bit for bit, as the thread fleet's phones give the same server; and how phone hosts are
planned over nodes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from fedkey.device_sim.client.http import parse_checkpoint
from fedkey.device_sim.fleets.async_phone import (
    AsyncDeviceClient,
    AsyncModelCache,
    run_phone,
    thread_trainer,
)
from fedkey.device_sim.fleets.phone import DeviceReport
from fedkey.device_sim.fleets.ray_fleet import plan_hosts
from fedkey.device_sim.fleets.thread_fleet import fleet_phones, run_fleet
from fedkey.testing.http import SECRET
from tests.device_sim.real_server import final_weights, fleet_config, real_server

PHONES = 3


@pytest.mark.slow
def test_asyncio_phones_give_the_thread_fleets_weights(tmp_path):
    with real_server(tmp_path / "threads", PHONES) as (url, storage):
        summary = run_fleet(fleet_config(url, PHONES), progress=False)
        want = final_weights(storage)
    assert summary["errors"] == {} and summary["uploads"] == 2 * PHONES

    with real_server(tmp_path / "asyncio", PHONES) as (url, storage):
        cfg = fleet_config(url, PHONES)
        model = httpx.get(url + "/v1/model")  # the shards are cut with the server's tokenizer
        assert model.status_code == 200
        phones = fleet_phones(cfg, parse_checkpoint(model.content).tokenizer)
        reports = {name: DeviceReport(name) for name, _, _ in phones}

        async def main() -> None:
            cache, train = AsyncModelCache(), thread_trainer()
            await asyncio.gather(
                *(
                    run_phone(
                        AsyncDeviceClient(url, cache=cache, retry_seconds=20),
                        name,
                        shard,
                        SECRET,
                        phone,
                        train,
                        None,
                        reports[name],
                    )
                    for name, shard, phone in phones
                )
            )

        asyncio.run(asyncio.wait_for(main(), timeout=120))
        got = final_weights(storage)
    assert {n: r.error for n, r in reports.items() if r.error} == {}
    assert [r.uploads for r in reports.values()] == [2] * PHONES
    assert all(r.finished for r in reports.values())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_hosts_are_spread_over_the_nodes():
    phones = [(f"p{i}", [[1, 2]], None) for i in range(7)]
    plans = plan_hosts(phones, ["a", "b"])  # type: ignore[arg-type]
    assert [p.node for p in plans] == ["a", "b"]
    assert [[n for n, _, _ in p.phones] for p in plans] == [
        ["p0", "p2", "p4", "p6"],
        ["p1", "p3", "p5"],
    ]
    many = plan_hosts(phones, ["a", "b"], per_host=2)  # 4 hosts of at most 2 phones
    assert [p.node for p in many] == ["a", "b", "a", "b"]
    assert sorted(len(p.phones) for p in many) == [1, 2, 2, 2]
    assert [p.node for p in plan_hosts(phones[:1], ["a", "b"])] == ["a"]  # no empty host
    with pytest.raises(ValueError, match="no alive node"):
        plan_hosts(phones, [])
