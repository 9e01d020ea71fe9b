"""`removal.remove_each`: shutdown removes sandboxes several at once, bounded, and one
refused removal does not leave the others behind."""

from __future__ import annotations

import trio
import trio.lowlevel

from substrate.errors import RuntimeUnavailable
from substrate.sandbox import removal


async def test_removals_overlap_up_to_the_bound() -> None:
    in_flight = 0
    most = 0
    removed: list[int] = []

    async def remove(item: int) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await trio.sleep(0.01)
        in_flight -= 1
        removed.append(item)

    await removal.remove_each(range(40), remove, "a sandbox")
    assert sorted(removed) == list(range(40))
    assert most == removal.REMOVALS_AT_ONCE


async def test_a_refused_removal_leaves_the_others_to_go() -> None:
    removed: list[int] = []

    async def remove(item: int) -> None:
        await trio.lowlevel.checkpoint()
        if item == 3:
            raise RuntimeUnavailable("the engine refused")
        removed.append(item)

    await removal.remove_each(range(8), remove, "a sandbox")
    assert sorted(removed) == [0, 1, 2, 4, 5, 6, 7]
