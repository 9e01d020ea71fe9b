"""Terminals' caps hold under concurrent opens (the slot is reserved before any await)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from substrate.errors import GrantInvalid, LimitExceeded
from substrate.pty.backend import FakePty, FakePtys
from substrate.pty.frames import Error, Open
from substrate.pty.grants import Grants
from substrate.pty.terminals import Attached, Terminals, TerminalSettings
from substrate.store.db import Store
from substrate.store.journal import Journal


@dataclass
class GatedPtys:
    """A spawner that holds every start until `gate` is set, counting who is waiting."""

    gate: trio.Event = field(default_factory=trio.Event)
    waiting: int = 0
    inner: FakePtys = field(default_factory=FakePtys)
    arrived: trio.Event = field(default_factory=trio.Event)  # set (and renewed) per arrival
    seen: list[tuple[str, str]] = field(default_factory=list)  # (session, actor) per start

    async def __call__(
        self, *, workspace: str, profile: str, cols: int, rows: int, session: str, actor: str
    ) -> FakePty:
        self.waiting += 1
        self.seen.append((session, actor))
        self.arrived.set()
        self.arrived = trio.Event()
        await self.gate.wait()
        return await self.inner(
            workspace=workspace, profile=profile, cols=cols, rows=rows, session=session, actor=actor
        )


@dataclass
class Env:
    terminals: Terminals
    grants: Grants
    ptys: GatedPtys
    journal: Journal

    def token(self) -> str:
        _, token = self.grants.issue(
            workspace="w1", profile="interactive", ttl_s=60.0, uses=1, actor="operator:0"
        )
        return token


MakeEnv = Callable[..., Awaitable[Env]]


def _kick(code: int, error: Error | None, reason: str) -> None:
    pass


@pytest.fixture
async def make_env(tmp_path: Path) -> AsyncIterator[MakeEnv]:
    stores: list[Store] = []
    async with trio.open_nursery() as nursery:

        async def make(**settings: int) -> Env:  # TerminalSettings fields
            store = Store(tmp_path / f"db{len(stores)}")
            stores.append(store)
            journal = Journal(store)
            grants = Grants(store, journal)
            ptys = GatedPtys()
            terminals = Terminals(
                grants=grants,
                journal=journal,
                spawner=ptys,
                settings=TerminalSettings(**settings),
            )
            await nursery.start(terminals.run)
            return Env(terminals, grants, ptys, journal)

        yield make
        nursery.cancel_scope.cancel()
    for store in stores:
        store.close()


async def _open_both(env: Env) -> tuple[list[Attached], list[LimitExceeded]]:
    """Two new-session opens at once; the first is inside the spawner when the second asks."""
    opened: list[Attached] = []
    refused: list[LimitExceeded] = []
    second_done = trio.Event()

    async def one(token: str, done: trio.Event | None = None) -> None:
        try:
            opened.append(await env.terminals.open(Open(token=token, cols=80, rows=24), _kick))
        except LimitExceeded as exc:
            refused.append(exc)
        finally:
            if done is not None:
                done.set()

    async def second_waiting() -> None:
        while env.ptys.waiting < 2:
            await env.ptys.arrived.wait()
        second_done.set()  # it reached the spawner: no refusal comes

    first, second = env.token(), env.token()
    async with trio.open_nursery() as nursery:
        arrived = env.ptys.arrived
        nursery.start_soon(one, first)
        with trio.fail_after(10):
            await arrived.wait()
        # The second open either is refused or reaches the spawner too; then let both go.
        async with trio.open_nursery() as watch:
            watch.start_soon(second_waiting)
            nursery.start_soon(one, second, second_done)
            with trio.fail_after(10):
                await second_done.wait()
            watch.cancel_scope.cancel()
        env.ptys.gate.set()
    return opened, refused


async def test_concurrent_opens_cannot_pass_max_sessions(make_env: MakeEnv) -> None:
    env = await make_env(max_sessions=1)
    opened, refused = await _open_both(env)
    assert len(opened) == 1
    assert [r.data["limit"] for r in refused] == [1]
    assert "sessions" in refused[0].message
    assert len(env.ptys.inner.spawned) == 1
    assert [s.state for s in env.terminals.list().sessions] == ["running"]


async def test_concurrent_opens_cannot_pass_max_clients(make_env: MakeEnv) -> None:
    env = await make_env(max_clients=1)
    opened, refused = await _open_both(env)
    assert len(opened) == 1
    assert [r.data["limit"] for r in refused] == [1]
    assert "connections" in refused[0].message
    assert len(env.ptys.inner.spawned) == 1


async def test_a_refused_open_gives_its_slots_back(make_env: MakeEnv) -> None:
    env = await make_env(max_sessions=1, max_clients=1)
    env.ptys.gate.set()
    bad = Open(token="g-0000000000000000.nope", cols=80, rows=24)
    for _ in range(3):
        with pytest.raises(GrantInvalid):  # the bad token, never a slot limit
            await env.terminals.open(bad, _kick)
    attached = await env.terminals.open(Open(token=env.token(), cols=80, rows=24), _kick)
    assert attached.mode == "control"


async def test_the_spawner_learns_the_session_and_pty_closed_says_how_it_ended(
    make_env: MakeEnv,
) -> None:
    env = await make_env()
    env.ptys.gate.set()
    attached = await env.terminals.open(Open(token=env.token(), cols=80, rows=24), _kick)
    session = attached.live.session
    assert env.ptys.seen == [(session.id, f"terminal:{session.grant}")]
    # On a layer profile the backend fills `ended` as it terminates (pty.docker).
    (pty,) = env.ptys.inner.spawned
    pty.ended["changes"] = {"generation": 4, "mode": "apply", "counts": {"applied": 1}}
    await env.terminals.close_frame(attached)
    await env.terminals.settle()
    (closed,) = [e for e in env.journal.read(limit=100) if e.kind == "pty.closed"]
    assert closed.data["session"] == session.id
    assert closed.data["changes"] == {"generation": 4, "mode": "apply", "counts": {"applied": 1}}
