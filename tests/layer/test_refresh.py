"""The fresh view's join, without an engine (`layer.users.LayerUsers.join` with the
remount — `users._refresh` — replaced): the first user of a generation whose checkout
changed gets it mounted again and re-verified, newcomers wait for that, a user beside
others never remounts, and a remount that fails drops the sandbox unless changes wait in
the generation (docs/working-layer.md, "The fresh view")."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from substrate.layer import users as layer_users
from substrate.layer.generation import User
from substrate.layer.mounts.lower_watch import LowerWatch
from substrate.layer.mounts.plan import plan
from substrate.layer.mounts.working_layer import WorkingLayer
from substrate.layer.users import LayerClosed, LayerUsers
from substrate.process.processes import RunRequest
from substrate.store.db import Store
from substrate.store.journal import Journal


class Changing(LowerWatch):
    """A checkout whose changes the test says."""

    def __init__(self) -> None:
        super().__init__()
        self.stale = False

    def pending(self) -> bool:
        return self.stale


@dataclass
class Containers:
    """The sandbox layer's side: re-verification (or its failure) and removals."""

    reverified: int = 0
    unverified: bool = False
    forgotten: list[str] = field(default_factory=list)

    async def reverify_layer(self, sandbox: Any, ws: Any) -> None:
        self.reverified += 1
        if self.unverified:
            raise RuntimeError("the container shows another overlay")

    async def forget(self, sandbox: Any, reason: str) -> None:
        self.forgotten.append(reason)


@dataclass
class Remounts:
    """Stands in for `users._refresh` (a worker thread's): counts, may fail or wait."""

    done: int = 0
    error: OSError | None = None
    gate: threading.Event | None = None

    def __call__(self, layer: WorkingLayer, ws: Any) -> bool:
        if self.gate is not None:
            self.gate.wait(10)
        if self.error is not None:
            raise self.error
        watch = layer.watch
        assert isinstance(watch, Changing)
        if not watch.stale:
            return False
        watch.stale = False
        self.done += 1
        return True


@dataclass
class Env:
    users: LayerUsers[Any]
    sandbox: Any
    watch: Changing
    containers: Containers
    remounts: Remounts

    def req(self, actor: str = "agent:1") -> RunRequest:
        return RunRequest(ws=SimpleNamespace(id="w1"), profile="layer", argv=("x",), actor=actor)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    remounts = Remounts()
    monkeypatch.setattr(layer_users, "_refresh", remounts)
    store = Store(tmp_path / "db")
    watch = Changing()
    layer = WorkingLayer(plan=plan(str(tmp_path), "s0123456789abcdef", 0, []), watch=watch)
    containers = Containers()
    users: LayerUsers[Any] = LayerUsers(
        containers=containers, writer=None, changesets=None, journal=Journal(store)
    )
    try:
        yield Env(users, SimpleNamespace(id="c" * 64, layer=layer), watch, containers, remounts)
    finally:
        store.close()


async def test_the_first_user_after_a_host_change_gets_a_fresh_mount(env: Env) -> None:
    first = await env.users.join(env.sandbox, "p_a", env.req())
    assert (env.remounts.done, env.containers.reverified) == (0, 0)  # nothing changed
    await env.users.end(first)
    env.watch.stale = True
    second = await env.users.join(env.sandbox, "p_b", env.req())
    assert (env.remounts.done, env.containers.reverified) == (1, 1)
    # Beside a running user the generation is never mounted again: it is in use.
    env.watch.stale = True
    beside = await env.users.join(env.sandbox, "p_c", env.req())
    assert env.remounts.done == 1
    await env.users.end(beside)
    await env.users.end(second)
    assert env.containers.forgotten == []


async def test_newcomers_wait_for_a_remount(env: Env) -> None:
    env.watch.stale = True
    env.remounts.gate = threading.Event()
    joined: list[str] = []

    async def join(uid: str) -> None:
        await env.users.join(env.sandbox, uid, env.req())
        joined.append(uid)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(join, "p_first")
        await trio.sleep(0.05)
        assert env.sandbox.layer.users.refreshing
        nursery.start_soon(join, "p_second")
        await trio.sleep(0.05)
        assert joined == []  # both wait: one mounts, the other waits for it
        env.remounts.gate.set()
    assert sorted(joined) == ["p_first", "p_second"] and env.remounts.done == 1
    assert not env.sandbox.layer.users.refreshing


async def test_a_busy_remount_with_nothing_waiting_drops_the_sandbox(env: Env) -> None:
    env.watch.stale = True
    env.remounts.error = OSError(errno.EBUSY, "busy")
    with pytest.raises(LayerClosed):
        await env.users.join(env.sandbox, "p_a", env.req())
    assert env.containers.forgotten == ["layer_busy"]
    assert not env.sandbox.layer.users.active and not env.sandbox.layer.users.refreshing


async def test_a_busy_remount_with_changes_waiting_joins_as_it_is(env: Env) -> None:
    env.sandbox.layer.users.carried = [User(id="p_old", actor="agent:1", mode="apply")]
    env.watch.stale = True
    env.remounts.error = OSError(errno.EBUSY, "busy")
    use = await env.users.join(env.sandbox, "p_a", env.req())
    assert env.containers.forgotten == [] and use.user.id in env.sandbox.layer.users.active


async def test_a_remount_that_does_not_verify_drops_the_sandbox(env: Env) -> None:
    env.watch.stale = True
    env.containers.unverified = True
    with pytest.raises(LayerClosed):
        await env.users.join(env.sandbox, "p_a", env.req())
    assert env.containers.forgotten == ["layer_unverified"]
    env.remounts.error = OSError(errno.EIO, "io")
    env.watch.stale = True
    with pytest.raises(LayerClosed):
        await env.users.join(env.sandbox, "p_b", env.req())
    assert env.containers.forgotten == ["layer_unverified", "layer_failed"]
