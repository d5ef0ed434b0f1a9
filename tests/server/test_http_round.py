"""The HTTP server's happy path: enrollment, a round over HTTP, the model download, events."""

import hashlib
import json
import threading
import time

import pytest
from sqlalchemy import create_engine, text
from starlette.testclient import WebSocketDenialResponse

from fedkey.common.task import TASK_KEYS
from fedkey.federation.metrics_row import DP_EVENTS, DP_ROW
from fedkey.server.db import hash_token
from fedkey.testing.http import (
    SECRET,
    Phone,
    enroll_phones,
    header_metadata,
    make_settings,
    metrics,
    run_round,
    running,
    shards,
    wait_round,
)
from fedkey.testing.wait import wait_for

OPERATOR = "op-s3cret-0123456789"


def test_enrollment_secret_names_and_hashed_tokens(tmp_path):
    settings = make_settings(tmp_path, wait_devices=5)
    with running(settings) as client:
        bad = client.post("/v1/devices", json={"enrollment_secret": "nope", "name": "a"})
        assert bad.status_code == 401
        assert "secret" in bad.json()["detail"]
        missing = client.post("/v1/devices", json={"name": "a"})
        assert missing.status_code == 401

        ok = client.post(
            "/v1/devices", json={"enrollment_secret": SECRET, "name": "phone-a", "num_samples": 5}
        )
        assert ok.status_code == 200
        assert ok.json()["device_id"] == "phone-a"
        token = ok.json()["token"]
        taken = client.post("/v1/devices", json={"enrollment_secret": SECRET, "name": "phone-a"})
        assert taken.status_code == 409
        assert "already enrolled" in taken.json()["detail"]
        bad_name = client.post("/v1/devices", json={"enrollment_secret": SECRET, "name": "../x"})
        assert bad_name.status_code == 422 and isinstance(bad_name.json()["detail"], str)
        anon = client.post("/v1/devices", json={"enrollment_secret": SECRET})
        assert anon.status_code == 200 and anon.json()["device_id"].startswith("dev-")
        not_json = client.post("/v1/devices", content=b"\x00garbage")
        assert not_json.status_code == 422 and isinstance(not_json.json()["detail"], str)

        # the token works; a wrong one does not
        view = client.get("/v1/rounds/current", headers={"Authorization": f"Bearer {token}"})
        assert view.status_code == 200
        assert view.json()["state"] == "waiting" and view.json()["round"] == 1
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            r = client.get("/v1/rounds/current", headers=headers)
            assert r.status_code == 401 and isinstance(r.json()["detail"], str)

        # FastAPI's own validation keeps the {"detail": str} shape
        r = client.get(
            "/v1/rounds/current",
            params={"wait": "soon"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 422 and isinstance(r.json()["detail"], str)
        assert client.get("/v1/nothing").json() == {"detail": "Not Found"}

    engine = create_engine(settings.db_url)
    with engine.connect() as db:
        hashes = [row[0] for row in db.execute(text("SELECT token_hash FROM devices"))]
    engine.dispose()
    assert hash_token(token) in hashes
    for path in (tmp_path / "run").glob("fedkey.db*"):
        assert token.encode() not in path.read_bytes()


def test_a_round_over_http_advances_the_model(tmp_path):
    settings = make_settings(tmp_path, rounds=2, fraction=0.5, wait_devices=4)
    with running(settings) as client:
        with client.websocket_connect("/v1/events") as ws:
            first = client.get("/v1/model")
            assert first.status_code == 200
            assert first.headers["X-Fedkey-Round"] == "0"
            etag = first.headers["ETag"]
            assert etag == f'"{hashlib.sha256(first.content).hexdigest()}"'
            assert client.get("/v1/model", headers={"If-None-Match": etag}).status_code == 304

            phones = enroll_phones(client, 4)
            views = wait_for(
                lambda: [p.current() for p in phones if p.current()["state"] == "open"]
            )
            assert len(views) == 4
            selected = [v for v in views if v["selected"]]
            assert len(selected) == 2  # fraction 0.5 of 4
            task = selected[0]["task"]
            assert tuple(task) == TASK_KEYS
            assert task["model_round"] == 0 and task["local_epochs"] == 1
            assert task["precision"] == "auto"  # each phone resolves it on its own hardware
            unselected = [v for v in views if not v["selected"]]
            assert all(v["task"] is None and v["upload"] is False for v in unselected)

            run_round(phones)
            rows = wait_round(client, 1)
            assert [r["round"] for r in rows] == [0, 1]
            assert len(rows[1]["aggregated"]) == 2
            assert rows[1]["test_ppl"] < rows[0]["test_ppl"]

            second = client.get("/v1/model", headers={"If-None-Match": etag})
            assert second.status_code == 200
            assert second.headers["X-Fedkey-Round"] == "1"
            assert second.headers["ETag"] != etag

            run_round(phones)
            rows = wait_round(client, 2)
            assert [r["round"] for r in rows] == [0, 1, 2]
            assert wait_for(lambda: client.get("/healthz").json()["state"] == "finished")
            assert phones[0].current(wait=5)["state"] == "finished"

            seen = []
            while "run_finished" not in seen:
                seen.append(ws.receive_json()["type"])
        assert seen.count("device_enrolled") == 4
        assert seen.count("round_opened") == 2
        assert seen.count("update_received") == 4
        assert seen.count("round_aggregated") == 2

        # metrics.jsonl and the database agree
        jsonl = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert len(jsonl) == 3 and metrics(client) == [json.loads(x) for x in jsonl]

        prom = client.get("/metrics").text
        assert "fedkey_uploads_accepted_total 4.0" in prom
        assert "fedkey_rounds_completed_total 2.0" in prom
        assert "fedkey_aggregation_seconds_count 2.0" in prom
        # the run finishes in the driver's next step after the last metrics row
        health = wait_for(lambda: (h := client.get("/healthz").json())["state"] == "finished" and h)
        assert health == {"status": "ok", "round": 2, "state": "finished"}


def test_a_long_poll_sleeps_through_the_rounds_its_device_is_not_in(tmp_path):
    """At 10,000 phones every transition answered every long-poll: 30,000 answers a round where
    3,000 concern the cohort. A device left out is answered when it gets something to do (here:
    the run finished), not at the round's close; the cohort still hears the close."""
    settings = make_settings(tmp_path, wait_devices=2, rounds=1, fraction=0.5)
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        views = wait_for(
            lambda: (
                (v := {p.name: p.current() for p in phones})
                and all(x["state"] == "open" for x in v.values())
                and v
            )
        )
        chosen, left_out = sorted(phones, key=lambda p: not views[p.name]["selected"])
        assert views[chosen.name]["selected"] and not views[left_out.name]["selected"]
        answer: dict = {}
        poll = threading.Thread(target=lambda: answer.update(left_out.current(wait=30)))
        poll.start()
        chosen.train(views[chosen.name])
        assert chosen.upload().status_code == 200
        assert chosen.current(wait=30)["uploaded"] is True  # at once: its view changed
        t = time.monotonic()
        closed = chosen.current(wait=30)  # woken by the close of its round
        assert closed["state"] in ("aggregating", "finished") and time.monotonic() - t < 25
        poll.join(timeout=40)
        assert answer["state"] == "finished"  # not "aggregating": that round was not its


def test_long_poll_waits_for_a_change_and_misses_none(tmp_path):
    settings = make_settings(tmp_path, wait_devices=2, rounds=1)
    with running(settings) as client:
        names = list(shards(2))
        a = Phone(client, names[0], shards(2)[names[0]]).enroll()
        first = a.current()
        assert first["state"] == "waiting"
        t = time.monotonic()
        assert a.current(wait=0.6) == first  # nothing changed: answered at the timeout
        assert time.monotonic() - t >= 0.5

        b = Phone(client, names[1], shards(2)[names[1]])
        threading.Timer(0.3, b.enroll).start()
        t = time.monotonic()
        opened = a.current(wait=20)  # woken by the round opening
        assert opened["state"] == "open" and time.monotonic() - t < 10
        a.train(opened)
        assert a.upload().status_code == 200
        # the view changed since the last answer (uploaded): the long-poll answers at once
        t = time.monotonic()
        assert a.current(wait=20)["uploaded"] is True
        assert time.monotonic() - t < 5


def test_under_dp_what_the_server_publishes_names_no_phone(tmp_path):
    """Which phones were selected and aggregated, what they were refused, and the scores on
    their held-out text are not releases the accountant paid for (fedkey.federation.metrics_row.public_row,
    DP_EVENTS): GET /v1/metrics, the model devices download and the event stream of a DP run
    publish an allow-list, naming no phone even in a refusal's words; the server's own
    metrics.jsonl still has everything."""
    settings = make_settings(
        tmp_path, rounds=1, fraction=0.5, wait_devices=4, dp_clip=1.0, dp_noise_multiplier=1.0
    )
    with running(settings) as client:
        with client.websocket_connect("/v1/events") as ws:
            phones = enroll_phones(client, 4)
            views = wait_for(
                lambda: (
                    (v := {p.name: p.current() for p in phones})
                    and all(x["state"] == "open" for x in v.values())
                    and v
                ),
                what="the round did not open",
            )
            left_out = next(p for p in phones if not views[p.name]["selected"])
            left_out.train(views[next(n for n, v in views.items() if v["selected"])])
            refused = left_out.upload()
            assert refused.status_code == 403 and left_out.name in refused.json()["detail"]
            run_round(phones)
            rows = wait_round(client, 1)
            events = []
            while not events or events[-1]["type"] != "run_finished":
                events.append(ws.receive_json())
        served = header_metadata(client.get("/v1/model").content)["metrics"]
    names = [p.name for p in phones]
    published = json.dumps([rows, served, events])
    assert rows[1]["epsilon"] > 0 and served["round"] == 1
    assert not any(name in published for name in names)
    for event in events:
        allowed = DP_EVENTS[event["type"]] | {"type", "time"}
        assert set(event) <= allowed, event
    assert {"round_opened", "round_aggregated", "run_finished"} <= {e["type"] for e in events}
    for row in (*rows, served):
        assert set(row) <= DP_ROW and "test_ppl" not in row and "val_ppl" not in row
    own = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(own["aggregated"]) == 2 and set(own["selected"]) <= set(names)
    assert own["test_ppl"] > 0 and own["noise_reproducible"] is False


def test_prometheus_counters_are_the_operators(tmp_path):
    """GET /metrics holds exact counts of what the phones did (uploads refused by reason): with
    FEDKEY_OPERATOR_TOKEN set it answers only that bearer token (401 otherwise), and a DP run
    without one refuses it (403, saying how to set one); without DP or token it stays open."""
    dp = dict(rounds=1, wait_devices=4, dp_clip=1.0, dp_noise_multiplier=1.0)
    with running(make_settings(tmp_path / "dp", **dp)) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 403 and "FEDKEY_OPERATOR_TOKEN" in refused.json()["detail"]
    with running(make_settings(tmp_path / "token", operator_token=OPERATOR, **dp)) as client:
        for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": OPERATOR}):
            assert client.get("/metrics", headers=header).status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
        assert scraped.status_code == 200 and "fedkey_uploads_rejected" in scraped.text
        # the scheme in any case, as a device's token (RFC 7235: case-insensitive)
        assert client.get("/metrics", headers={"Authorization": f"bearer  {OPERATOR} "}).is_success
    with running(make_settings(tmp_path / "plain", rounds=1, wait_devices=4)) as client:
        assert client.get("/metrics").status_code == 200


def test_with_an_operator_token_observers_need_it(tmp_path):
    """FEDKEY_OPERATOR_TOKEN closes GET /v1/metrics and WS /v1/events to whoever lacks it (401,
    the WebSocket refused before its handshake); FEDKEY_PRIVATE_MODEL closes GET /v1/model to
    all but enrolled devices and the operator. /healthz stays open."""
    settings = make_settings(
        tmp_path, rounds=1, wait_devices=4, operator_token=OPERATOR, private_model=True
    )
    operator = {"Authorization": f"Bearer {OPERATOR}"}
    with running(settings) as client:
        for header in ({}, {"Authorization": "Bearer wrong"}):
            refused = client.get("/v1/metrics", headers=header)
            assert refused.status_code == 401 and "OPERATOR_TOKEN" in refused.json()["detail"]
            with pytest.raises(WebSocketDenialResponse) as denied:
                with client.websocket_connect("/v1/events", headers=header):
                    pass
            assert denied.value.status_code == 401
            assert client.get("/v1/model", headers=header).status_code == 401
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/metrics", headers=operator).json()["rounds"][0]["round"] == 0
        assert client.get("/v1/model", headers=operator).status_code == 200
        with client.websocket_connect("/v1/events", headers=operator) as ws:
            phone = enroll_phones(client, 1)[0]
            assert ws.receive_json()["type"] == "device_enrolled"
        assert client.get("/v1/model", headers=phone.auth).status_code == 200


def test_v1_metrics_reads_the_database_once_per_recorded_round(tmp_path):
    """A flood of GET /v1/metrics costs one database read until the next round is recorded;
    then the new round is there at once."""
    with running(make_settings(tmp_path, rounds=1, wait_devices=2)) as client:
        coordinator = client.app_ref.state.coordinator
        reads = []
        read_rows = coordinator._read_rows
        coordinator._read_rows = lambda: reads.append(1) or read_rows()
        for _ in range(50):
            assert [r["round"] for r in metrics(client)] == [0]
        assert len(reads) == 1
        run_round(enroll_phones(client, 2))
        assert [r["round"] for r in wait_round(client, 1)] == [0, 1]
        assert len(reads) == 2
