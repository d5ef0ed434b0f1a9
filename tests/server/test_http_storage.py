"""The upload store (fedkey.federation.updates.store) and a full disk: uploads stream to disk and are read
back lazily; a full disk answers 507 with Retry-After, leaves nothing behind, never wedges a
round, and the round completes once space is back."""

from __future__ import annotations

import errno
import math
import sqlite3

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import OperationalError

from fedkey.federation.influence.bounding import coordinate_range
from fedkey.federation.updates import store as upload_store
from fedkey.federation.updates.store import StoredState
from fedkey.models.checkpoint import public_bytes
from fedkey.server import round_driver as driver
from fedkey.server.app import create_app
from fedkey.server.db import Device, MetricRow, Receipt
from fedkey.server.runtime.disk_full import out_of_space
from fedkey.testing.http import SECRET, enroll_phones, make_settings, running, wait_round
from fedkey.testing.wait import wait_for


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


# -- the store's pieces -----------------------------------------------------------------------


def test_stored_state_reads_what_was_saved_and_any_slice(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "emb": torch.randn(7, 5, generator=g),
        "w3": torch.randn(3, 4, 2, generator=g),
        "bias": torch.randn(6, generator=g),
        "steps": torch.tensor(9),
    }
    path = tmp_path / "u.safetensors"
    save_file(state, str(path))
    stored = StoredState(path)
    assert sorted(stored) == sorted(state) and len(stored) == 4
    for key, t in state.items():
        assert torch.equal(stored[key], t)
        flat = t.reshape(-1)
        for a, b in [(0, flat.numel()), (1, 4), (4, 11), (6, 7), (flat.numel() - 1, flat.numel())]:
            if b <= flat.numel():
                piece = stored.flat_slice(key, a, b)
                assert torch.equal(piece, flat[a:b]), (key, a, b)
                # its own elements only, not a view pinning the whole tensor (memory: the trim
                # holds one slice per phone of the cohort at once)
                assert piece.untyped_storage().nbytes() == (b - a) * t.element_size(), (key, a, b)
    with pytest.raises(KeyError):
        stored["missing"]


def test_trim_ranges_from_stored_updates_equal_those_in_memory(tmp_path, make_states, monkeypatch):
    glob, clients = make_states(9, seed=3)
    stored = []
    for i, c in enumerate(clients):
        path = tmp_path / f"c{i}.safetensors"
        save_file(c, str(path))
        stored.append(StoredState(path))
    monkeypatch.setattr(
        "fedkey.federation.influence.bounding.TRIM_CHUNK", 20
    )  # several slices per layer
    expected = coordinate_range(glob, clients, 2)
    got = coordinate_range(glob, stored, 2)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key][0], got[key][0]) and torch.equal(
            expected[key][1], got[key][1]
        )


def test_out_of_space_recognises_full_disks_and_full_databases(tmp_path):
    assert out_of_space(_disk_full())
    assert out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not out_of_space(OSError(errno.EIO, "I/O error"))
    assert not out_of_space(ValueError("no"))
    # A real SQLITE_FULL through SQLAlchemy: a database capped at a few pages.
    engine = create_engine(f"sqlite:///{tmp_path / 'tiny.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x BLOB)"))
    with pytest.raises(OperationalError) as caught:
        with engine.begin() as conn:
            conn.execute(text("PRAGMA max_page_count = 3"))
            for _ in range(20):
                conn.execute(text("INSERT INTO t VALUES (zeroblob(4096))"))
    assert isinstance(caught.value.orig, sqlite3.OperationalError)
    assert out_of_space(caught.value)


# -- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture
def two_phones(tmp_path):
    settings = make_settings(tmp_path, rounds=1, wait_devices=2)
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        view = wait_for(lambda: (v := phones[0].current()) and v["state"] == "open" and v)
        for p in phones:
            p.train(view if p is phones[0] else p.current())
        yield client, phones, tmp_path / "run"


def _receipts(client) -> list[Receipt]:
    coordinator = client.app_ref.state.coordinator
    with coordinator.sessions() as db:
        return list(db.scalars(select(Receipt).where(Receipt.kind == "update")))


def _round_files(storage) -> list[str]:
    return sorted(p.name for p in (storage / "uploads" / "round_0001").glob("*"))


def test_a_full_disk_while_an_upload_streams_is_a_507_and_leaves_nothing(two_phones, monkeypatch):
    client, (a, b), storage = two_phones
    real_write = upload_store._write

    def full(*args, **kwargs):
        raise _disk_full()

    monkeypatch.setattr(upload_store, "_write", full)
    r = a.upload()
    assert r.status_code == 507, r.text
    assert "disk is full" in r.json()["detail"] and r.headers["Retry-After"] == "60"
    assert _receipts(client) == [] and _round_files(storage) == []
    assert a.current()["uploaded"] is False and a.current()["state"] == "open"
    metrics = client.get("/metrics").text
    assert 'fedkey_storage_full_total{what="update"} 1.0' in metrics

    monkeypatch.setattr(upload_store, "_write", real_write)  # space is back
    assert a.upload().status_code == 200
    assert [r.device_id for r in _receipts(client)] == [a.name]


