"""Waiting on a condition with a deadline: the one polling loop of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    every: float = 0.05,
    what: str = "condition not met in time",
) -> T:
    """Call `predicate` every `every` seconds until it returns something truthy, and return that;
    AssertionError(`what`) once `timeout` seconds have passed without it."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what} (waited {timeout:g} s)")
        time.sleep(every)
