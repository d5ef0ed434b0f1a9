"""A stopped or crashed server resumes the run: same open round, receipts kept, no duplicates."""

import json

import torch
from safetensors.torch import load_file
from sqlalchemy import create_engine, text

from fedkey.testing.http import (
    DATA,
    enroll_phones,
    make_settings,
    metrics,
    run_round,
    running,
    wait_round,
)
from fedkey.testing.wait import wait_for


def jsonl(storage):
    return [json.loads(x) for x in (storage / "metrics.jsonl").read_text().splitlines()]


def sql(settings, *statements):
    engine = create_engine(settings.db_url)
    with engine.begin() as db:
        out = [db.execute(text(s)).all() if s.startswith("SELECT") else None for s in statements]
    engine.dispose()
    return out


def test_stop_mid_round_and_continue(tmp_path):
    settings = make_settings(tmp_path, rounds=3, wait_devices=2)
    storage = tmp_path / "run"
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        wait_for(lambda: phones[0].current()["state"] == "open")
        run_round(phones)
        wait_round(client, 1)
        view = wait_for(lambda: (v := phones[0].current()) and v["round"] == 2 and v)
        phones[0].train(view)
        receipt = phones[0].upload().json()
        phones[1].train(phones[1].current())
    # the app is stopped: round 2 is open with one upload in

    with running(settings) as client:
        for p in phones:
            p.client = client
        view = phones[0].current()
        assert (view["round"], view["attempt"], view["state"]) == (2, 0, "open")
        assert view["uploaded"] is True
        assert phones[0].upload().json() == receipt  # the receipt survived the restart
        assert [r["round"] for r in metrics(client)] == [0, 1]
        assert phones[1].upload().status_code == 200
        wait_round(client, 2)
        wait_for(lambda: phones[0].current()["round"] == 3)
        run_round(phones)
        rows = wait_round(client, 3)
        assert [r["round"] for r in rows] == [0, 1, 2, 3]
        assert rows[2]["aggregated"] == ["device-0", "device-1"]
        assert jsonl(storage) == rows
        wait_for(lambda: client.get("/healthz").json()["state"] == "finished")

    # the interrupted run equals an uninterrupted simulation, bit for bit
    from fedkey.common.config import DataConfig
    from fedkey.runners.simulate import SimulationConfig, simulate

    out = tmp_path / "simulated"
    simulate(
        SimulationConfig(
            DataConfig(**DATA, clients=2, partition="iid"),
            settings.federation_config(),
            settings.build_model_config,
            str(out),
            workers=0,
            device="cpu",
            progress=False,
        )
    )
    a = load_file(storage / "checkpoints" / "round_0003.safetensors")
    b = load_file(out / "checkpoints" / "round_0003.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_crash_between_checkpoint_and_database_commit(tmp_path):
    """The checkpoint of round 1 is written but the database still has round 1 open, no
    metrics row, and metrics.jsonl lost its line: the restart records round 1 exactly once."""
    settings = make_settings(tmp_path, rounds=2, wait_devices=2)
    storage = tmp_path / "run"
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        wait_for(lambda: phones[0].current()["state"] == "open")
        run_round(phones)
        wait_round(client, 1)
        wait_for(lambda: phones[0].current()["round"] == 2)
    assert (storage / "checkpoints" / "round_0001.safetensors").exists()
    sql(
        settings,
        "UPDATE rounds SET state = 'open' WHERE number = 1",
        "DELETE FROM rounds WHERE number = 2",
        "DELETE FROM metrics WHERE round = 1",
    )
    lines = (storage / "metrics.jsonl").read_text().splitlines()
    (storage / "metrics.jsonl").write_text(lines[0] + "\n")

    with running(settings) as client:
        for p in phones:
            p.client = client
        assert [r["round"] for r in metrics(client)] == [0, 1]
        assert [r["round"] for r in jsonl(storage)] == [0, 1]
        view = phones[0].current()
        assert (view["round"], view["attempt"], view["state"]) == (2, 0, "open")
        assert client.get("/v1/model").headers["X-Fedkey-Round"] == "1"
        run_round(phones)
        rows = wait_round(client, 2)
        assert [r["round"] for r in rows] == [0, 1, 2]
        assert jsonl(storage) == rows
    (states,) = sql(settings, "SELECT number, attempt, state FROM rounds ORDER BY number")
    assert [tuple(s) for s in states] == [(1, 0, "aggregated"), (2, 0, "aggregated")]


def test_restart_after_the_run_is_finished(tmp_path):
    settings = make_settings(tmp_path, rounds=1, wait_devices=1)
    with running(settings) as client:
        phones = enroll_phones(client, 1)
        wait_for(lambda: phones[0].current()["state"] == "open")
        run_round(phones)
        wait_round(client, 1)
    with running(settings) as client:
        assert client.get("/healthz").json() == {"status": "ok", "round": 1, "state": "finished"}
        phones[0].client = client
        assert phones[0].current()["state"] == "finished"
        assert [r["round"] for r in metrics(client)] == [0, 1]
