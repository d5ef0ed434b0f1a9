"""New requests enter the app at most `admit_per_tick` an event-loop iteration: a burst
of hundreds arriving together ran their first steps in one iteration of 0.1-0.3 s, and a
/healthz that came with them waited for its end."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fedkey.server.app import create_app
from fedkey.server.runtime.admission import EXEMPT, Admission
from fedkey.testing.http import make_settings


class Recorder:
    """An ASGI app that notes, per request, the loop iteration in which it entered."""

    def __init__(self) -> None:
        self.iteration = 0
        self.entered: list[tuple[str, int]] = []

    def count_iterations(self) -> None:
        # rescheduled with call_soon, it runs exactly once an iteration
        self.iteration += 1
        asyncio.get_running_loop().call_soon(self.count_iterations)

    async def __call__(self, scope, receive, send) -> None:
        self.entered.append((scope["path"], self.iteration))


def scope(path: str) -> dict:
    return {"type": "http", "path": path}


def per_iteration(entered: list[tuple[str, int]]) -> list[int]:
    counts: dict[int, int] = {}
    for _, it in entered:
        counts[it] = counts.get(it, 0) + 1
    return [counts[k] for k in sorted(counts)]


def test_a_burst_enters_a_budget_per_iteration_in_arrival_order_and_health_skips_the_queue():
    app = Recorder()
    admission = Admission(app, per_tick=8)
    n = 5 * 8 + 3

    async def scenario() -> None:
        app.count_iterations()
        # every request of the burst arrives in the same iteration (as from one socket poll)
        burst = [asyncio.create_task(admission(scope(f"/r{i}"), None, None)) for i in range(n)]
        await asyncio.sleep(0)  # their first steps run: 8 enter, the rest queue
        assert admission.waiting == n - 8
        await admission(scope("/healthz"), None, None)  # a probe mid-burst: no wait
        async with asyncio.timeout(5):
            await asyncio.gather(*burst)

    asyncio.run(scenario())
    requests = [(p, it) for p, it in app.entered if p not in EXEMPT]
    assert [p for p, _ in requests] == [f"/r{i}" for i in range(n)]  # all, first come first in
    counts = per_iteration(requests)
    assert max(counts) <= 8 and counts[0] == 8
    assert len(counts) == -(-n // 8)  # one budget an iteration, no iteration lost
    health = [it for p, it in app.entered if p == "/healthz"]
    assert health == [requests[0][1]]  # it entered in the burst's first iteration
    assert admission.waiting == 0


def test_a_waiting_request_that_is_cancelled_takes_no_place_and_holds_nobody_up():
    app = Recorder()
    admission = Admission(app, per_tick=1)

    async def scenario() -> None:
        app.count_iterations()
        tasks = [asyncio.create_task(admission(scope(f"/r{i}"), None, None)) for i in range(4)]
        await asyncio.sleep(0)
        tasks[1].cancel()  # the server stopping, say, while it waited
        async with asyncio.timeout(5):
            results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[1], asyncio.CancelledError)

    asyncio.run(scenario())
    assert [p for p, _ in app.entered] == ["/r0", "/r2", "/r3"]
    assert per_iteration(app.entered) == [1, 1, 1]


def test_the_budget_carries_nothing_from_one_event_loop_to_the_next():
    app = Recorder()
    admission = Admission(app, per_tick=1)

    async def burst() -> None:
        tasks = [asyncio.create_task(admission(scope(f"/r{i}"), None, None)) for i in range(3)]
        async with asyncio.timeout(5):
            await asyncio.gather(*tasks)

    asyncio.run(burst())
    asyncio.run(burst())  # a loop closed with its budget spent would leave this one waiting
    assert len(app.entered) == 6


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="1 or more"):
        Admission(Recorder(), per_tick=0)


def test_the_app_under_a_budget_of_one_answers_a_burst_of_requests_whole(tmp_path):
    """Through FastAPI: 30 requests at once, each answered as without admission."""
    app = create_app(make_settings(tmp_path, admit_per_tick=1))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            calls = [client.get("/v1/rounds/current") for _ in range(20)]
            calls += [client.get("/healthz") for _ in range(10)]
            async with asyncio.timeout(30):
                return await asyncio.gather(*calls)

    answers = asyncio.run(scenario())
    assert [a.status_code for a in answers[:20]] == [401] * 20  # no token: each its own 401
    assert all(a.json()["detail"] for a in answers[:20])
    assert [a.status_code for a in answers[20:]] == [200] * 10
