"""The WebSockets (not in OpenAPI, which has none): /ws/suggest (keyboard_web.protocol) and
/ws/events (a `hello`, then the events of keyboard_web.service.EventHub)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from keyboard_web.deps import KeyboardDep
from keyboard_web.protocol import Conversation

router = APIRouter()


@router.websocket("/ws/suggest")
async def ws_suggest(ws: WebSocket, keyboard: KeyboardDep):
    await ws.accept()
    conversation = Conversation(keyboard.holder)
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            await ws.send_json(conversation.reply(msg.get("text")))
    except (WebSocketDisconnect, RuntimeError):
        return


@router.websocket("/ws/events")
async def ws_events(ws: WebSocket, keyboard: KeyboardDep):
    queue = keyboard.hub.subscribe()
    try:
        await ws.accept()
        await ws.send_text(json.dumps(keyboard.hello()))
        await _forward(ws, queue)
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        keyboard.hub.unsubscribe(queue)


async def _forward(ws: WebSocket, queue: asyncio.Queue) -> None:
    """Send the queue's events until the client closes the connection."""
    closed = asyncio.create_task(_until_closed(ws))
    try:
        while True:
            get = asyncio.create_task(queue.get())
            done, _ = await asyncio.wait({get, closed}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return
            await ws.send_text(get.result())
    finally:
        closed.cancel()


async def _until_closed(ws: WebSocket) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        while True:
            if (await ws.receive())["type"] == "websocket.disconnect":
                return
