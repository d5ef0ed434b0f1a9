"""The keyboard's background tasks, run by the app's lifespan: the hot reload of newer exports
(with a watch directory) and the relay of the federation server's events (with its URL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from fedkey.keyboard_web.service import Keyboard, model_event
from fedkey.keyboard_web.upstream import panel_event

log = logging.getLogger("fedkey.keyboard")


def ws_url(base: str) -> str:
    """The WebSocket URL of an http(s) base URL."""
    base = base.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://") :]
    if base.startswith("http://"):
        return "ws://" + base[len("http://") :]
    return base


async def watch_exports(keyboard: Keyboard) -> None:
    """Poll the watch directory; swap in a newer export and announce it (`model_loaded`)."""
    holder = keyboard.holder
    while True:
        await asyncio.sleep(keyboard.poll_seconds)
        try:
            if not holder.changed():
                continue
            new = await asyncio.to_thread(holder.load_watched)
        except Exception as e:  # a broken export: keep serving the current model
            holder.last_error = f"{type(e).__name__}: {e}"
            log.warning("hot reload from %s failed: %s", keyboard.watch_dir, holder.last_error)
            continue
        old = holder.current.round
        holder.swap(new)
        holder.last_error = None
        log.info("hot reload: round %s -> %s", old, new.round)
        keyboard.hub.publish_event("model_loaded", **model_event(new))


async def relay_events(keyboard: Keyboard, base: str) -> None:
    """Relay the federation server's WS /v1/events to the pages (what fedkey.keyboard_web.upstream's
    PANEL_EVENTS allows of them), reconnecting with backoff."""
    from websockets.asyncio.client import connect

    upstream, hub = keyboard.upstream, keyboard.hub
    url = ws_url(base) + "/v1/events"
    backoff = 0.5
    while True:
        try:
            headers = upstream.headers()
            async with connect(
                url, open_timeout=5, max_size=2**20, additional_headers=headers
            ) as ws:
                upstream.connected, upstream.error = True, None
                hub.publish_event("upstream", connected=True, url=base)
                backoff = 0.5
                async for msg in ws:
                    shown = panel_event(msg)  # the page's allow-list (fedkey.keyboard_web.upstream)
                    if shown is not None:
                        hub.publish(shown)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # refused, closed, timed out: try again later
            upstream.error = f"{type(e).__name__}: {e}"
        if upstream.connected:
            hub.publish_event("upstream", connected=False, url=base)
        upstream.connected = False
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 10.0)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Run the background tasks of `app.state.keyboard` while the app serves."""
    keyboard: Keyboard = app.state.keyboard
    tasks = []
    if keyboard.watch_dir is not None:
        tasks.append(asyncio.create_task(watch_exports(keyboard)))
    if keyboard.upstream.url:
        tasks.append(asyncio.create_task(relay_events(keyboard, keyboard.upstream.url)))
    try:
        yield
    finally:
        keyboard.inference.close()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
