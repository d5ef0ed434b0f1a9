"""The event stream: WebSocket /v1/events (JSON events; not in OpenAPI, which has no WebSockets)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from fedkey.federation.updates.validation import ValidationError
from fedkey.server.api.deps import CoordinatorDep

router = APIRouter(tags=["events"])


@router.websocket("/v1/events")
async def events(ws: WebSocket, coordinator: CoordinatorDep):
    """The events as published (under DP an allow-list, fedkey.federation.metrics_row.DP_EVENTS); with
    FEDKEY_OPERATOR_TOKEN set, only for `Authorization: Bearer <it>` (a 401 answer before the
    handshake otherwise)."""
    try:
        coordinator.check_observer(ws.headers.get("authorization"), "WS /v1/events")
    except ValidationError as e:
        await refuse(ws, e)
        return
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
                # The rest of a burst goes out without a task and a loop iteration each: with
                # them, the stream of a 10,000-phone run lagged 21 s (p50; p99 24 s), without,
                # 0.2 s (p99 1.2 s) (fedkey-bench load, phones at nice +10).
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


async def refuse(ws: WebSocket, e: ValidationError) -> None:
    """Refuse a handshake with `e`'s status and message ({"detail": ...}), where the server
    speaks the WebSocket denial response extension (uvicorn does); else close it (1008)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        answer = JSONResponse({"detail": e.message}, status_code=e.status, headers=e.headers)
        await ws.send_denial_response(answer)
    else:
        await ws.close(code=1008, reason=e.message[:120])
