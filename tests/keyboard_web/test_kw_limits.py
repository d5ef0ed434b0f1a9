"""The keyboard under attack, on loopback under uvicorn (fedkey.keyboard_web.limits): hundreds of
WebSockets, some flooding, while a typist still gets every suggestion; a connection cap past
which handshakes are refused; a frame larger than MAX_FRAME closes only its own connection."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from fedkey.keyboard_web.app import MAX_FRAME, UVICORN_LIMITS, create_app
from fedkey.keyboard_web.limits import BURST
from fedkey.testing.keyboard import ThreadServer

ATTACKERS = 500
FLOODERS = 50
PHRASE = "see you tomorrow at the station"


async def flood(ws, messages: int) -> list[dict]:
    """Send `messages` suggestion requests at once, then read their replies."""
    for i in range(messages):
        await ws.send(json.dumps({"text": f"i think we should {i} "}))
    return [json.loads(await ws.recv()) for _ in range(messages)]


async def type_phrase(url: str) -> list[dict]:
    """A typist: the phrase one character at a time, a reply to each."""
    async with connect(url + "/ws/suggest") as ws:
        replies = []
        for end in range(1, len(PHRASE) + 1):
            await ws.send(json.dumps({"text": PHRASE[:end]}))
            replies.append(json.loads(await ws.recv()))
        return replies


@pytest.mark.slow
def test_a_typist_gets_suggestions_while_500_sockets_are_open_and_50_flood(models):
    async def attack(url: str) -> tuple[list[dict], list[list[dict]]]:
        sockets = [await connect(url + "/ws/suggest") for _ in range(ATTACKERS)]
        try:
            floods = [asyncio.create_task(flood(ws, 3 * BURST)) for ws in sockets[:FLOODERS]]
            async with asyncio.timeout(120):  # a bound on the whole test, not a speed target
                typed = await type_phrase(url)
                flooded = await asyncio.gather(*floods)
            return typed, flooded
        finally:
            for ws in sockets:
                await ws.close()

    with ThreadServer(create_app(models.word), **UVICORN_LIMITS) as server:
        ws_url = server.url.replace("http://", "ws://")
        typed, flooded = asyncio.run(attack(ws_url))
    assert len(typed) == len(PHRASE)
    assert all("error" not in r and len(r["suggestions"]) <= 3 for r in typed), typed
    # After each space, three next words (a word typed in full may have no longer completion).
    assert all(len(r["suggestions"]) == 3 for r, c in zip(typed, PHRASE, strict=True) if c == " ")
    assert all(len(replies) == 3 * BURST for replies in flooded)  # answered, if refused


def test_one_connection_gets_its_rate_and_no_more(models):
    """A connection that sends far more than RATE a second is answered "too many messages"
    past its burst, without the model's work; its other replies are suggestions."""

    async def burst(url: str) -> list[dict]:
        async with connect(url + "/ws/suggest") as ws:
            return await flood(ws, 3 * BURST)

    with ThreadServer(create_app(models.word), **UVICORN_LIMITS) as server:
        replies = asyncio.run(burst(server.url.replace("http://", "ws://")))
    refused = [r for r in replies if "too many messages" in r.get("error", "")]
    answered = [r for r in replies if "suggestions" in r]
    assert refused and len(answered) >= BURST and len(refused) + len(answered) == len(replies)


def test_past_the_cap_handshakes_are_refused_and_a_huge_frame_closes_its_own_socket(models):
    app = create_app(models.word)
    app.state.keyboard.sockets.limit = 3

    async def probe(url: str) -> None:
        held = [await connect(url + "/ws/suggest") for _ in range(2)]
        async with connect(url + "/ws/events") as events:
            assert json.loads(await events.recv())["type"] == "hello"
            with pytest.raises(InvalidStatus) as refused:
                await connect(url + "/ws/suggest")
            assert refused.value.response.status_code == 503
        huge = held[0]
        await huge.send(json.dumps({"text": "x" * (2 * MAX_FRAME)}))
        with pytest.raises(ConnectionClosed):
            await huge.recv()
        await held[1].send(json.dumps({"text": "see you "}))
        assert len(json.loads(await held[1].recv())["suggestions"]) == 3
        async with connect(url + "/ws/suggest") as again:  # the closed ones freed their places
            await again.send(json.dumps({"text": "see you "}))
            assert len(json.loads(await again.recv())["suggestions"]) == 3
        await held[1].close()

    with ThreadServer(app, **UVICORN_LIMITS) as server:
        asyncio.run(probe(server.url.replace("http://", "ws://")))
