"""One worker-thread hop for blocking work that must run to its end (a commit, a write).

`run_to_end(fn, limiter)` runs `fn` in a thread of trio's thread cache and returns its
result on the event loop, as `trio.to_thread.run_sync(fn, limiter=limiter)` does with
its defaults (never abandoned: a cancellation waits for `fn` to finish, and `fn`'s
exception is raised in the task), but with one hop each way and nothing more: no extra
scheduling round before the thread starts, no copy of the task's context, no renaming of
the worker thread per call (a `prctl` each way). On the warm path of a command or a
guarded write those are a third of a hop's cost. `fn` must not call back into trio
(`trio.from_thread`): nothing here supports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import trio
import trio.lowlevel

if TYPE_CHECKING:
    from outcome import Outcome

T = TypeVar("T")


async def run_to_end(fn: Callable[[], T], limiter: trio.CapacityLimiter | None = None) -> T:
    """`fn()` in a worker thread, holding a token of `limiter` (default: trio's default
    thread limiter) while it runs; never abandoned (see the module doc)."""
    if limiter is None:
        limiter = trio.to_thread.current_default_thread_limiter()
    borrower = object()
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)
    try:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: Outcome[T]) -> None:
            # In the worker thread: back to the task on the event loop.
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        trio.lowlevel.start_thread_soon(fn, deliver)
        value: T = await trio.lowlevel.wait_task_rescheduled(
            lambda _: trio.lowlevel.Abort.FAILED  # started: it runs to its end
        )
        return value
    finally:
        limiter.release_on_behalf_of(borrower)
