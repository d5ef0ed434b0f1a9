"""Every rejection of the HTTP contract: right status, a helpful message, and nothing changed."""

import math

import pytest
import torch
from safetensors.torch import save as st_save

from fedkey.testing.http import (
    SECRET,
    Phone,
    enroll_phones,
    make_settings,
    running,
    snapshot,
    wait_round,
)
from fedkey.testing.wait import wait_for


def _save(state: dict) -> bytes:
    return st_save({k: v.contiguous() for k, v in state.items()})


def check(response, status: int, *words: str):
    assert response.status_code == status, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert isinstance(detail, str) and len(detail) > 10, detail
    for w in words:
        assert w.lower() in detail.lower(), (w, detail)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two phones, both selected in round 1; phone A has trained and uploaded, B has not."""
    tmp = tmp_path_factory.mktemp("rejections")
    settings = make_settings(tmp, rounds=1, wait_devices=2, max_upload_margin=1024)
    with running(settings) as client:
        with client.websocket_connect("/v1/events") as ws:
            a, b = enroll_phones(client, 2)
            view = wait_for(lambda: (v := a.current()) and v["state"] == "open" and v)
            a.train(view)
            b.train(b.current())
            ok = a.upload()
            assert ok.status_code == 200
            yield {
                "client": client,
                "a": a,
                "b": b,
                "receipt": ok.json(),
                "storage": tmp / "run",
                "ws": ws,
                "limit": client.app_ref.state.coordinator.parts.inbox.upload_limit,
            }


@pytest.fixture
def unchanged(server):
    before = snapshot(server["client"], server["storage"])
    yield
    assert snapshot(server["client"], server["storage"]) == before


def test_receipt(server):
    rec = server["receipt"]
    assert rec["round"] == 1 and len(rec["sha256"]) == 64 and rec["bytes"] > 0
    assert server["a"].current()["uploaded"] is True


def test_no_or_bad_token(server, unchanged):
    a = server["a"]
    headers = a.upload_headers()
    del headers["Authorization"]
    check(a.upload(headers=headers), 401, "authorization")
    check(a.upload(headers={**headers, "Authorization": "Bearer forged"}), 401, "token")
    check(a.upload(headers={**headers, "Authorization": "Basic abc"}), 401, "bearer")


def test_stale_and_future_round(server, unchanged):
    b = server["b"]
    check(b.upload(n=0), 409, "round 0", "stale")
    check(b.upload(n=2), 409, "round 2", "future")
    r = b.client.post(
        "/v1/rounds/7/loss",
        json={"train_loss": 1.0, "num_samples": 3},
        headers=b.auth,
    )
    check(r, 409, "round 7")


def test_not_selected(server, unchanged):
    client = server["client"]
    late = Phone(client, "late-phone", server["b"].shard).enroll()  # enrolled after the draw
    late.result, late.round = server["b"].result, 1
    check(late.upload(), 403, "not selected")
    check(late.report_loss(), 403, "not selected")


def test_duplicate_identical_returns_the_same_receipt(server, unchanged):
    again = server["a"].upload()
    assert again.status_code == 200
    assert again.json() == server["receipt"]


def test_duplicate_different(server, unchanged):
    a = server["a"]
    state = dict(a.result.state)
    name = sorted(state)[0]
    state[name] = state[name] + 1e-3
    check(a.upload(body=_save(state)), 409, "different")
    # a different body that is also too large is still a different duplicate
    check(a.upload(body=b"x" * (server["limit"] + 1)), 409, "different")


def _b_state(server):
    return dict(server["b"].result.state)


def test_wrong_names(server, unchanged):
    state = _b_state(server)
    name = sorted(state)[0]
    state["surprise.weight"] = state.pop(name)
    check(server["b"].upload(body=_save(state)), 422, "surprise.weight", name)


def test_wrong_shape(server, unchanged):
    state = _b_state(server)
    name = "embedding.weight"
    state[name] = state[name][:-1]
    check(server["b"].upload(body=_save(state)), 422, name)


def test_wrong_dtype(server, unchanged):
    state = _b_state(server)
    name = "rnn.bias_hh_l0"  # small: a float64 copy stays within the size limit
    state[name] = state[name].double()
    check(server["b"].upload(body=_save(state)), 422, name, "float64")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf(server, unchanged, bad):
    state = _b_state(server)
    name = sorted(state)[1]
    t = state[name].clone()
    t.view(-1)[3] = bad
    state[name] = t
    word = "nan" if math.isnan(bad) else "inf"
    check(server["b"].upload(body=_save(state)), 422, name, word)


def test_oversized(server, unchanged):
    b, limit = server["b"], server["limit"]
    check(b.upload(body=b"\0" * (limit + 1)), 413, "larger")
    # a lying Content-Length: the bytes are counted as they stream in
    headers = {**b.upload_headers(), "Content-Length": "100"}
    check(b.upload(body=b"\0" * (limit + 5000), headers=headers), 413, "larger")

    # chunked, no Content-Length at all
    def chunks():
        for _ in range(limit // 4096 + 2):
            yield b"\0" * 4096

    r = b.client.post("/v1/rounds/1/update", content=chunks(), headers=b.upload_headers())
    check(r, 413, "larger")


def test_garbage_bytes(server, unchanged):
    b = server["b"]
    check(b.upload(body=b"this is not a safetensors file at all"), 400, "safetensors")
    check(b.upload(body=b""), 400, "empty")
    check(b.upload(body=b"\xff" * 64), 400, "safetensors")


@pytest.mark.parametrize(
    "header,value,word",
    [
        ("X-Fedkey-Num-Samples", None, "missing"),
        ("X-Fedkey-Num-Samples", "many", "positive integer"),
        ("X-Fedkey-Num-Samples", "0", "positive integer"),
        ("X-Fedkey-Num-Samples", "2.5", "positive integer"),
        ("X-Fedkey-Train-Loss", None, "missing"),
        ("X-Fedkey-Train-Loss", "low", "finite"),
        ("X-Fedkey-Train-Loss", "nan", "finite"),
        ("X-Fedkey-Train-Loss", "inf", "finite"),
    ],
)
def test_missing_or_bad_headers(server, unchanged, header, value, word):
    b = server["b"]
    headers = b.upload_headers()
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    check(b.upload(headers=headers), 422, header, word)


def test_bad_loss_reports(server, unchanged):
    b = server["b"]
    url = "/v1/rounds/1/loss"
    check(b.client.post(url, json={"train_loss": "x", "num_samples": 3}, headers=b.auth), 422)
    check(b.client.post(url, json={"train_loss": 1.0, "num_samples": 0}, headers=b.auth), 422)
    check(b.client.post(url, content=b"[1, 2]", headers=b.auth), 422, "json")
    check(b.client.post(url, json={"train_loss": 1.0, "num_samples": 3}), 401)


def test_then_the_round_completes_and_the_stream_saw_it_all(server):
    """Last (tests run in file order): B's valid upload completes the round."""
    client, b, ws = server["client"], server["b"], server["ws"]
    assert b.upload().status_code == 200
    rows = wait_round(client, 1)
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["aggregated"] == ["device-0", "device-1"]
    assert client.get("/v1/model").headers["X-Fedkey-Round"] == "1"
    # a late upload for the finished run
    check(b.upload(), 409, "finished")

    events = []
    while not events or events[-1]["type"] != "run_finished":
        events.append(ws.receive_json())
    types = [e["type"] for e in events]
    for t in ("device_enrolled", "round_opened", "update_received", "round_aggregated"):
        assert t in types
    reasons = {e["reason"] for e in events if e["type"] == "update_rejected"}
    assert {
        "unauthorized",
        "stale_round",
        "future_round",
        "not_selected",
        "duplicate",
        "bad_tensors",
        "non_finite",
        "too_large",
        "unparseable",
        "bad_headers",
    } <= reasons
    agg = next(e for e in events if e["type"] == "round_aggregated")
    assert agg["round"] == 1 and agg["val_ppl"] > 0 and agg["test_ppl"] > 0
    prom = client.get("/metrics").text
    assert 'fedkey_uploads_rejected_total{kind="update",reason="too_large"} 3.0' in prom
    assert SECRET not in prom
    assert torch.get_num_threads() == 1
