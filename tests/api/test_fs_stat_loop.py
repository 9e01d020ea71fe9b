"""`fs.stat` answers on the event loop when its work is bounded (`substrate.api.fs`).

The handler runs in-process against a real registry, with every reader thread held
(`fs_limiter` exhausted): a stat whose digest fits in `LOOP_HASH_BYTES` (or is not asked
for inline) still answers, and one that needs a bigger hash waits for a thread, then
gives the same answer a thread would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from substrate.api import fs as fs_api
from substrate.config import Config
from substrate.protocol.caller import Caller
from substrate.schema.fs import StatParams
from substrate.workspace.digests import Digests
from tests.harness.state import DaemonState

BIG = fs_api.LOOP_HASH_BYTES + 1


@pytest.fixture
def daemon(daemon_state: DaemonState, make_workspace: Callable[..., Path]) -> Any:
    root = make_workspace("demo", {"a.txt": "alpha\n", "big.bin": b"b" * BIG})
    registry = daemon_state.registry
    return SimpleNamespace(
        config=daemon_state.config,
        workspaces=registry,
        digests=Digests(),
        fs_limiter=trio.CapacityLimiter(1),
        hash_limiter=trio.CapacityLimiter(1),
        ws=registry.adopt(str(root), None, None, "agent:0"),
    )


async def _no_notify(method: str, params: Any) -> None:
    raise AssertionError("fs.stat sends no notification")


CALLER = Caller(actor="agent", uid=1000, connection=1, notify=_no_notify)


async def test_a_small_stat_answers_while_every_reader_thread_is_held(daemon: Any) -> None:
    big_done = trio.Event()
    got: dict[str, Any] = {}

    async def big() -> None:
        got["big"] = await fs_api.stat(
            daemon, CALLER, StatParams(workspace=daemon.ws.id, path="big.bin")
        )
        big_done.set()

    async with trio.open_nursery() as nursery:
        await daemon.fs_limiter.acquire()  # every reader thread busy
        with trio.fail_after(10):
            small = await fs_api.stat(
                daemon, CALLER, StatParams(workspace=daemon.ws.id, path="a.txt")
            )
            root = await fs_api.stat(daemon, CALLER, StatParams(workspace=daemon.ws.id, path="."))
        assert small.sha256 == hashlib.sha256(b"alpha\n").hexdigest()
        assert root.kind == "dir"
        nursery.start_soon(big)
        await trio.testing.wait_all_tasks_blocked()
        assert not big_done.is_set()  # its hash needs a thread: it waits for one
        daemon.fs_limiter.release()
        with trio.fail_after(10):
            await big_done.wait()
    assert got["big"].sha256 == hashlib.sha256(b"b" * BIG).hexdigest()
    assert not got["big"].sha256_deferred


async def test_a_stat_over_the_inline_bound_stays_deferred_on_the_loop(daemon: Any) -> None:
    daemon.config = Config(
        state_dir=daemon.config.state_dir,
        adopt_roots=daemon.config.adopt_roots,
        inline_hash_bytes=16,
    )
    await daemon.fs_limiter.acquire()
    with trio.fail_after(10):
        small = await fs_api.stat(daemon, CALLER, StatParams(workspace=daemon.ws.id, path="a.txt"))
        big = await fs_api.stat(daemon, CALLER, StatParams(workspace=daemon.ws.id, path="big.bin"))
    assert small.sha256 is not None  # 6 bytes: within the bound
    assert big.sha256 is None and big.sha256_deferred
    daemon.fs_limiter.release()
    with trio.fail_after(10):
        hashed = await fs_api.stat(
            daemon, CALLER, StatParams(workspace=daemon.ws.id, path="big.bin", hash=True)
        )
    assert hashed.sha256 == hashlib.sha256(b"b" * BIG).hexdigest()