def test_a_failed_rename_takes_the_receipt_back(two_phones, monkeypatch):
    client, (a, b), storage = two_phones

    def broken(tmp, path):
        raise _disk_full()

    monkeypatch.setattr("fedkey.server.upload_inbox.publish", broken)
    r = a.upload()
    assert r.status_code == 507, r.text
    assert _receipts(client) == []
    assert _round_files(storage) == []  # neither the temporary file nor the final one


def test_a_full_disk_at_aggregation_keeps_the_round_open_until_space_is_back(
    two_phones, monkeypatch
):
    client, (a, b), storage = two_phones
    coordinator = client.app_ref.state.coordinator
    monkeypatch.setattr(driver, "AGGREGATION_RETRY", 0.5)
    aggregator = coordinator.aggregator
    real_complete = aggregator.complete
    failures = []

    def complete(*args, **kwargs):  # as the aggregation process answers a full disk
        if not failures:  # the first attempt finds the disk full
            failures.append(1)
            raise _disk_full()
        return real_complete(*args, **kwargs)

    monkeypatch.setattr(aggregator, "complete", complete)
    with client.websocket_connect("/v1/events") as ws:
        assert a.upload().status_code == 200
        assert b.upload().status_code == 200
        kinds: list[str] = []
        for _ in range(100):  # bounded: a few events per upload and transition
            kinds.append(ws.receive_json()["type"])
            if kinds[-1] == "round_aggregated":
                break
    assert kinds.index("aggregation_postponed") < kinds.index("round_aggregated")
    assert "round_failed" not in kinds  # the uploads were kept: nobody trains again
    rows = wait_round(client, 1)
    assert sorted(rows[-1]["aggregated"]) == sorted([a.name, b.name])


def test_the_served_model_is_the_checkpoint_without_its_private_memory(two_phones):
    client, (a, b), storage = two_phones
    assert a.upload().status_code == 200 and b.upload().status_code == 200
    wait_round(client, 1)
    served = client.get("/v1/model")
    assert served.headers["X-Fedkey-Round"] == "1"
    assert served.content == public_bytes(storage / "checkpoints" / "round_0001.safetensors")


def test_last_seen_is_written_in_a_batch_off_the_request_path(tmp_path):
    settings = make_settings(tmp_path, rounds=1, wait_devices=5)  # no round opens
    with running(settings) as client:
        (a,) = enroll_phones(client, 1)
        coordinator = client.app_ref.state.coordinator
        with coordinator.sessions() as db:
            enrolled = db.get(Device, a.name)
            assert enrolled is not None
            enrolled_at = enrolled.last_seen
        a.current()  # authenticated: remembered in memory, not written yet
        seen = coordinator.registry.last_seen[a.name]
        assert seen > enrolled_at
    # stop() wrote the last batch
    with coordinator.sessions() as db:
        dev = db.get(Device, a.name)
        assert dev is not None and dev.last_seen == seen


def test_metrics_of_a_diverged_round_are_served_with_null_not_a_500(tmp_path):
    settings = make_settings(tmp_path, rounds=1, wait_devices=5)
    with running(settings) as client:
        coordinator = client.app_ref.state.coordinator
        with coordinator.sessions.begin() as db:  # what a run wrecked by an attack records
            db.merge(MetricRow(round=7, row={"round": 7, "test_ppl": math.inf, "x": [math.nan]}))
        r = client.get("/v1/metrics")
        assert r.status_code == 200, r.text
        assert r.json()["rounds"][-1] == {"round": 7, "test_ppl": None, "x": [None]}


def test_an_enrollment_the_full_database_refuses_is_a_507_and_enrolls_nobody(tmp_path, monkeypatch):
    settings = make_settings(tmp_path, rounds=1, wait_devices=5)
    with running(settings) as client:
        coordinator = client.app_ref.state.coordinator

        def full(rows):
            raise _disk_full()

        monkeypatch.setattr(coordinator.db_writer, "_commit", full)
        body = {"enrollment_secret": SECRET, "name": "phone-1"}
        r = client.post("/v1/devices", json=body)
        assert r.status_code == 507 and r.headers["Retry-After"] == "60", r.text
        assert "phone-1" not in coordinator.registry.devices
        monkeypatch.undo()  # space is back: the same name enrolls
        assert client.post("/v1/devices", json=body).status_code == 200


def test_a_locked_database_is_a_503_to_retry_not_a_500(tmp_path, monkeypatch):
    app = create_app(make_settings(tmp_path, rounds=1, wait_devices=5))
    # the app's last-resort handler answers; the test client must not re-raise what it handled
    with TestClient(app, raise_server_exceptions=False) as client:
        coordinator = app.state.coordinator

        def locked(rows):
            raise OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))

        monkeypatch.setattr(coordinator.db_writer, "_commit", locked)
        r = client.post("/v1/devices", json={"enrollment_secret": SECRET, "name": "phone-1"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert "phone-1" not in coordinator.registry.devices
