"""Shared generations of a layer sandbox, without an engine: the bookkeeping
(`layer.generation.Users`) and its conclusions (`layer.users.LayerUsers`, with
`conclusion.conclude` replaced by a recorder that swaps like the real one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from substrate.layer import users as layer_users
from substrate.layer.generation import Conclusion, Deferred, User, Users, combined
from substrate.layer.mounts.lower_watch import LowerWatch
from substrate.layer.mounts.plan import plan
from substrate.layer.mounts.working_layer import WorkingLayer, next_plan
from substrate.layer.users import LayerUsers, journal_summary
from substrate.process.processes import RunRequest
from substrate.schema.proc import ChangeCounts, ChangesMode, ProcChanges
from substrate.store.db import Store
from substrate.store.journal import Journal

# -- the bookkeeping ----------------------------------------------------------------------


def _user(uid: str, mode: ChangesMode = "apply") -> User:
    return User(id=uid, actor=f"agent:{uid}", mode=mode)


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        (["apply"], "apply"),
        (["discard"], "discard"),
        (["review"], "review"),
        (["discard", "discard"], "discard"),
        (["discard", "apply"], "apply"),
        (["apply", "review", "discard"], "review"),
        (["discard", "review"], "review"),
    ],
)
def test_the_most_conservative_mode_wins(modes: list[ChangesMode], expected: str) -> None:
    assert combined(modes) == expected


def test_overlapping_users_share_one_conclusion_by_the_last() -> None:
    users = Users()
    users.join(_user("p_long"), 3)
    users.join(_user("p_short", "discard"), 3)
    assert users.leave("p_short", ran=True) == Deferred(3)
    assert not users.concluding  # nothing concludes while p_long runs
    done = users.leave("p_long", ran=True)
    assert done == Conclusion(
        generation=3, mode="apply", actor="agent:p_long", users=("p_short", "p_long")
    )
    assert users.concluding
    with pytest.raises(RuntimeError):
        users.join(_user("p_late"), 3)
    users.concluded(kept=False)
    assert (users.ended, users.carried, users.concluding) == ([], [], False)


def test_a_user_that_never_ran_concludes_only_for_others() -> None:
    users = Users()
    users.join(_user("p_a"), 0)
    assert users.leave("p_a", ran=False) is None  # alone: nothing to conclude
    users.join(_user("p_b"), 0)
    users.join(_user("p_c"), 0)
    assert users.leave("p_c", ran=False) is None  # p_b still runs
    users.join(_user("p_d", "review"), 0)
    assert users.leave("p_d", ran=True) == Deferred(0)
    assert users.leave("p_b", ran=False) == Conclusion(
        generation=0, mode="review", actor="agent:p_d", users=("p_d",)
    )


def test_a_busy_conclusion_carries_its_users_to_the_next() -> None:
    users = Users()
    users.join(_user("p_a", "review"), 5)
    assert isinstance(users.leave("p_a", ran=True), Conclusion)
    users.concluded(kept=True)  # layer_busy: the generation still holds p_a's changes
    assert [u.id for u in users.carried] == ["p_a"]
    users.join(_user("p_b"), 5)
    assert users.leave("p_b", ran=True) == Conclusion(
        generation=5, mode="review", actor="agent:p_b", users=("p_a", "p_b")
    )
    users.concluded(kept=False)
    assert users.carried == []


def test_a_user_joins_once() -> None:
    users = Users()
    users.join(_user("p_a"), 0)
    with pytest.raises(ValueError):
        users.join(_user("p_a"), 0)


# -- the conclusions ----------------------------------------------------------------------


@dataclass
class Recorder:
    """Stands in for `conclusion.conclude`: records each call, swaps the layer to its next
    generation (or not, when `busy`), and may be held open by `gate`."""

    calls: list[tuple[int, str, str]] = field(default_factory=list)
    busy: bool = False
    gate: trio.Event | None = None
    entered: trio.Event = field(default_factory=trio.Event)

    async def __call__(
        self, containers: Any, writer: Any, sandbox: Any, req: Any, changesets: Any, limiter: Any
    ) -> ProcChanges:
        layer: WorkingLayer = sandbox.layer
        generation = layer.plan.generation
        self.calls.append((generation, req.actor, req.changes))
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.busy:
            return ProcChanges(generation=generation, error="layer_busy")
        layer.plan = next_plan(layer.plan)
        return ProcChanges(
            generation=generation,
            changeset=f"cs_{generation:016x}",
            mode=req.changes,
            counts=ChangeCounts(applied=1),
        )


@dataclass
class Env:
    users: LayerUsers
    sandbox: Any
    journal: Journal
    recorder: Recorder

    def req(self, actor: str, changes: ChangesMode = "apply") -> RunRequest:
        return RunRequest(
            ws=SimpleNamespace(id="w1"), profile="layer", argv=("x",), actor=actor, changes=changes
        )

    def shared(self) -> list[Any]:
        return [e for e in self.journal.read(limit=1000) if e.kind == "changes.shared"]


class Quiet(LowerWatch):
    """A checkout nobody changes: no generation is mounted again (tests/layer/
    test_refresh.py has those that are)."""

    def pending(self) -> bool:
        return False


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    recorder = Recorder()
    monkeypatch.setattr(layer_users.conclusion, "conclude", recorder)
    store = Store(tmp_path / "db")
    journal = Journal(store)
    layer = WorkingLayer(plan=plan(str(tmp_path), "s0123456789abcdef", 0, []), watch=Quiet())
    sandbox = SimpleNamespace(id="c" * 64, layer=layer)
    users = LayerUsers(containers=None, writer=object(), changesets=None, journal=journal)
    try:
        yield Env(users, sandbox, journal, recorder)
    finally:
        store.close()


async def test_a_short_command_beside_a_long_one_ends_deferred(env: Env) -> None:
    server = await env.users.join(env.sandbox, "p_server", env.req("agent:1"))
    curl = await env.users.join(env.sandbox, "p_curl", env.req("agent:2", "review"))
    changes = await env.users.end(curl)
    assert changes == ProcChanges(generation=0, deferred=True, mode="review")
    assert env.recorder.calls == []  # nothing swapped while the server runs
    last = await env.users.end(server)
    # One conclusion, by the last to end, in the most conservative mode asked.
    assert env.recorder.calls == [(0, "agent:1", "review")]
    assert last is not None and last.changeset == "cs_0000000000000000" and not last.deferred
    (entry,) = env.shared()
    assert entry.actor == "agent:1"
    assert entry.data == {
        "generation": 0,
        "changeset": "cs_0000000000000000",
        "mode": "review",
        "procs": ["p_curl", "p_server"],
        "sessions": [],
    }
    # The next command gets the next generation, alone: no `changes.shared`.
    alone = await env.users.join(env.sandbox, "p_next", env.req("agent:1"))
    assert (await env.users.end(alone)) == ProcChanges(
        generation=1, changeset="cs_0000000000000001", counts=ChangeCounts(applied=1)
    )
    assert len(env.shared()) == 1
    assert alone.left


async def test_a_newcomer_waits_for_a_running_conclusion_then_joins_the_next(env: Env) -> None:
    env.recorder.gate = trio.Event()
    first = await env.users.join(env.sandbox, "p_a", env.req("agent:1"))
    joined: list[int] = []

    async def newcomer() -> None:
        use = await env.users.join(env.sandbox, "t-0123456789abcdef", env.req("terminal:g"))
        joined.append(env.sandbox.layer.plan.generation)
        await env.users.abandon(use)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(env.users.end, first)
        await env.recorder.entered.wait()
        nursery.start_soon(newcomer)
        await trio.testing.wait_all_tasks_blocked()
        assert joined == []  # held while generation 0 concludes
        env.recorder.gate.set()
    assert joined == [1]
    assert env.recorder.calls == [(0, "agent:1", "apply")]  # the newcomer never ran


async def test_a_busy_generation_goes_whole_with_the_next_conclusion(env: Env) -> None:
    env.recorder.busy = True
    first = await env.users.join(env.sandbox, "p_a", env.req("agent:1", "review"))
    busy = await env.users.end(first)
    assert busy is not None and busy.error == "layer_busy"
    assert env.shared() == []
    env.recorder.busy = False
    terminal = await env.users.join(env.sandbox, "t-00000000000000aa", env.req("terminal:g"))
    changes = await env.users.end(terminal)
    # p_a's changes were still in generation 0: concluded now, in p_a's mode too.
    assert env.recorder.calls == [(0, "agent:1", "review"), (0, "terminal:g", "review")]
    assert changes is not None and changes.generation == 0 and changes.mode == "review"
    (entry,) = env.shared()
    assert (entry.data["procs"], entry.data["sessions"]) == (["p_a"], ["t-00000000000000aa"])
    assert entry.actor == "terminal:g"


async def test_a_failed_conclusion_still_lets_newcomers_in(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any) -> ProcChanges:
        raise RuntimeError("boom")

    use = await env.users.join(env.sandbox, "p_a", env.req("agent:1"))
    monkeypatch.setattr(layer_users.conclusion, "conclude", broken)
    with pytest.raises(RuntimeError):
        await env.users.end(use)
    with trio.fail_after(5):
        again = await env.users.join(env.sandbox, "p_b", env.req("agent:1"))
    assert not env.sandbox.layer.users.concluding
    await env.users.abandon(again)


async def test_a_closed_layer_refuses_newcomers(env: Env) -> None:
    env.sandbox.layer.closed = True
    with pytest.raises(layer_users.LayerClosed):
        await env.users.join(env.sandbox, "p_a", env.req("agent:1"))
    assert env.sandbox.layer.users.active == {}


# -- shutdown ----------------------------------------------------------------------------


def _write_upper(env: Env) -> None:
    upper = env.sandbox.layer.plan.upper
    os.makedirs(upper, exist_ok=True)
    with open(os.path.join(upper, "made.txt"), "w") as f:
        f.write("x")


def _stopped(env: Env) -> list[Any]:
    return [e for e in env.journal.read(limit=1000) if e.kind == "changes.stopped"]


async def test_quiet_waits_for_every_user_and_every_conclusion(env: Env) -> None:
    env.recorder.gate = trio.Event()
    first = await env.users.join(env.sandbox, "p_a", env.req("agent:1"))
    second = await env.users.join(env.sandbox, "t-00000000000000aa", env.req("terminal:g"))
    quiet = trio.Event()

    async def wait_quiet() -> None:
        await env.users.quiet()
        quiet.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_quiet)
        await env.users.end(first)  # deferred: the terminal still uses the generation
        await trio.testing.wait_all_tasks_blocked()
        assert not quiet.is_set()
        nursery.start_soon(env.users.end, second)
        await env.recorder.entered.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert not quiet.is_set()  # the conclusion still runs
        env.recorder.gate.set()
    assert quiet.is_set()
    assert env.recorder.calls == [(0, "terminal:g", "apply")]


async def test_stop_waits_for_the_running_conclusion_then_concludes_nothing(env: Env) -> None:
    env.recorder.gate = trio.Event()
    running = await env.users.join(env.sandbox, "p_a", env.req("agent:1"))
    late = await env.users.join(env.sandbox, "p_b", env.req("agent:2"))
    await env.users.end(late)  # deferred
    stopped = trio.Event()

    async def stop() -> None:
        await env.users.stop()
        stopped.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(env.users.end, running)
        await env.recorder.entered.wait()
        nursery.start_soon(stop)
        await trio.testing.wait_all_tasks_blocked()
        assert not stopped.is_set()  # never removes a sandbox under a conclusion
        env.recorder.gate.set()
    assert stopped.is_set()
    # Stopping: newcomers are refused, and a last user's generation is not concluded.
    with pytest.raises(layer_users.RuntimeUnavailable):
        await env.users.join(env.sandbox, "p_c", env.req("agent:1"))
    assert env.sandbox.layer.users.active == {}
    assert len(env.recorder.calls) == 1


async def test_a_generation_left_at_stop_is_kept_for_review_once_torn_down(env: Env) -> None:
    agent = await env.users.join(env.sandbox, "p_a", env.req("agent:1"))
    shell = await env.users.join(env.sandbox, "t-00000000000000aa", env.req("terminal:g"))
    await env.users.stop()
    changes = await env.users.end(agent)  # the terminal is still open: deferred
    assert changes is not None and changes.deferred
    _write_upper(env)
    # Still mounted (its container could not be removed): nothing is scanned.
    assert await env.users.keep_left() == []
    assert env.recorder.calls == []
    env.sandbox.layer.closed = True
    assert await env.users.keep_left() == []  # closed, but its teardown failed
    env.sandbox.layer.unmounted = True  # the container went, the layer was torn down
    (kept,) = await env.users.keep_left()
    # Scanned in mode "review" (they asked "apply"), nothing applied, as the last user.
    assert env.recorder.calls == [(0, "terminal:g", "review")]
    (entry,) = _stopped(env)
    assert entry.actor == "terminal:g"
    assert entry.data == {
        "generation": 0,
        "changeset": kept.changeset,
        "mode": "apply",
        "procs": ["p_a"],
        "sessions": ["t-00000000000000aa"],
    }
    assert env.shared() == []
    # The terminal ends after: its result names the kept set, concluded nothing more.
    late = await env.users.end(shell)
    assert late is not None and late.changeset == kept.changeset
    assert late.error == layer_users.STOPPED
    assert await env.users.keep_left() == []  # kept once
    assert len(env.recorder.calls) == 1
    await env.users.quiet()


async def test_keep_left_keeps_carried_users_and_honours_an_all_discard(env: Env) -> None:
    env.recorder.busy = True  # a stray process held the generation: users carried
    use = await env.users.join(env.sandbox, "p_a", env.req("agent:1", "discard"))
    busy = await env.users.end(use)
    assert busy is not None and busy.error == "layer_busy"
    env.recorder.busy = False
    await env.users.stop()
    env.sandbox.layer.closed = env.sandbox.layer.unmounted = True
    os.makedirs(env.sandbox.layer.plan.upper)
    assert await env.users.keep_left() == []  # an empty upper dir: nothing to keep
    _write_upper(env)
    await env.users.keep_left()
    assert env.recorder.calls[-1] == (0, "agent:1", "discard")  # every user asked so
    (entry,) = _stopped(env)
    assert entry.data["mode"] == "discard" and entry.data["procs"] == ["p_a"]


def test_the_journal_summary_has_counts_and_no_paths() -> None:
    changes = msgspec.convert(
        {
            "generation": 2,
            "changeset": "cs_0000000000000002",
            "applied": [{"path": "a.txt", "op": "create"}],
            "counts": {"applied": 1},
        },
        ProcChanges,
    )
    summary = journal_summary(changes)
    assert summary == {
        "generation": 2,
        "changeset": "cs_0000000000000002",
        "mode": "apply",
        "counts": summary["counts"],
    }
    assert summary["counts"]["applied"] == 1
    assert "a.txt" not in repr(summary)
