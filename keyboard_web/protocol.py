"""The /ws/suggest protocol, without the WebSocket: a frame in, the reply out.

The client sends {"text": "..."} (optional "id", echoed back) and receives
{"suggestions": [3 words], "round": n}; a bad frame gets {"error": "..."} and the connection
stays open.
"""

from __future__ import annotations

import json
import logging

from fedkey.keyboard_web.service import ModelHolder
from fedkey.keyboard_web.suggest import Session, SuggestError

log = logging.getLogger("fedkey.keyboard")

MAX_TEXT = 10_000  # characters in one {"text": ...}
MAX_FRAME = 64 * 1024  # bytes (or characters) of one WebSocket frame


def parse_request(raw: str) -> tuple[dict, str | None]:
    """A {"text": str} request, or the reason it is not one."""
    if len(raw) > MAX_FRAME:
        return {}, f"message too long ({len(raw)} characters; at most {MAX_FRAME})"
    try:
        request = json.loads(raw)
    except json.JSONDecodeError as e:
        return {}, f'not JSON ({e.msg} at position {e.pos}): send {{"text": "..."}}'
    if not isinstance(request, dict) or "text" not in request:
        return {}, 'expected a JSON object {"text": "..."}'
    text = request["text"]
    if not isinstance(text, str):
        return {}, f'"text" must be a string, got {type(text).__name__}'
    if len(text) > MAX_TEXT:
        return {}, f'"text" too long ({len(text)} characters; at most {MAX_TEXT})'
    return request, None


class Conversation:
    """One /ws/suggest connection: its Session (the state cache) on the served model, started
    over when a hot reload swapped the model (the weights changed)."""

    def __init__(self, holder: ModelHolder):
        self.holder = holder
        self.session: Session | None = None

    def reply(self, raw: str | None) -> dict:
        """The reply to one frame: `raw` is its text, None for a binary frame."""
        if raw is None:
            return {"error": 'send JSON text frames: {"text": "..."}'}
        request, error = parse_request(raw)
        if error is not None:
            return {"error": error}
        reply = self._suggest(request["text"])
        if "id" in request:
            reply["id"] = request["id"]
        return reply

    def _suggest(self, text: str) -> dict:
        current = self.holder.current
        if self.session is None or self.session.suggester is not current:
            self.session = current.new_session()  # new weights: the state cache starts over
        try:
            return self.session.suggest(text)
        except SuggestError as e:
            return {"error": str(e), "round": current.round}
        except Exception as e:  # pragma: no cover - a bug; the connection survives it
            log.exception("suggestion failed")
            self.session = None
            return {"error": f"internal error: {type(e).__name__}"}
