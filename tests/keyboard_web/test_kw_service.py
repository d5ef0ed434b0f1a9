"""The keyboard service: WS /ws/suggest, bad frames, hot reload, the info, model and events
routes, and the relay of a federation server's events and metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Header, HTTPException, WebSocket, WebSocketDisconnect
from fastapi.testclient import TestClient

from fedkey.keyboard_web.app import MAX_TEXT, ORT_DIST, create_app
from fedkey.runners.processes import free_port
from fedkey.testing.keyboard import ThreadServer, save_round
from fedkey.testing.wait import wait_for

SPECIALS = {"<unk>", "<s>", "</s>"}


def real_words(words, vocab) -> bool:
    return all(w in vocab and w not in SPECIALS and any(c.isalnum() for c in w) for w in words)


@pytest.fixture
def client(models):
    with TestClient(create_app(models.word)) as c:
        yield c


def test_see_you_gets_three_real_words(client, models):
    vocab = set(models.vocab)
    with client.websocket_connect("/ws/suggest") as ws:
        ws.send_json({"text": "see you "})
        reply = ws.receive_json()
        assert set(reply) == {"suggestions", "round"}
        assert reply["round"] == 3
        assert len(reply["suggestions"]) == 3 and real_words(reply["suggestions"], vocab)
        for prefix in ["t", "to", "Se"]:
            ws.send_json({"text": "see you " + prefix, "id": 7})
            reply = ws.receive_json()
            assert reply["id"] == 7
            assert reply["suggestions"], prefix
            assert all(w.startswith(prefix.lower()) for w in reply["suggestions"]), reply
            assert real_words(reply["suggestions"], vocab)


def test_typing_character_by_character(client):
    text = "How are you doing? It has been ages. "
    with client.websocket_connect("/ws/suggest") as ws:
        for i in range(1, len(text) + 1):
            ws.send_text(json.dumps({"text": text[:i]}))
            reply = ws.receive_json()
            assert "error" not in reply and reply["round"] == 3
            if text[i - 1] == " ":
                assert len(reply["suggestions"]) == 3


@pytest.mark.parametrize(
    "frame, needle",
    [
        ("not json at all", "not JSON"),
        ('{"text": "unterminated', "not JSON"),
        ("[1, 2, 3]", '{"text"'),
        ('{"txt": "see you "}', '{"text"'),
        ('{"text": 42}', "must be a string"),
        ('{"text": null}', "must be a string"),
        ('{"text": ["see"]}', "must be a string"),
        (json.dumps({"text": "a" * (MAX_TEXT + 1)}), "too long"),
        ("x" * 70_000, "too long"),
    ],
)
def test_bad_frames_get_an_error_and_the_connection_stays_open(client, frame, needle):
    with client.websocket_connect("/ws/suggest") as ws:
        ws.send_text(frame)
        reply = ws.receive_json()
        assert set(reply) == {"error"} and needle in reply["error"], reply
        ws.send_json({"text": "see you "})
        assert len(ws.receive_json()["suggestions"]) == 3


def test_binary_frame_gets_an_error(client):
    with client.websocket_connect("/ws/suggest") as ws:
        ws.send_bytes(b'{"text": "see you "}')
        assert "JSON text frames" in ws.receive_json()["error"]
        ws.send_json({"text": "see you "})
        assert len(ws.receive_json()["suggestions"]) == 3


def test_info_model_and_page_routes(client, models):
    info = client.get("/api/info").json()
    assert info["round"] == 3 and info["strategy"] == "fedavg" and info["int8"] is False
    assert (info["data"], info["best_round"]) == (None, None)  # not recorded in this export
    assert info["perplexity"] == pytest.approx(175.25)
    assert info["suggestions"] is True
    assert info["browser_mode"]["available"] is (ORT_DIST / "ort.wasm.min.js").exists()

    r = client.get("/model.json")
    assert r.status_code == 200 and r.headers["x-fedkey-round"] == "3"
    assert r.json()["tokenizer"]["words"] == models.vocab
    r = client.get("/model.onnx")
    assert r.content == models.word.read_bytes()

    page = client.get("/")
    assert page.status_code == 200 and 'data-testid="input"' in page.text
    for path in ["/static/app.js", "/static/suggest.js", "/static/style.css"]:
        assert client.get(path).status_code == 200, path
    assert "javascript" in client.get("/static/app.js").headers["content-type"]

    metrics = client.get("/api/metrics").json()
    assert metrics["source"] == "served"
    assert metrics["rounds"] == [
        {"round": 3, "strategy": "fedavg", "val_ppl": 171.5, "test_ppl": 175.25}
    ]


@pytest.mark.skipif(
    not (ORT_DIST / "ort.wasm.min.js").exists(),
    reason="keyboard_web/node_modules is absent: run `npm ci --prefix keyboard_web`",
)
def test_vendor_serves_onnxruntime_web(client):
    r = client.get("/vendor/ort.wasm.min.js")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    wasm = client.get("/vendor/ort-wasm-simd-threaded.wasm")
    assert wasm.status_code == 200 and wasm.headers["content-type"] == "application/wasm"
    mjs = client.get("/vendor/ort-wasm-simd-threaded.mjs")
    assert mjs.status_code == 200 and "javascript" in mjs.headers["content-type"]


def test_hot_reload_swaps_the_model_without_restart(models, watch_dir):
    app = create_app(None, watch_dir=watch_dir, poll_seconds=0.05)
    with TestClient(app) as client:
        with (
            client.websocket_connect("/ws/suggest") as ws,
            client.websocket_connect("/ws/events") as events,
        ):
            hello = events.receive_json()
            assert hello["type"] == "hello" and hello["round"] == 3
            ws.send_json({"text": "see you at the "})
            first = ws.receive_json()
            assert first["round"] == 3

            # A newer export, written in place, of a round best on validation on NUS SMS.
            row = {"val_ppl": 120.0, "test_ppl": 125.0, "data": "nus-sms", "best_round": 4}
            save_round(models, 4, watch_dir, metrics=row)

            def round_4():
                ws.send_json({"text": "see you at the "})
                reply = ws.receive_json()
                return reply if reply["round"] == 4 else None

            reply = wait_for(round_4, timeout=15, what="the new export was not picked up")
            assert reply["round"] == 4, "the new export was not picked up"
            # Same weights here, so the same words: the state cache was rebuilt consistently.
            assert reply["suggestions"] == first["suggestions"]
            event = events.receive_json()
            assert event["type"] == "model_loaded" and event["round"] == 4
            assert event["val_ppl"] == 120.0
            assert (event["data"], event["best_round"]) == ("nus-sms", 4)
        info = client.get("/api/info").json()
        assert info["round"] == 4 and info["strategy"] == "fedatt" and info["reloads"] == 1
        assert (info["data"], info["best_round"]) == ("nus-sms", 4)  # the panel's served note
        assert client.get("/model.json").json()["round"] == 4
        rounds = [r["round"] for r in client.get("/api/metrics").json()["rounds"]]
        assert rounds == [3, 4]


def test_a_broken_export_keeps_the_served_model(models, watch_dir):
    app = create_app(None, watch_dir=watch_dir, poll_seconds=0.05)
    with TestClient(app) as client:
        (watch_dir / "model.json").write_text('{"format": "fedkey-onnx-1", "round": 9}')
        wait_for(
            lambda: client.get("/api/info").json()["reload_error"] is not None,
            timeout=10,
            what="the broken export was not noticed",
        )
        with client.websocket_connect("/ws/suggest") as ws:
            ws.send_json({"text": "see you "})
            reply = ws.receive_json()
            assert reply["round"] == 3 and len(reply["suggestions"]) == 3


def test_sentencepiece_model_answers_with_a_clear_error(models):
    with TestClient(create_app(models.sentencepiece)) as client:
        info = client.get("/api/info").json()
        assert info["suggestions"] is False and "sentencepiece" in info["error"]
        assert info["browser_mode"]["available"] is False
        with client.websocket_connect("/ws/suggest") as ws:
            ws.send_json({"text": "see you "})
            reply = ws.receive_json()
            assert "sentencepiece tokenizer" in reply["error"] and reply["round"] == 1


TOKEN = "operator-token-0123456789"


def fake_federation_server(asked: list[str]) -> FastAPI:
    """What the keyboard uses of `fedkey server` started with an operator token: GET /v1/metrics
    and WS /v1/events, whose rows and events also hold what the page must not see (phone names,
    their weights, per-upload events). `asked` records each GET /v1/metrics."""
    app = FastAPI()
    rows = [
        {"round": r, "strategy": "fedavg", "val_ppl": v, "test_ppl": v + 5, "epsilon": None,
         "aggregated": ["alice-pixel"], "info": {"weights": {"alice-pixel": 1.0}}}
        for r, v in ((1, 400.0), (2, 300.0))
    ]  # fmt: skip

    @app.get("/v1/metrics")
    async def metrics(authorization: str | None = Header(None)):
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(401, "not the operator token")
        asked.append("metrics")
        return {"rounds": rows}

    @app.websocket("/v1/events")
    async def events(ws: WebSocket):
        if ws.headers.get("authorization") != f"Bearer {TOKEN}":
            await ws.close(code=1008)
            return
        await ws.accept()
        n = 3
        try:
            while True:  # events every 50 ms, so a late subscriber still sees some
                await ws.send_json({"type": "update_received", "device_id": "alice-pixel"})
                event = {"type": "round_aggregated", "round": n, "val_ppl": 250.0,
                         "test_ppl": 260.0, "aggregated": ["alice-pixel"]}  # fmt: skip
                await ws.send_json(event)
                n += 1
                await asyncio.sleep(0.05)
        except (WebSocketDisconnect, RuntimeError):
            return

    return app


def test_events_and_metrics_are_relayed_from_the_federation_server(models):
    """With the server's operator token the keyboard follows it, and passes on to the page what
    its panel shows and nothing else (fedkey.keyboard_web.upstream); a burst of page requests costs the
    federation server one GET /v1/metrics."""
    asked: list[str] = []
    with ThreadServer(fake_federation_server(asked)) as upstream:
        app = create_app(models.word, events_url=upstream.url + "/", events_token=TOKEN)
        with TestClient(app) as client:
            for _ in range(20):
                metrics = client.get("/api/metrics").json()
            assert metrics["source"] == "federation" and len(asked) == 1
            assert metrics["rounds"] == [
                {"round": 1, "strategy": "fedavg", "val_ppl": 400.0, "test_ppl": 405.0,
                 "epsilon": None},
                {"round": 2, "strategy": "fedavg", "val_ppl": 300.0, "test_ppl": 305.0,
                 "epsilon": None},
            ]  # fmt: skip
            with client.websocket_connect("/ws/events") as events:
                assert events.receive_json()["type"] == "hello"
                seen = [events.receive_json() for _ in range(3)]
            assert {e["type"] for e in seen} == {"round_aggregated"}
            assert seen[0]["val_ppl"] == 250.0 and "alice-pixel" not in json.dumps(seen)
            assert client.get("/api/info").json()["events"]["connected"] is True
        without = create_app(models.word, events_url=upstream.url)
        with TestClient(without) as client:
            refused = client.get("/api/metrics")
            assert refused.status_code == 502 and "401" in refused.json()["detail"]


def test_unreachable_federation_server_is_a_clear_502(models):
    url = f"http://127.0.0.1:{free_port()}"
    with TestClient(create_app(models.word, events_url=url)) as client:
        r = client.get("/api/metrics")
        assert r.status_code == 502 and url in r.json()["detail"]
        with client.websocket_connect("/ws/suggest") as ws:  # suggestions do not depend on it
            ws.send_json({"text": "see you "})
            assert len(ws.receive_json()["suggestions"]) == 3


def test_without_node_modules_browser_mode_is_unavailable(models, monkeypatch, tmp_path):
    import fedkey.keyboard_web.app as kw

    monkeypatch.setattr(kw, "ORT_DIST", tmp_path / "absent")
    with TestClient(kw.create_app(models.word)) as client:
        mode = client.get("/api/info").json()["browser_mode"]
        assert mode["available"] is False and "npm ci --prefix keyboard_web" in mode["reason"]
        r = client.get("/vendor/ort.wasm.min.js")
        assert r.status_code == 404 and "npm ci" in r.json()["detail"]
