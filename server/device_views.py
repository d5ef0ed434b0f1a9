"""What a device sees of the round: its view and its task (`RoundViews`), and the long-polls
that wait for them to change (`LongPolls`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterable, Mapping

from fedkey.common.task import RoundTask
from fedkey.federation.engine import Federation, client_seed
from fedkey.server.round_state import ApiError, OpenRound, RoundNow, RoundState
from fedkey.server.settings import MAX_WAIT

#: Long-polls woken in one event-loop iteration at a transition (the rest in the next ones).
WAKE_BATCH = 32


class LongPolls:
    """The long-polls in flight, one event per device: a request waits on its device's until a
    predicate holds; a change of the round wakes the devices it concerns (:meth:`notify`)."""

    def __init__(self, stopped: asyncio.Event, per_device: int = 4):
        self.stopped = stopped  # set when the server stops: every wait ends
        self.waiters: dict[str, asyncio.Event] = {}  # device id -> what its long-polls wait on
        self.per_device = per_device  # long-polls one device may have waiting (429 past it)
        self._waiting: collections.Counter[str] = collections.Counter()

    async def wait_until(self, device_id: str, predicate: Callable[[], bool], wait: float) -> bool:
        """Wait (at most `wait` s) until `predicate()` holds, re-checking it whenever the round
        changes for this device (:meth:`notify`); 429 when the device has `per_device` waiting
        already (one token cannot hold connections without end)."""
        if not self.can_wait(device_id):
            raise ApiError(
                429,
                f"device {device_id!r} has {self.per_device} long-polls waiting already "
                "(FEDKEY_POLLS_PER_DEVICE): wait for their answers",
                "busy",
                headers={"Retry-After": "1"},
            )
        self._waiting[device_id] += 1
        try:
            return await self._wait_until(device_id, predicate, wait)
        finally:
            self._waiting[device_id] -= 1
            if not self._waiting[device_id]:
                del self._waiting[device_id]

    def can_wait(self, device_id: str) -> bool:
        """Whether `device_id` may have another long-poll waiting."""
        return self._waiting[device_id] < self.per_device

    async def _wait_until(self, device_id: str, predicate: Callable[[], bool], wait: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, min(float(wait), MAX_WAIT))
        while not predicate():
            remaining = end - loop.time()
            if remaining <= 0 or self.stopped.is_set():
                return False
            changed = self.waiters.get(device_id)
            if changed is None:
                changed = self.waiters[device_id] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
        return True

    def notify(self, devices: Iterable[str] | None = None) -> None:
        """The round changed for `devices` (a transition: its cohort; one device: its loss report
        or its upload; None: every device, as when the run finishes or the server stops): wake
        their long-polls, ``WAKE_BATCH`` a loop iteration. Woken all at once, their thousands of
        answers ran in one iteration while every other request (a /healthz) waited for its
        end."""
        if devices is None:
            woken, self.waiters = list(self.waiters.values()), {}
        else:
            woken = [e for d in devices if (e := self.waiters.pop(d, None)) is not None]
        _wake(woken, 0)


class RoundViews:
    """GET /v1/rounds/current: a device's view of the round (its task when selected), answered
    at once or when it changes; and whether every device has been told the run is finished."""

    def __init__(
        self,
        fed: Federation,
        rounds: RoundNow,
        devices: Mapping[str, int],
        polls: LongPolls,
        topk: bool,
    ):
        self._fed = fed
        self._rounds = rounds
        self._devices = devices  # the enrolled devices (fedkey.server.devices.DeviceRegistry's)
        self._polls = polls
        self._topk = topk
        self._given: dict[str, dict] = {}  # device id -> the view it was last answered

    def task(self, r: OpenRound, device_id: str) -> dict:
        p = self._fed.config.privacy
        return RoundTask(
            train=r.plan.train,
            seed=client_seed(self._fed.config.seed, r.number, device_id),
            beta=p.beta,
            sigma=p.sigma,
            deadline=r.deadline,
            model_round=r.number - 1,
        ).to_json()

    def view(self, device_id: str) -> dict:
        """GET /v1/rounds/current for `device_id`."""
        r, state = self._rounds.current, self._rounds.state
        if r is None:
            done = self._fed.round
            return {
                "round": done if state == RoundState.FINISHED else done + 1,
                "attempt": 0 if state == RoundState.FINISHED else self._rounds.next_attempt,
                "state": state,
                "selected": False,
                "task": None,
                "loss_reported": False,
                "uploaded": False,
                "upload": False,
            }
        selected = device_id in r.selected
        return {
            "round": r.number,
            "attempt": r.attempt,
            "state": state,
            "selected": selected,
            "task": self.task(r, device_id) if selected else None,
            "loss_reported": device_id in r.losses,
            "uploaded": device_id in r.uploads,
            "upload": r.upload_flag(device_id, self._topk),
        }

    async def wait_view(self, device_id: str, wait: float) -> dict:
        """Long-poll: at once when the view differs in what concerns the device (:func:`concern`)
        from the one it was last given (so no transition is missed between two polls), else at
        the first such change within `wait`, else the current view at the end of `wait`."""
        view = self.view(device_id)
        given = concern(view)
        if wait > 0 and given == concern(self._given.get(device_id)):
            await self._polls.wait_until(
                device_id, lambda: concern(self.view(device_id)) != given, wait
            )
            view = self.view(device_id)
        self._given[device_id] = view
        return view

    def everyone_told_finished(self) -> bool:
        """The run is finished and every enrolled device has been answered so."""
        return self._rounds.state == RoundState.FINISHED and all(
            self._given.get(d, {}).get("state") == RoundState.FINISHED for d in self._devices
        )


def concern(view: dict | None) -> object:
    """What of a view its device's long-poll waits to change. A device with nothing to do (not
    selected, the run not finished) is concerned only by getting something to do: the rounds it
    is not in pass without waking it (at 10,000 phones every transition answered every long-poll,
    30,000 answers a round where 3,000 concern the cohort). Any other view concerns it whole."""
    if view is None:
        return None
    if view["selected"] or view["state"] == RoundState.FINISHED:
        return view
    return "nothing to do"


def _wake(events: list[asyncio.Event], start: int) -> None:
    """Set ``events[start:start + WAKE_BATCH]``, and the rest in later loop iterations (asyncio
    runs what `call_soon` adds during an iteration in the next one, after polling the sockets)."""
    for changed in events[start : start + WAKE_BATCH]:
        changed.set()
    if start + WAKE_BATCH < len(events):
        asyncio.get_running_loop().call_soon(_wake, events, start + WAKE_BATCH)
