"""A transition wakes every long-poll, but a batch per event-loop iteration: woken
all at once, 10,000 long-polls' answers ran in one iteration and /healthz waited seconds."""

from __future__ import annotations

import asyncio

from fedkey.server.device_views import WAKE_BATCH, LongPolls


def test_a_transition_wakes_every_long_poll_a_batch_per_loop_iteration():
    polls = LongPolls(asyncio.Event())
    n = 5 * WAKE_BATCH + 3

    async def scenario() -> list[int]:
        events = [asyncio.Event() for _ in range(n)]
        polls.waiters = {f"d{i}": e for i, e in enumerate(events)}
        polls.notify()
        assert polls.waiters == {}  # later waits start afresh
        seen = []
        for _ in range(20):  # bounded: one loop iteration each
            seen.append(sum(e.is_set() for e in events))
            if seen[-1] == n:
                break
            await asyncio.sleep(0)
        return seen

    seen = asyncio.run(scenario())
    assert seen[0] == WAKE_BATCH  # at once: one batch
    assert seen[-1] == n  # and in the end every one
    assert all(b - a <= WAKE_BATCH for a, b in zip(seen, seen[1:], strict=False))
    assert len(seen) == -(-n // WAKE_BATCH)  # the rest a batch per iteration


def test_a_transition_of_a_cohort_wakes_only_the_cohorts_long_polls():
    polls = LongPolls(asyncio.Event())

    async def scenario() -> tuple[list[bool], list[str]]:
        events = {f"d{i}": asyncio.Event() for i in range(4)}
        polls.waiters = dict(events)
        polls.notify(["d1", "d3", "gone"])  # "gone": no long-poll in flight
        await asyncio.sleep(0)
        return [e.is_set() for e in events.values()], sorted(polls.waiters)

    woken, waiting = asyncio.run(scenario())
    assert woken == [False, True, False, True]
    assert waiting == ["d0", "d2"]  # still waiting on their events
