"""Fast exec without Docker: which path a command takes, what a mismatch or a lost
supervisor does, and a `FastChannel` moving output and stdin.

The supervisor is the real program run on this host (`tests.harness.host_supervisor`),
put into a `Supervisors` slot as if it had been started in a sandbox; the journal is a
real one on a temp database. Nothing here needs the engine: a command that would fall
back to it makes the test fail (`NoEngine`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import trio

from substrate.artifacts.sink import OutputSink
from substrate.errors import ConfinementUnmet
from substrate.process.fastexec import LOOP_PUMP_BYTES, FastChannel, FastPrepared, Launcher
from substrate.sandbox import cmd_cgroups, reaper
from substrate.sandbox.containers import Sandbox
from substrate.sandbox.engine import Engine
from substrate.sandbox.facts import Fact
from substrate.sandbox.profiles import Profile
from substrate.sandbox.reaper import CgroupDirs
from substrate.sandbox.spec import RunAs
from substrate.sandbox.supervisor import checks
from substrate.sandbox.supervisor.link import Link
from substrate.sandbox.supervisor.slot import Slot
from substrate.sandbox.supervisor.supervisors import Supervisors, supervised
from substrate.store.db import Store
from substrate.store.journal import Journal
from tests.harness import wait_until_async
from tests.harness.host_supervisor import host_link


class NoEngine:
    """Any engine call fails the test: these commands must stay on the fast path."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was asked: {name}")


@dataclass
class FakeSandbox:
    """What `Supervisors` and `Launcher` read of a sandbox."""

    id: str = "c" * 64
    workspace: str = "ws_test"
    profile: Profile = field(default_factory=lambda: Profile(name="default"))
    who: RunAs = field(default_factory=lambda: RunAs(os.getuid(), os.getgid()))
    init_pid: int = field(default_factory=os.getpid)
    facts: list[Fact] = field(default_factory=list)
    protected: frozenset[int] = frozenset()
    host_visible: bool = True
    #: No usable hierarchy: no command cgroups, so no spare is moved ahead (the real
    #: engine's tests cover that: tests/integration/test_fast_exec_engine.py).
    cgroups: CgroupDirs = field(
        default_factory=lambda: CgroupDirs(
            procs=Path("/nonexistent"), memory=None, freezer=None, v2=True
        )
    )


