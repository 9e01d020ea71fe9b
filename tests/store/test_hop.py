"""substrate.store.hop: a blocking call's one hop to a worker thread and back.

Its result and its exception reach the task; a cancelled caller still waits for a
started call to finish (it is never abandoned); it holds a token of its limiter while it
runs, and waits for one when none is free."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from substrate.store.hop import run_to_end

PATIENCE_S = 30.0


async def test_the_result_and_the_exception_reach_the_task() -> None:
    main = threading.get_ident()
    assert await run_to_end(threading.get_ident) != main

    def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await run_to_end(fails)
    assert trio.to_thread.current_default_thread_limiter().borrowed_tokens == 0


async def test_a_cancelled_caller_waits_for_the_call_to_finish() -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []
    results: list[str] = []

    default = trio.to_thread.current_default_thread_limiter()
    in_use: list[float] = []

    def slow() -> str:
        started.set()
        assert release.wait(PATIENCE_S)
        finished.append("done")
        return "value"

    scope = trio.CancelScope()

    async def call() -> None:
        with scope:
            results.append(await run_to_end(slow))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.to_thread.run_sync(started.wait, PATIENCE_S)
        # Its token of the default limiter (the waiting thread gave its own back).
        in_use.append(default.borrowed_tokens)
        scope.cancel()  # the call is started: it is not abandoned
        await trio.sleep(0.05)
        assert finished == []
        release.set()
    assert finished == ["done"]
    assert results == ["value"]  # delivered: nothing checkpoints after it in `call`
    assert in_use == [1] and default.borrowed_tokens == 0


async def test_it_holds_a_token_of_its_limiter_and_waits_for_one() -> None:
    limiter = trio.CapacityLimiter(1)
    release = threading.Event()
    seen: list[float] = []

    def first() -> None:
        seen.append(limiter.borrowed_tokens)
        assert release.wait(PATIENCE_S)

    def second() -> None:
        seen.append(limiter.borrowed_tokens)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_to_end, first, limiter)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(run_to_end, second, limiter)
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.statistics().tasks_waiting == 1  # the second waits for the token
        release.set()
    assert seen == [1, 1]
    assert limiter.borrowed_tokens == 0
