"""substrate.api.fs's write hop: a started write runs to its end when its request is
cancelled, its result or refusal reaches the task, and it takes a token of trio's
default thread limiter while it runs."""

from __future__ import annotations

import threading

import pytest
import trio

from substrate.api import fs as fs_api
from substrate.errors import StaleBase

PATIENCE_S = 30.0


async def test_a_cancelled_write_runs_to_its_end_and_returns_its_plan() -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []
    results: list[object] = []
    limiter = trio.to_thread.current_default_thread_limiter()
    in_use: list[int] = []

    def write() -> object:
        started.set()
        assert release.wait(PATIENCE_S)
        finished.append(True)
        return "plan"

    async def call() -> None:
        results.append(await fs_api._write_thread(write))  # type: ignore[arg-type]

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.to_thread.run_sync(started.wait, PATIENCE_S)
            # 1 for the write; the thread waiting for `started` has given its token back.
            in_use.append(limiter.borrowed_tokens)
            scope.cancel()
            # Let the write go only after the cancellation reached its task.
            threading.Timer(0.05, release.set).start()
    assert scope.cancel_called
    assert finished == [True] and results == ["plan"] and in_use == [1]
    assert limiter.borrowed_tokens == 0


async def test_a_refusal_in_the_thread_is_raised_in_the_task() -> None:
    def refused() -> object:
        raise StaleBase("x: the file is not at the given base", current_sha256=None)

    with pytest.raises(StaleBase):
        await fs_api._write_thread(refused)  # type: ignore[arg-type]
    assert trio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
