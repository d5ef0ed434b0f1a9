"""The event stream: WebSocket /v1/events (JSON events; not in OpenAPI, which has no WebSockets)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from server.api.deps import CoordinatorDep

router = APIRouter(tags=["events"])


@router.websocket("/v1/events")
async def events(ws: WebSocket, coordinator: CoordinatorDep):
    sub = coordinator.events.subscribe()  # before accept: no event is missed after it
    try:
        await ws.accept()

        async def until_closed():
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                while True:
                    msg = await ws.receive()
                    if msg["type"] == "websocket.disconnect":
                        return

        closed = asyncio.create_task(until_closed())
        try:
            while True:
                get = asyncio.create_task(sub.get())
                done, _ = await asyncio.wait({get, closed}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return
                # The rest of a burst is sent without a wake-up each: the stream followed a
                # 10,000-phone enrollment 20 s late, one loop iteration per event.
                for event in [get.result(), *sub.drain()]:
                    if event is None:
                        with contextlib.suppress(Exception):
                            await ws.close(code=1001)
                        return
                    await ws.send_json(event)
        finally:
            closed.cancel()
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        sub.close()
