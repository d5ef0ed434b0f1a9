"""A phone's decisions on its view of the round (GET /v1/rounds/current), as pure functions.

Every phone of the project decides the same way: the thread fleet's and the Ray fleet's phones
(fedkey.device_sim.fleets.phone) and `fedkey-bench load`'s fake phones (fedkey_bench.load_phones). Standard library
only, so the load bench's driver processes import no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

#: How many times a phone acts on one (round, attempt): a server that restarted may have lost an
#: upload, and its view then asks for it again.
MAX_TRIES = 3
#: How many times a phone enrolls again after a 401 (a server that lost its devices).
MAX_REENROLL = 3
#: Seconds a phone long-polls GET /v1/rounds/current: under the server's most (60 s) and a proxy's
#: usual 60 s read timeout. A phone left out of a round is answered only at its timeout, so this
#: sets the idle fleet's traffic: at 30 s, 10,000 phones' timeouts were about 30,000 of the 37,000
#: requests of a 90 s round (fedkey-bench load); at 55 s the 3 rounds took 67,000, not 96,000+.
POLL_WAIT = 55.0

__all__ = ["MAX_REENROLL", "MAX_TRIES", "POLL_WAIT", "actionable", "round_key", "transient_status"]


def round_key(view: Mapping[str, Any]) -> tuple[int, int]:
    """The (round, attempt) a view is about: a round opened again is another attempt."""
    return int(view["round"]), int(view.get("attempt") or 0)


def actionable(
    view: Mapping[str, Any],
    key: tuple[int, int],
    handled: Collection[tuple[int, int]],
    tries: Mapping[tuple[int, int], int],
) -> bool:
    """Whether the phone should act on `view` now: the round is open, it is selected with a task,
    has not uploaded and was not told no (topK), is not done with this (round, attempt) and has
    tried it fewer than MAX_TRIES times."""
    return (
        view.get("state") == "open"
        and bool(view.get("selected"))
        and view.get("task") is not None
        and not view.get("uploaded")
        and view.get("upload") is not False
        and key not in handled
        and tries.get(key, 0) < MAX_TRIES
    )


def transient_status(status: int) -> bool:
    """A status worth retrying: the server is busy (429) or failing / restarting (5xx), or the
    request's body stalled on the way (408: the server asks for it again)."""
    return status >= 500 or status in (408, 429)
