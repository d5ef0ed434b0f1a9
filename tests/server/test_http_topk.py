"""FedMed topK over HTTP, and the HTTP path reproducing `fedkey simulate` bit for bit."""

import pytest
import torch
from safetensors.torch import load_file

from fedkey.common.config import DataConfig
from fedkey.runners.simulate import SimulationConfig, simulate
from fedkey.testing.http import (
    DATA,
    enroll_phones,
    make_settings,
    run_round,
    running,
    wait_round,
)
from fedkey.testing.wait import wait_for


def simulated(tmp_path, settings, clients):
    """The same federation in-process (`fedkey simulate`), for comparison."""
    out = tmp_path / "simulated"
    rows = simulate(
        SimulationConfig(
            DataConfig(**DATA, clients=clients, partition="iid"),
            settings.federation_config(),
            settings.build_model_config,
            str(out),
            workers=0,
            device="cpu",
            progress=False,
        )
    )
    return rows, out


def same_weights(a, b) -> bool:
    wa, wb = load_file(a), load_file(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_topk_only_the_lowest_loss_half_uploads(tmp_path):
    settings = make_settings(
        tmp_path, strategy="fedmed", topk_beta=0.5, rounds=2, wait_devices=4, fraction=1.0
    )
    with running(settings) as client:
        phones = enroll_phones(client, 4)
        wait_for(lambda: phones[0].current()["state"] == "open")
        views = {p.name: p.current() for p in phones}
        for p in phones:
            assert views[p.name]["upload"] is None  # pending until the losses are in
            p.train(views[p.name])
        first = phones[0].report_loss(wait=0)
        assert first.status_code == 200 and first.json() == {"upload": None}
        # uploading before the decision is refused
        r = phones[0].upload()
        assert r.status_code == 403 and "pending" in r.json()["detail"]
        for p in phones[1:-1]:
            assert p.report_loss().status_code == 200
        # the last report completes the set: its long-poll gets the decision
        last = phones[-1].report_loss(wait=10)
        assert last.status_code == 200 and last.json()["upload"] in (True, False)

        losses = {p.name: p.result.train_loss for p in phones}
        lowest = sorted(sorted(losses, key=losses.get)[:2])
        told = {p.name: p.current()["upload"] for p in phones}
        assert sorted(n for n, up in told.items() if up) == lowest
        # the same report again gives the same answer; a different one is refused
        again = phones[0].report_loss()
        assert again.json() == {"upload": told[phones[0].name]}
        for p in phones:
            if not told[p.name]:
                r = p.upload()
                assert r.status_code == 403 and "topk" in r.json()["detail"].lower()
        for p in phones:
            if told[p.name]:
                assert p.upload().status_code == 200
        rows = wait_round(client, 1)
        assert rows[1]["aggregated"] == lowest
        assert rows[1]["selected"] == sorted(losses)

        run_round(phones, topk=True)
        rows = wait_round(client, 2)
        assert len(rows[2]["aggregated"]) == 2


@pytest.mark.parametrize(
    "options",
    [
        dict(strategy="fedmed", topk_beta=0.5, fraction=1.0),
        dict(strategy="fedavg", adafl=True, dp_beta=0.001),
    ],
    ids=["fedmed-topk", "adafl-randomized"],
)
def test_http_reproduces_simulate_bit_for_bit(tmp_path, options):
    clients, rounds = 4, 2
    settings = make_settings(tmp_path, rounds=rounds, wait_devices=clients, **options)
    topk = settings.topk
    with running(settings) as client:
        phones = enroll_phones(client, clients)
        for r in range(1, rounds + 1):
            wait_for(lambda r=r: phones[0].current()["round"] == r)
            run_round(phones, topk=topk)
            http_rows = wait_round(client, r)
    sim_rows, sim_out = simulated(tmp_path, settings, clients)
    assert [r["aggregated"] for r in http_rows] == [r["aggregated"] for r in sim_rows]
    assert [r["val_ppl"] for r in http_rows] == [r["val_ppl"] for r in sim_rows]
    for r in range(rounds + 1):
        name = f"checkpoints/round_{r:04d}.safetensors"
        assert same_weights(tmp_path / "run" / name, sim_out / name), f"round {r} differs"
