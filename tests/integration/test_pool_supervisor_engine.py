"""A warm pool member's supervisor against the real engine (docs/fast-exec.md "In a warm
sandbox"; docs/execution.md "The warm pool").

An in-process daemon keeps `warm_sandboxes = {default = 1}` (substrate-sandbox:bookworm,
which has python3) for the uid-1000 checkouts under its adopt root. The member's
supervisor is started while it waits; a new workspace's first command is then served
by that very supervisor, as the workspace's uid, with no start of its own. A member
whose supervisor runs as another uid (recorded so, or only in fact), or died while it
waited, is refused and removed, and the command runs on the usual path as its uid.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, open_client
from substrate.sandbox.pool import Member
from substrate.sandbox.spec import RunAs
from substrate.sandbox.supervisor import agent, checks
from substrate.sandbox.supervisor.link import Link
from substrate.sandbox.supervisor.startup import start_program
from tests.harness import wait_until_async
from tests.harness.inprocess import in_process_config, owned_project, profiles_dir, serving
from tests.harness.workspaces import chown_tree

OWNER = 1000
OTHER = RunAs(1001, 1001)


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    roots: Path

    async def adopt(self, name: str) -> str:
        path = owned_project(self.roots / name, {"name.txt": f"{name}\n"})
        ws = await self.client.call("workspace.adopt", path=str(path))
        return str(ws["workspace"])

    async def member(self) -> Member:
        pool = self.daemon.execution.pool.pools["default"]
        await wait_until_async(lambda: len(pool.ready) >= 1, 90, message="pool not filled")
        return pool.ready[0]

    def journal(self, kind: str) -> list[dict[str, Any]]:
        return [e.data for e in self.daemon.journal.read(limit=100000) if e.kind == kind]


@pytest.fixture
async def env(sandbox_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(tmp_path / "profiles", ["default"])
    roots = tmp_path / "roots"
    roots.mkdir()
    chown_tree(roots)  # the adopt root's owner: whom the pool fills for
    config = in_process_config(engine_state, roots, profiles, warm_sandboxes={"default": 1})
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        yield Env(daemon, client, roots)


async def test_a_warm_supervisor_serves_the_first_command_as_the_workspaces_uid(
    env: Env,
) -> None:
    member = await env.member()
    assert member.slot is not None and member.slot.link is not None  # started while waiting
    link = member.slot.link
    assert link.pid in member.protected
    assert psutil.Process(link.pid).uids().real == OWNER
    assert env.journal("supervisor.started") == []  # journalled for a workspace, at bind

    ws = await env.adopt("one")
    result = await env.client.call(
        "proc.run", workspace=ws, profile="default", argv=["id", "-u"], facts="full"
    )
    assert (result["exit_code"], result["stdout"]["inline"]) == (0, f"{OWNER}\n")
    assert result["via"] == "supervisor"
    own = {f["name"]: f["value"] for f in result["exec_facts"]}
    assert (own["uid"], own["parent"]) == (OWNER, "supervisor")

    sandbox = env.daemon.execution.containers.cached(ws, "default")
    assert sandbox is not None and sandbox.id == member.container
    assert member.slot.link is link and link.pid in sandbox.protected  # the same process
    # Checked again at bind: it now serves with the verified sandbox's baseline.
    assert link.base == checks.baseline(sandbox.init_pid, sandbox.facts)
    started = env.journal("supervisor.started")
    assert [(s["container"], s["generation"], s.get("warm")) for s in started] == [
        (member.container[:12], 1, True)
    ]


async def start_as_other(env: Env, member: Member, recorded_uid: int) -> int:
    """Replace `member`'s supervisor by one running as `OTHER`, recorded as `recorded_uid`
    (and protected, so only the supervisor's own check can tell)."""
    slot = member.slot
    assert slot is not None and slot.link is not None and slot.accepting is not None
    old = slot.link
    old.kill()
    old.close()
    os.chown(slot.path / agent.SOCKET_NAME, OTHER.uid, OTHER.gid)  # so it can say hello
    base = checks.unverified_baseline(member.init_pid)
    base = checks.Baseline(
        status={**base.status, "uid": OTHER.uid, "gid": OTHER.gid},
        cgroup=base.cgroup,
        namespaces=base.namespaces,
    )
    engine = env.daemon.execution.containers._engine
    pid, pidfd, control = await start_program(
        engine, member.container, OTHER, {}, base, slot.accepting
    )
    slot.link = Link(
        container=member.container,
        generation=1,
        pid=pid,
        pidfd=pidfd,
        control=control,
        base=base,
        uid=recorded_uid,
        started=0.0,
    )
    member.protected = (member.protected - {old.pid}) | {pid}
    assert psutil.Process(pid).uids().real == OTHER.uid
    return pid


@pytest.mark.parametrize("recorded", ["other", "owner"])
async def test_a_member_whose_supervisor_is_another_uids_is_not_used(
    env: Env, recorded: str
) -> None:
    member = await env.member()
    pid = await start_as_other(env, member, OTHER.uid if recorded == "other" else OWNER)

    ws = await env.adopt("two")
    out = await env.client.call("proc.run", workspace=ws, profile="default", argv=["id", "-u"])
    assert (out["exit_code"], out["stdout"]["inline"]) == (0, f"{OWNER}\n")  # the usual path
    sandbox = env.daemon.execution.containers.cached(ws, "default")
    assert sandbox is not None and sandbox.id != member.container
    assert [r["container"] for r in env.journal("pool.refused")] == [member.container[:12]]
    assert env.journal("pool.bound") == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # The command's own supervisor is the new sandbox's, started for it as the owner.
    started = env.journal("supervisor.started")
    assert [(s["container"], s.get("warm")) for s in started] == [(sandbox.id[:12], None)]


async def test_a_member_whose_supervisor_died_while_waiting_is_not_used(env: Env) -> None:
    member = await env.member()
    assert member.slot is not None and member.slot.link is not None
    os.kill(member.slot.link.pid, signal.SIGKILL)

    ws = await env.adopt("three")
    out = await env.client.call("proc.run", workspace=ws, profile="default", argv=["id", "-u"])
    assert (out["exit_code"], out["stdout"]["inline"]) == (0, f"{OWNER}\n")
    sandbox = env.daemon.execution.containers.cached(ws, "default")
    assert sandbox is not None and sandbox.id != member.container
    gone = [*env.journal("pool.refused"), *env.journal("pool.removed")]
    assert member.container[:12] in [g["container"] for g in gone]
    assert env.journal("pool.bound") == []
