"""What a run keeps on disk is its owner's alone (the metrics, the database, a generated
enrollment secret: never in the log), and a crash in the middle of a metrics row does not stop a
resume."""

from __future__ import annotations

import json
import logging

import pytest

from fedkey.federation.storage import RunStorage
from fedkey.server.coordinator import ENROLLMENT_SECRET_FILE
from fedkey.server.db import make_engine
from fedkey.testing.http import make_settings, running


def mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_a_torn_last_metrics_line_is_left_out_and_a_bad_earlier_one_named(tmp_path):
    storage = RunStorage(tmp_path)
    storage.append_metrics({"round": 0})
    storage.append_metrics({"round": 1})
    with storage.metrics_path.open("a") as f:
        f.write('{"round": 2, "val_p')  # the crash came in the middle of this append
    assert storage.read_metrics() == [{"round": 0}, {"round": 1}]
    assert mode(storage.metrics_path) == 0o600
    storage.metrics_path.write_text('{"round": 0}\n{broken\n{"round": 1}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        storage.read_metrics()
    storage.write_metrics([{"round": 0}])
    assert mode(storage.metrics_path) == 0o600 and storage.read_metrics() == [{"round": 0}]


def test_the_sqlite_database_is_the_owners(tmp_path):
    path = tmp_path / "db" / "fedkey.db"
    engine = make_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    engine.dispose()
    assert mode(path) == 0o600


def test_a_generated_enrollment_secret_goes_to_a_file_not_the_log(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fedkey.server")
    with running(make_settings(tmp_path, enrollment_secret=None, wait_devices=1)) as client:
        path = tmp_path / "run" / ENROLLMENT_SECRET_FILE
        secret = path.read_text()
        assert mode(path) == 0o600 and len(secret) >= 16
        assert secret not in caplog.text and str(path) in caplog.text
        ok = client.post("/v1/devices", json={"enrollment_secret": secret, "name": "a"})
        assert ok.status_code == 200, ok.text
    assert json.loads(ok.text)["device_id"] == "a"
