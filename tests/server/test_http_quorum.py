"""Deadlines and quorum: silent devices do not stall a round; too few updates re-run it."""

import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from fedkey.testing.http import (
    enroll_phones,
    make_settings,
    metrics,
    run_round,
    running,
    snapshot,
    wait_round,
)
from fedkey.testing.wait import wait_for


def test_quorum_at_the_deadline_then_a_failed_attempt_is_rerun(tmp_path):
    deadline = 3.0
    settings = make_settings(
        tmp_path, rounds=2, wait_devices=4, round_deadline=deadline, quorum_fraction=0.5
    )
    storage = tmp_path / "run"
    with running(settings) as client:
        with client.websocket_connect("/v1/events") as ws:
            phones = enroll_phones(client, 4)
            view = wait_for(lambda: (v := phones[0].current()) and v["state"] == "open" and v)
            opened = time.time()
            assert view["round"] == 1 and view["attempt"] == 0

            # round 1: two of four upload, two stay silent -> aggregated at the deadline
            for p in phones[:2]:
                p.train(p.current())
                assert p.upload().status_code == 200
            assert phones[0].current()["state"] == "open"  # still waiting for the others
            rows = wait_round(client, 1, timeout=deadline + 20)
            assert time.time() - opened >= deadline - 0.5
            assert rows[1]["aggregated"] == ["device-0", "device-1"]
            assert rows[1]["selected"] == [p.name for p in phones]

            # round 2: one of four uploads -> quorum (2) missed, nothing applied, attempt 1
            view = wait_for(
                lambda: (
                    (v := phones[0].current()) and v["round"] == 2 and v["state"] == "open" and v
                )
            )
            assert view["attempt"] == 0
            before = snapshot(client, storage)
            phones[0].train(view)
            assert phones[0].upload().status_code == 200
            retry = wait_for(
                lambda: (v := phones[1].current()) and v["attempt"] == 1 and v,
                timeout=deadline + 20,
            )
            assert retry["round"] == 2 and retry["state"] == "open"
            assert snapshot(client, storage) == before  # nothing half-applied
            assert phones[0].current()["uploaded"] is False  # a new attempt, uploads start over

            for p in phones:
                p.train(p.current())
                assert p.upload().status_code == 200
            rows = wait_round(client, 2)
            assert [r["round"] for r in rows] == [0, 1, 2]
            assert len(rows[2]["aggregated"]) == 4

            events = []
            while not events or events[-1]["type"] != "run_finished":
                events.append(ws.receive_json())
        failed = [e for e in events if e["type"] == "round_failed"]
        assert len(failed) == 1
        assert failed[0]["round"] == 2 and failed[0]["attempt"] == 0
        assert failed[0]["received"] == 1 and failed[0]["quorum"] == 2
        opened = [(e["round"], e["attempt"]) for e in events if e["type"] == "round_opened"]
        assert opened == [(1, 0), (2, 0), (2, 1)]
        assert "fedkey_rounds_failed_total 1.0" in client.get("/metrics").text
        assert metrics(client) == rows

    engine = create_engine(settings.db_url)
    with engine.connect() as db:
        states = db.execute(text("SELECT number, attempt, state FROM rounds ORDER BY id")).all()
    engine.dispose()
    assert [tuple(s) for s in states] == [
        (1, 0, "aggregated"),
        (2, 0, "failed"),
        (2, 1, "aggregated"),
    ]
    assert not list((storage / "uploads").glob("round_*/*.safetensors"))


def test_no_update_at_all_fails_the_round(tmp_path):
    settings = make_settings(tmp_path, rounds=1, wait_devices=1, round_deadline=1.0)
    with running(settings) as client:
        (phone,) = enroll_phones(client, 1)
        wait_for(lambda: phone.current()["attempt"] >= 2, timeout=20)
        assert metrics(client) and [r["round"] for r in metrics(client)] == [0]
        health = client.get("/healthz").json()
        assert health["round"] == 1 and health["state"] == "open"


@pytest.mark.parametrize("failure", ["thread-raises", "process-raises", "process-killed"])
def test_a_failing_aggregation_is_not_half_applied_and_is_rerun(tmp_path, failure):
    """Whether the aggregation raises in the server's thread, raises in the aggregation process
    (an upload gone from disk) or the process is killed, nothing of the round is applied and it
    is run again (with a new aggregation process)."""
    where = failure.split("-")[0]
    settings = make_settings(tmp_path, rounds=1, wait_devices=2, aggregate_in=where)
    storage = tmp_path / "run"
    with running(settings) as client:
        aggregator = client.app_ref.state.coordinator.aggregator
        federation = aggregator.federation
        real_round, real_complete = federation.complete_round, aggregator.complete
        calls = []

        def flaky_round(plan, updates):  # thread: the engine itself raises
            if len(calls) == 1:
                raise RuntimeError("disk full")
            return real_round(plan, updates)

        def flaky_complete(plan, uploads):
            calls.append(plan.attempt)
            if len(calls) == 1 and failure == "process-raises":
                Path(uploads[0][1].path).unlink()  # the child finds an upload missing
            if len(calls) == 1 and failure == "process-killed":
                pid = aggregator.pid()
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid))
            return real_complete(plan, uploads)

        federation.complete_round = flaky_round
        aggregator.complete = flaky_complete
        pid = aggregator.pid()
        assert (pid is None) == (where == "thread")
        phones = enroll_phones(client, 2)
        wait_for(lambda: phones[0].current()["state"] == "open")
        before = snapshot(client, storage)
        run_round(phones)
        view = wait_for(lambda: (v := phones[0].current()) and v["attempt"] == 1 and v)
        assert view["round"] == 1 and view["uploaded"] is False
        assert snapshot(client, storage) == before
        run_round(phones)
        rows = wait_round(client, 1)
        assert [r["round"] for r in rows] == [0, 1] and calls == [0, 1]
        if failure == "process-killed":  # the rerun ran in a new aggregation process
            assert aggregator.pid() not in (None, pid)


def _zombie(pid: int) -> bool:
    """A killed child its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True
