"""Polling until a condition holds: what tests use instead of a fixed sleep.

A fixed sleep is either too short on a loaded machine (the test fails at random) or too
long everywhere else. `wait_until` asks the question again every `interval` seconds and
returns as soon as the answer is yes, failing (`WaitTimeout`, an `AssertionError`, so it
reads as a test failure) only after `timeout_s` seconds, which is therefore generous.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

import trio

T = TypeVar("T")

#: Seconds between two questions; short, as the questions are cheap.
POLL_INTERVAL_S = 0.02


class WaitTimeout(AssertionError):
    """The condition did not hold within the timeout."""


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 30.0,
    *,
    interval: float = POLL_INTERVAL_S,
    message: str = "",
) -> T:
    """Call `predicate()` until it returns something truthy, and return that.

    Raises `WaitTimeout` (with `message`) once `timeout_s` seconds passed without. Blocks
    the calling thread: in a Trio test use `wait_until_async`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(message or f"condition not met within {timeout_s} s")
        time.sleep(interval)


@overload
async def wait_until_async(
    predicate: Callable[[], Awaitable[T]],
    timeout_s: float = ...,
    *,
    interval: float = ...,
    message: str = ...,
) -> T: ...


@overload
async def wait_until_async(
    predicate: Callable[[], T],
    timeout_s: float = ...,
    *,
    interval: float = ...,
    message: str = ...,
) -> T: ...


async def wait_until_async(
    predicate: Callable[[], object],
    timeout_s: float = 30.0,
    *,
    interval: float = POLL_INTERVAL_S,
    message: str = "",
) -> object:
    """`wait_until` for Trio: `predicate` may be a plain or an async function.

    The whole wait, a predicate that never returns included, is bounded by `timeout_s`.
    """
    with trio.move_on_after(timeout_s):
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await trio.sleep(interval)
    raise WaitTimeout(message or f"condition not met within {timeout_s} s")
