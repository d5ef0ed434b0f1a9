"""Waiting on a condition with a deadline, for the tests: fedkey.runners.processes.wait_for (the one
polling loop), failing the test when time runs out."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fedkey.runners.processes import wait_for as poll

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    every: float = 0.05,
    what: str = "condition not met in time",
) -> T:
    """Call `predicate` every `every` seconds until it returns something truthy, and return that;
    AssertionError(`what`) once `timeout` seconds have passed without it."""
    value = poll(predicate, timeout, interval=every)
    if not value:
        raise AssertionError(f"{what} (waited {timeout:g} s)")
    return value
