"""A repeated upload (the same bytes again: a phone's retry) answers the first receipt, but only as
a well-formed upload: its X-Fedkey-* headers are required as on the first. Found by the schema fuzz
(tests/server/test_fuzz.py): a repeat without them was answered 200, a request the OpenAPI
document calls invalid. A repeat that declares another sample count or loss is another upload: 409.
Both hold after the round has closed too (found by the fuzz's restart check, where the other phone's
upload closed the round first)."""

from __future__ import annotations

import threading

import pytest

from fedkey.server.round_driver import RoundDriver
from fedkey.testing.http import enroll_phones, make_settings, running, snapshot
from fedkey.testing.wait import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two phones selected in round 1; phone A has uploaded, B has not (the round stays open)."""
    tmp = tmp_path_factory.mktemp("repeat")
    with running(make_settings(tmp, rounds=1, wait_devices=2)) as client:
        a, b = enroll_phones(client, 2)
        a.train(wait_for(lambda: (v := a.current()) and v["state"] == "open" and v))
        first = a.upload()
        assert first.status_code == 200, first.text
        yield {"client": client, "a": a, "receipt": first.json(), "storage": tmp / "run"}


def test_a_repeat_answers_the_first_receipt(server):
    again = server["a"].upload()
    assert again.status_code == 200, again.text
    assert again.json() == server["receipt"]


@pytest.mark.parametrize(
    "header,value,word",
    [
        ("X-Fedkey-Num-Samples", None, "missing"),
        ("X-Fedkey-Num-Samples", "many", "positive integer"),
        ("X-Fedkey-Train-Loss", None, "missing"),
        ("X-Fedkey-Train-Loss", "nan", "finite"),
    ],
)
def test_a_repeat_without_its_headers_is_refused(server, header, value, word):
    a, client = server["a"], server["client"]
    before = snapshot(client, server["storage"])
    headers = a.upload_headers()
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    r = a.upload(headers=headers)
    assert r.status_code == 422, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert header in detail and word in detail, detail
    assert snapshot(client, server["storage"]) == before
    assert a.current()["uploaded"] is True  # the first upload stands
    assert a.upload().json() == server["receipt"]


@pytest.mark.parametrize(
    "header,value", [("X-Fedkey-Num-Samples", "7"), ("X-Fedkey-Train-Loss", "0.125")]
)
def test_the_same_bytes_declaring_otherwise_are_refused(server, header, value):
    a, client = server["a"], server["client"]
    before = snapshot(client, server["storage"])
    headers = a.upload_headers()
    assert headers[header] != value
    headers[header] = value
    r = a.upload(headers=headers)
    assert r.status_code == 409, (r.status_code, r.text)
    assert "already uploaded a different update" in r.json()["detail"]
    assert snapshot(client, server["storage"]) == before
    assert a.upload().json() == server["receipt"]


def test_a_repeat_after_the_round_closed_still_answers_the_first_receipt(tmp_path, monkeypatch):
    """A's answer was lost and B's upload closed the round meanwhile: while the round is being
    aggregated A's retry still gets its receipt (not "closed"), and another upload from A is still
    the 409 that says so."""
    release = threading.Event()
    complete = RoundDriver._complete

    def held(self, *args, **kwargs):  # aggregation waits until the test has asked
        release.wait(60)
        return complete(self, *args, **kwargs)

    monkeypatch.setattr(RoundDriver, "_complete", held)
    with running(make_settings(tmp_path, rounds=1, wait_devices=2)) as client:
        a, b = enroll_phones(client, 2)
        try:
            for p in (a, b):
                p.train(wait_for(lambda p=p: (v := p.current()) and v["state"] == "open" and v))
            first = a.upload()
            assert first.status_code == 200, first.text
            assert b.upload().status_code == 200
            wait_for(lambda: client.get("/healthz").json()["state"] == "aggregating")
            again = a.upload()
            assert again.status_code == 200, again.text
            assert again.json() == first.json()
            headers = a.upload_headers()
            headers["X-Fedkey-Num-Samples"] = str(a.num_samples + 1)
            other = a.upload(headers=headers)
            assert other.status_code == 409, other.text
            assert "already uploaded a different update" in other.json()["detail"]
        finally:
            release.set()
        wait_for(lambda: client.get("/healthz").json()["state"] == "finished")