class Owner:
    """The sinks' owner (stands in for the artifact store): keeps what they hand over."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stored: dict[str, bytes] = {}

    def sink(self, name: str) -> OutputSink:
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return OutputSink(
            self, name, "p_test", name, fd, inline_limit=1 << 30, max_bytes=1 << 40, created=0.0
        )

    def finish_sink(self, sink: OutputSink, sha256: str | None) -> str | None:
        return None

    def read_artifact(self, artifact: str, offset: int, length: int) -> bytes:
        raise AssertionError("not stored")


@dataclass
class World:
    supervisors: Supervisors
    journal: Journal
    sandbox: FakeSandbox
    slot: Slot
    link: Link
    launcher: Launcher

    def entries(self, kind: str) -> list[dict[str, Any]]:
        return [e.data for e in self.journal.read(limit=1000) if e.kind == kind]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    store = Store(tmp_path / "substrate.db")
    journal = Journal(store)
    engine = cast(Engine, NoEngine())
    supervisors = Supervisors(engine, journal, tmp_path / "supervisor")
    async with host_link() as link:
        sandbox = FakeSandbox(protected=frozenset({link.pid}))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slot = Slot(path=tmp_path / "slot", listener=listener, mount={})
        slot.path.mkdir()
        supervisors.attach(slot, cast(Sandbox, sandbox))
        slot.link = link
        slot.generation = link.generation
        launcher = Launcher(engine, supervisors)
        try:
            yield World(supervisors, journal, sandbox, slot, link, launcher)
        finally:
            await supervisors.detach(sandbox.id)
            store.close()


def test_which_profiles_get_a_supervisor() -> None:
    assert supervised(Profile(name="default"))
    assert not supervised(Profile(name="g", runtime="runsc"))
    assert not supervised(Profile(name="w", read_only_rootfs=False))


async def test_a_child_unlike_its_sandbox_is_refused_and_the_supervisor_dropped(
    world: World,
) -> None:
    world.link.base = checks.Baseline(
        status={**world.link.base.status, "seccomp_mode": 2, "no_new_privs": True},
        cgroup=world.link.base.cgroup,
        namespaces=world.link.base.namespaces,
    )
    spec_env = {"PATH": "/usr/bin:/bin"}
    watch = os.pidfd_open(world.link.pid)
    with pytest.raises(ConfinementUnmet) as caught:
        await world.launcher.create(
            cast(Sandbox, world.sandbox),
            ["touch", "/tmp/never"],
            user="x",
            workdir="/",
            environment=spec_env,
            stdin=False,
        )
    assert caught.value.data["required"] == {"no_new_privs": True, "seccomp_mode": 2}
    tampered = world.entries("supervisor.tampered")
    assert tampered == [
        {
            "container": world.sandbox.id[:12],
            "profile": "default",
            "generation": 1,
            "reason": "confinement",
            "mismatches": ["no_new_privs", "seccomp_mode"],
        }
    ]
    assert world.slot.link is None
    assert world.link.pid not in world.sandbox.protected
    try:
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(watch)  # it was killed
    finally:
        os.close(watch)


async def test_a_dead_supervisor_means_the_engine_for_this_command(world: World) -> None:
    world.link.kill()
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(world.link.pidfd)
    world.slot.retry_at = trio.current_time() + 1000  # no new start in this test
    found = await world.supervisors.spawn(cast(Sandbox, world.sandbox))
    assert found is None
    assert [(e["generation"], e["reason"]) for e in world.entries("supervisor.lost")] == [
        (1, "exited")
    ]


async def start(world: World, argv: list[str], stdin: bool) -> FastChannel:
    prepared = await world.launcher.create(
        cast(Sandbox, world.sandbox),
        argv,
        user="x",
        workdir="/",
        environment={"PATH": "/usr/bin:/bin"},
        stdin=stdin,
    )
    assert isinstance(prepared, FastPrepared)
    channel = await world.launcher.start(prepared)
    assert isinstance(channel, FastChannel)
    return channel


async def test_output_past_the_loop_budget_and_stdin_reach_the_sinks(
    world: World, tmp_path: Path
) -> None:
    owner = Owner(tmp_path)
    sinks = {1: owner.sink("stdout"), 2: owner.sink("stderr")}
    data = os.urandom(3 * LOOP_PUMP_BYTES)  # past the event loop's share: a thread takes over
    channel = await start(world, ["sh", "-c", "cat; echo done >&2"], stdin=True)
    assert {f.name for f in channel.facts} >= {"parent", "cgroup", "namespaces"}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, channel.feed, data)
        await channel.pump(sinks, trio.CapacityLimiter(2))
    code = await channel.wait_exit(host_visible=True)
    assert code == 0
    assert await channel.start_failed(sinks, "sh", code) == 0
    out, err = sinks[1].close(), sinks[2].close()
    assert (out.bytes, out.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert msgspec.to_builtins(err)["inline"] == "done\n"
    channel.release()


async def test_the_held_child_is_moved_into_its_commands_cgroup_before_it_runs(
    world: World, tmp_path: Path
) -> None:
    # A command cgroup beneath the cgroup this test runs in (as a container's would be),
    # standing in by a plain directory: the move is one write of the pid to cgroup.procs.
    where = reaper.commands_parent(reaper.CgroupDirs.of_pid(os.getpid()))
    assert where is not None, "this host has no cgroup hierarchy to test against"
    cgroup = cmd_cgroups.CommandCgroup("p_test", tmp_path / "cmd", where[0], where[1])
    cgroup.path.mkdir()
    prepared = await world.launcher.create(
        cast(Sandbox, world.sandbox),
        ["sh", "-c", "echo $$"],
        user="x",
        workdir="/",
        environment={"PATH": "/usr/bin:/bin", "SUBSTRATE_PROC": ""},
        stdin=False,
        cgroup=cgroup,
    )
    assert isinstance(prepared, FastPrepared)
    # Moved while still held: before `go`, nothing of the command ran yet.
    held = prepared.spawned.host_pid
    assert (cgroup.path / "cgroup.procs").read_text() == str(held)
    channel = await world.launcher.start(prepared)
    owner = Owner(tmp_path)
    sinks = {1: owner.sink("stdout"), 2: owner.sink("stderr")}
    await channel.pump(sinks, trio.CapacityLimiter(1))
    assert await channel.wait_exit(host_visible=True) == 0
    # The process moved is the one that exec'd the command (its pid, as the host sees it:
    # the test's own pid namespace is the host's).
    assert msgspec.to_builtins(sinks[1].close())["inline"] == f"{held}\n"
    sinks[2].close()
    channel.release()


async def test_an_exec_failure_reads_like_the_shell(world: World, tmp_path: Path) -> None:
    owner = Owner(tmp_path)
    sinks = {1: owner.sink("stdout"), 2: owner.sink("stderr")}
    channel = await start(world, ["no-such-program"], stdin=False)
    await channel.pump(sinks, trio.CapacityLimiter(2))
    code = await channel.wait_exit(host_visible=True)
    assert code == 127
    assert await channel.start_failed(sinks, "no-such-program", code) == 127
    assert msgspec.to_builtins(sinks[2].close())["inline"] == (
        "substrate: no-such-program: command not found\n"
    )
    sinks[1].close()
    channel.release()


async def test_shutdown_wakes_the_pump_of_a_command_still_writing(
    world: World, tmp_path: Path
) -> None:
    owner = Owner(tmp_path)
    sinks = {1: owner.sink("stdout"), 2: owner.sink("stderr")}
    channel = await start(world, ["sh", "-c", "echo first; exec sleep 60"], stdin=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(channel.pump, sinks, trio.CapacityLimiter(2))
        await wait_until_async(lambda: sinks[1].written > 0, 30, message="no output")
        assert await channel.running()
        assert await channel.main_pid(first_sleep=0) is not None
        channel.shutdown()  # the run gives up on the streams: the pump returns
    os.kill(cast(int, await channel.main_pid(first_sleep=0)), 9)
    assert await channel.wait_exit(host_visible=True) == 137
    assert msgspec.to_builtins(sinks[1].close())["inline"] == "first\n"
    sinks[2].close()
    channel.release()


# -- held children forked ahead (docs/fast-exec.md "Held children") ---------------------


async def run_to_end(world: World, tmp_path: Path, argv: list[str], name: str) -> FastChannel:
    """One command through the launcher, as the driver runs it: pump, exit, `quiesce`."""
    owner = Owner(tmp_path)
    sinks = {1: owner.sink(f"{name}-out"), 2: owner.sink(f"{name}-err")}
    channel = await start(world, argv, stdin=False)
    await channel.pump(sinks, trio.CapacityLimiter(2))
    assert await channel.wait_exit(host_visible=True) == 0
    await channel.quiesce()
    for sink in sinks.values():
        sink.close()
    return channel


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_the_next_command_takes_a_held_child_forked_ahead_and_protected(
    world: World, tmp_path: Path
) -> None:
    first = await run_to_end(world, tmp_path, ["true"], "a")
    spare = world.slot.spare
    assert spare is not None and alive(spare.host_pid)
    # Protected from the reaper's scans (an unmarked child of the supervisor) while held.
    assert world.sandbox.protected == {world.link.pid, spare.host_pid}
    first.release()

    second = await start(world, ["true"], stdin=False)
    # The command is that very process, checked from the host just before it ran, and no
    # longer protected: it is a command now.
    assert second.facts and second.facts is spare.facts
    assert {f.name: f.value for f in second.facts}["parent"] == "supervisor"
    assert spare.host_pid not in world.sandbox.protected
    assert world.slot.spare is None and world.slot.asked  # the next one is asked for
    assert await second.wait_exit(host_visible=True) == 0
    await second.quiesce()
    nxt = world.slot.spare
    assert nxt is not None and nxt.host_pid != spare.host_pid
    assert world.sandbox.protected == {world.link.pid, nxt.host_pid}
    second.release()


async def test_a_held_child_killed_by_the_sandbox_is_replaced_on_demand(
    world: World, tmp_path: Path
) -> None:
    (await run_to_end(world, tmp_path, ["true"], "a")).release()
    spare = world.slot.spare
    assert spare is not None
    os.kill(spare.host_pid, 9)  # sandboxed code of the same uid may do this
    await wait_until_async(spare.exited, 10, message="the held child did not die")
    channel = await run_to_end(world, tmp_path, ["true"], "b")
    assert channel.via == "supervisor" and channel.facts
    assert spare.host_pid not in world.sandbox.protected
    assert world.entries("supervisor.lost") == [] and world.entries("supervisor.tampered") == []
    channel.release()


async def test_a_held_child_stopped_by_the_sandbox_is_killed_and_not_used(
    world: World, tmp_path: Path
) -> None:
    (await run_to_end(world, tmp_path, ["true"], "a")).release()
    spare = world.slot.spare
    assert spare is not None
    os.kill(spare.host_pid, signal.SIGSTOP)  # it would never exec
    await wait_until_async(
        lambda: checks.held_state_problem(
            checks.status_state(checks.read_status(spare.host_pid)[0])
        ),
        10,
    )
    pidfd = os.pidfd_open(spare.host_pid)
    try:
        channel = await run_to_end(world, tmp_path, ["true"], "b")  # not left waiting
        assert channel.via == "supervisor" and channel.facts is not spare.facts
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(pidfd)  # killed: no task held for ever
        assert spare.host_pid not in world.sandbox.protected
        channel.release()
    finally:
        os.close(pidfd)


async def test_a_run_that_ends_early_lets_the_asked_child_go(world: World) -> None:
    channel = await start(world, ["true"], stdin=False)
    assert world.slot.asked
    channel.release()  # never quiesced: the run was cut off before it looked
    assert not world.slot.asked and world.slot.spare is None
    assert world.sandbox.protected == {world.link.pid}
    # The next command forks its own, and asks again.
    again = await start(world, ["true"], stdin=False)
    assert again.facts and world.slot.asked
    assert await again.wait_exit(host_visible=True) == 0
    await again.quiesce()
    again.release()


async def test_a_supervisor_dropped_takes_its_held_child_with_it(
    world: World, tmp_path: Path
) -> None:
    (await run_to_end(world, tmp_path, ["true"], "a")).release()
    spare = world.slot.spare
    assert spare is not None
    pidfd = os.pidfd_open(spare.host_pid)
    try:
        world.link.kill()
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(world.link.pidfd)
        assert not await world.supervisors.serving(world.sandbox.id, world.link.generation)
        assert world.slot.spare is None and world.sandbox.protected == frozenset()
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(pidfd)  # its channel closed: it exited
    finally:
        os.close(pidfd)
