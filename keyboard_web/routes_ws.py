"""The WebSockets (not in OpenAPI, which has none): /ws/suggest (fedkey.keyboard_web.protocol) and
/ws/events (a `hello`, then the events of fedkey.keyboard_web.service.EventHub)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from fedkey.keyboard_web.deps import KeyboardDep
from fedkey.keyboard_web.limits import RATE, Bucket
from fedkey.keyboard_web.protocol import Conversation
from fedkey.keyboard_web.service import Keyboard

router = APIRouter()


@router.websocket("/ws/suggest")
async def ws_suggest(ws: WebSocket, keyboard: KeyboardDep):
    """Suggestions: each message answered by the model in the inference pool, at most
    fedkey.keyboard_web.limits.RATE a second (an error reply past it)."""
    async with _socket(ws, keyboard) as admitted:
        if not admitted:
            return
        conversation = Conversation(keyboard.holder)
        bucket = Bucket()
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if bucket.take():
                reply = await keyboard.inference.run(conversation.reply, msg.get("text"))
            else:
                reply = {"error": f"too many messages: at most {RATE:g} a second"}
            await ws.send_json(reply)


@router.websocket("/ws/events")
async def ws_events(ws: WebSocket, keyboard: KeyboardDep):
    async with _socket(ws, keyboard) as admitted:
        if not admitted:
            return
        queue = keyboard.hub.subscribe()
        try:
            await ws.send_text(json.dumps(keyboard.hello()))
            await _forward(ws, queue)
        finally:
            keyboard.hub.unsubscribe(queue)


@contextlib.asynccontextmanager
async def _socket(ws: WebSocket, keyboard: Keyboard) -> AsyncIterator[bool]:
    """Accept `ws` while fewer than the keyboard's socket limit are open (True), else refuse
    its handshake with a 503 (False); a client that goes away ends the connection quietly."""
    if not keyboard.sockets.enter():
        await _refuse(ws, keyboard.sockets.limit)
        yield False
        return
    try:
        await ws.accept()
        yield True
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        keyboard.sockets.leave()


async def _refuse(ws: WebSocket, limit: int) -> None:
    detail = f"the keyboard has {limit} connections open: try again later"
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        answer = JSONResponse({"detail": detail}, status_code=503, headers={"Retry-After": "5"})
        await ws.send_denial_response(answer)
    else:
        await ws.close(code=1013, reason=detail[:120])


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
