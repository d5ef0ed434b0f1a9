"""The federation server the keyboard follows: its address and credential, what of its rounds and
events the page may see, and its GET /v1/metrics, asked at most once per METRICS_TTL however many
pages ask the keyboard.

The page is public; the federation server's own view is not meant for it (without DP its rows
name phones and hold their weights). So the keyboard passes on an allow-list (PANEL_ROW,
PANEL_EVENTS): what its panel draws, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

#: Seconds an answer of the federation server's GET /v1/metrics is served again.
METRICS_TTL = 2.0
#: The fields of a round the page's panel shows (the bar's top-1 and the mixture's scores: its line
#: comparing the served round with round 0).
PANEL_ROW = (
    "round",
    "strategy",
    "val_ppl",
    "test_ppl",
    "top1",
    "bar_top1",
    "mix_val_ppl",
    "mix_test_ppl",
    "mix_bar_top1",
    "epsilon",
)
#: The federation server's events the page is told of, each with these fields (and its type and
#: time).
PANEL_EVENTS: dict[str, tuple[str, ...]] = {
    "round_opened": ("round",),
    "round_aggregated": ("round", "val_ppl", "test_ppl", "epsilon"),
    "round_failed": ("round",),
    "run_finished": ("round",),
}


def panel_row(row: Any) -> dict[str, Any] | None:
    """The PANEL_ROW fields of a metrics row (None for what is not a row)."""
    if not isinstance(row, dict) or not isinstance(row.get("round"), int):
        return None
    return {k: row[k] for k in PANEL_ROW if k in row}


def panel_event(text: str | bytes) -> str | None:
    """An upstream event as the page may see it (JSON text), or None when it is not for the
    page (another type, or not an event at all)."""
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") not in PANEL_EVENTS:
        return None
    keep = ("type", "time", *PANEL_EVENTS[event["type"]])
    return json.dumps({k: event[k] for k in keep if k in event})


class FederationUnreachable(Exception):
    """The federation server's GET /v1/metrics did not answer (or not with JSON)."""


@dataclass
class Upstream:
    """The federation server whose events are relayed (`url`: its base URL, None for none;
    `token`: the operator token it asks observers for, FEDKEY_OPERATOR_TOKEN)."""

    url: str | None
    token: str | None = field(default=None, repr=False)
    connected: bool = False
    error: str | None = None
    _rows: tuple[float, list[dict]] | None = field(default=None, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def headers(self) -> dict[str, str]:
        """What each request upstream carries: the operator token, when there is one."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def rounds(self) -> list[dict]:
        """The federation's rounds as the page may see them (panel_row), asked upstream at most
        once per METRICS_TTL (FederationUnreachable if it does not answer)."""
        async with self._lock:  # one request upstream at a time; the others take its answer
            cached = self._rows
            if cached is not None and time.monotonic() - cached[0] < METRICS_TTL:
                return cached[1]
            body = await self._get_metrics()
            rounds = body.get("rounds") if isinstance(body, dict) else None
            rows = [r for r in map(panel_row, rounds or []) if r is not None]
            self._rows = (time.monotonic(), rows)
            return rows

    async def _get_metrics(self) -> Any:
        import httpx

        if self.url is None:
            raise FederationUnreachable("no federation server to ask")
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                r = await client.get(self.url + "/v1/metrics", headers=self.headers())
                r.raise_for_status()
                return r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise FederationUnreachable(
                f"the federation server at {self.url} did not answer: {e}"
            ) from e
