"""The server on a real PostgreSQL: a throwaway cluster (initdb + pg_ctl) in a temporary
directory, listening on 127.0.0.1 on a free port only, trust auth, one fresh database per test.

Debian's postgresql package puts initdb and pg_ctl in /usr/lib/postgresql/<version>/bin (CI installs
it; .ci/run). initdb refuses to run as root: as root the cluster runs as the `postgres` user (or
`nobody`) through runuser. Without initdb, or when the cluster does not start, the tests skip and
say why. The cluster is fedkey.testing.postgres.temp_cluster (the one `fedkey-bench load
--database postgresql` starts), with durability off.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from fedkey.server.db import MetricRow, make_sessionmaker
from fedkey.testing.http import (
    SECRET,
    Phone,
    enroll_phones,
    make_settings,
    metrics,
    run_round,
    running,
    shards,
    wait_round,
)
from fedkey.testing.postgres import FAST, Cluster, PostgresError, temp_cluster
from fedkey.testing.wait import wait_for

BIG = 3_000_000_000  # more than a 32-bit INTEGER holds (2**31 - 1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    try:
        with temp_cluster(max_connections=40, settings=FAST) as c:
            yield c
    except PostgresError as e:
        pytest.skip(f"the PostgreSQL test cluster did not start: {e}")


_names = itertools.count()


def fresh_database(cluster: Cluster) -> str:
    """A new empty database on `cluster`: its URL."""
    name = f"fedkey_{next(_names)}"
    engine = create_engine(cluster.url("postgres"), isolation_level="AUTOCOMMIT")
    with engine.connect() as db:
        db.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return cluster.url(name)


@pytest.fixture
def pg_url(cluster: Cluster) -> str:
    return fresh_database(cluster)


def sql(url: str, statement: str, **params) -> list[tuple]:
    engine = create_engine(url)
    with engine.connect() as db:
        rows = [tuple(r) for r in db.execute(text(statement), params)]
    engine.dispose()
    return rows


def test_the_schema_on_postgres_holds_64_bit_counts_and_long_paths(pg_url):
    make_sessionmaker(pg_url).kw["bind"].dispose()
    types = dict(
        sql(
            pg_url,
            "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'public'",
        )
    )
    assert types["devices.num_samples"] == "bigint"
    assert types["receipts.num_samples"] == "bigint"
    assert types["receipts.bytes"] == "bigint"
    assert types["receipts.path"] == "text"
    assert types["devices.enrolled_at"] == "double precision"
    assert types["rounds.deadline"] == "double precision"


def test_a_metrics_row_with_infinity_is_stored_as_null_on_postgres(pg_url, tmp_path):
    """PostgreSQL's json refuses NaN and Infinity (a diverged run's perplexity); SQLite keeps them."""
    row = {"round": 3, "test_ppl": math.inf, "losses": [math.nan, 1.5], "ok": 2.0}
    for url in (pg_url, f"sqlite:///{tmp_path / 'x.db'}"):
        sessions = make_sessionmaker(url)
        with sessions.begin() as db:
            db.add(MetricRow(round=3, row=row))
        with sessions() as db:
            stored = db.get(MetricRow, 3).row
        sessions.kw["bind"].dispose()
        if url == pg_url:
            assert stored == {"round": 3, "test_ppl": None, "losses": [None, 1.5], "ok": 2.0}
        else:
            assert stored["test_ppl"] == math.inf and math.isnan(stored["losses"][0])


@pytest.mark.slow
def test_a_federation_on_postgres_survives_a_restart(pg_url, tmp_path):
    """Enroll, aggregate a round, stop mid-round 2 with one upload in; the restarted server has
    the devices, the open round and the receipt from PostgreSQL, and finishes the run."""
    settings = make_settings(tmp_path, rounds=2, wait_devices=2, database_url=pg_url)
    assert settings.db_url == pg_url
    storage = tmp_path / "run"
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        wait_for(lambda: phones[0].current()["state"] == "open")
        run_round(phones)
        rows = wait_round(client, 1)
        assert [r["round"] for r in rows] == [0, 1]
        assert rows[1]["aggregated"] == ["device-0", "device-1"]
        view = wait_for(lambda: (v := phones[0].current()) and v["round"] == 2 and v)
        phones[0].train(view)
        receipt = phones[0].upload().json()
        phones[1].train(phones[1].current())
    assert not list(storage.glob("fedkey.db*"))  # nothing went to SQLite
    assert sql(pg_url, "SELECT id FROM devices ORDER BY id") == [("device-0",), ("device-1",)]
    assert sql(pg_url, "SELECT number, state FROM rounds ORDER BY number") == [
        (1, "aggregated"),
        (2, "open"),
    ]

    with running(settings) as client:
        for p in phones:
            p.client = client  # the same tokens: the devices are still enrolled
        view = phones[0].current()
        assert (view["round"], view["attempt"], view["state"]) == (2, 0, "open")
        assert view["uploaded"] is True
        assert phones[0].upload().json() == receipt  # the receipt survived the restart
        assert [r["round"] for r in metrics(client)] == [0, 1]
        assert phones[1].upload().status_code == 200
        rows = wait_round(client, 2)
        assert [r["round"] for r in rows] == [0, 1, 2]
        jsonl = (storage / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x) for x in jsonl] == rows
        assert wait_for(lambda: client.get("/healthz").json()["state"] == "finished")
    assert sql(pg_url, "SELECT count(*) FROM receipts WHERE kind = 'update'") == [(4,)]


def test_sample_counts_above_32_bits_on_postgres(pg_url, tmp_path):
    """num_samples 3,000,000,000 at enrollment and in an upload's header (max_samples 2**62)."""
    settings = make_settings(
        tmp_path, rounds=1, wait_devices=2, max_samples=2**62, database_url=pg_url
    )
    with running(settings) as client:
        (name_a, shard_a), (name_b, shard_b) = shards(2).items()
        big = Phone(client, name_a, shard_a)
        r = client.post(
            "/v1/devices", json={"enrollment_secret": SECRET, "name": name_a, "num_samples": BIG}
        )
        assert r.status_code == 200, r.text
        big.token = r.json()["token"]
        small = Phone(client, name_b, shard_b).enroll()
        view = wait_for(lambda: (v := big.current()) and v["state"] == "open" and v)
        big.train(view)
        r = big.upload(headers={**big.upload_headers(), "X-Fedkey-Num-Samples": str(BIG)})
        assert r.status_code == 200, r.text
        small.train(small.current())
        assert small.upload().status_code == 200
        rows = wait_round(client, 1)
        assert rows[1]["aggregated"] == [name_a, name_b]
    assert sql(pg_url, "SELECT num_samples FROM devices WHERE id = :d", d=name_a) == [(BIG,)]
    assert sql(pg_url, "SELECT num_samples FROM receipts WHERE device_id = :d", d=name_a) == [
        (BIG,)
    ]
    with running(settings) as client:  # read back on start: the enrolled size is still 3e9
        assert client.app_ref.state.coordinator.registry.devices[name_a] == BIG
