"""Removing many sandboxes at once (shutdown): a bounded number of removals in flight.

One after the other, a hundred sandboxes took over a minute to remove here (each an
engine removal of a few hundred milliseconds, its layer's unmounts, a journal entry),
longer than a service manager waits; the engine takes removals in parallel.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import trio

from substrate.errors import Refusal

log = logging.getLogger("substrate.sandbox.removal")

T = TypeVar("T")

#: Removals in flight at once (each holds an engine thread of the engine's limiter).
REMOVALS_AT_ONCE = 16


async def remove_each(
    items: Iterable[T], remove: Callable[[T], Awaitable[None]], what: str
) -> None:
    """`remove(item)` for every item, `REMOVALS_AT_ONCE` at a time; returns when all
    ended. A removal the engine refuses is logged and the others go on (a refusal of
    one does not leave the rest behind)."""
    limiter = trio.CapacityLimiter(REMOVALS_AT_ONCE)

    async def one(item: T) -> None:
        async with limiter:
            try:
                await remove(item)
            except Refusal as exc:
                log.warning("removing %s: %s", what, exc.message)

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, item)
