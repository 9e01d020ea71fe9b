"""The warm pool against the real engine (docs/execution.md, "The warm pool").

An in-process daemon keeps `warm_sandboxes = {layer = 1}` (the tiny profile as a
working layer) for the uid-1000 checkouts under its adopt root. A new workspace's first
command is served by the member waiting in the pool, verified for *that* workspace (its
identity, its home, its mounts), its files visible and its writes landing through the
layer. A member tampered with while it waited (a process left in it, a mount added) is
refused, removed and replaced, and the command still runs. The members go on shutdown
and, after kill -9, at the next start; a pool that cannot be filled says so in
`daemon.status` while commands take the usual path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, RpcError, open_client
from substrate.sandbox.pool import LABEL_POOL
from substrate.sandbox.spec import LABEL_DAEMON, daemon_id_for
from tests.harness import wait_until, wait_until_async
from tests.harness.inprocess import (
    as_layer,
    in_process_config,
    owned_project,
    profiles_dir,
    serving,
)
from tests.harness.workspaces import chown_tree

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

#: Enter the mount namespace of process argv[1] and mount a tmpfs on its /tmp.
MOUNT_IN_NS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(f"/proc/{sys.argv[1]}/ns/mnt", os.O_RDONLY)
if libc.setns(fd, 0x00020000) != 0 or libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None) != 0:
    raise OSError(ctypes.get_errno(), "setns/mount")
"""
FILES = {"src/app.py": "print('hi')\n", ".git/HEAD": "ref: refs/heads/main\n"}


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    roots: Path

    async def adopt(self, name: str) -> tuple[str, Path]:
        path = owned_project(self.roots / name, {**FILES, "name.txt": f"{name}\n"})
        ws = await self.client.call("workspace.adopt", path=str(path))
        return str(ws["workspace"]), path

    async def sh(self, ws: str, script: str) -> Any:
        return await self.client.call(
            "proc.run", workspace=ws, profile="layer", argv=["sh", "-c", script]
        )

    def members(self) -> list[str]:
        return [m.container for m in self.daemon.execution.pool.pools["layer"].ready]

    async def ready(self, n: int = 1) -> list[str]:
        await wait_until_async(lambda: len(self.members()) >= n, 60, message="pool not filled")
        return self.members()

    async def entries(self, kind: str) -> list[Any]:
        found = await self.client.call("journal.read", since=0, limit=10000)
        return [e for e in found["entries"] if e["kind"] == kind]


def pool_containers(docker_client: Any, state: Path) -> list[str]:
    labels = [f"{LABEL_DAEMON}={daemon_id_for(state)}", f"{LABEL_POOL}=1"]
    found = docker_client.api.containers(all=True, filters={"label": labels})
    return [str(c["Id"]) for c in found]


@pytest.fixture
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=as_layer("tiny"))
    roots = tmp_path / "roots"
    roots.mkdir()
    chown_tree(roots)  # the adopt root's owner: whom the pool fills for before any workspace
    config = in_process_config(engine_state, roots, profiles, warm_sandboxes={"layer": 1})
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        yield Env(daemon, client, roots)


async def test_a_warm_sandbox_serves_a_new_workspace_as_its_own(env: Env) -> None:
    # Made before the pool is waited for: a checkout change in the ctime slack before a
    # command starts is taken as the host's (a safe false conflict, docs/working-layer.md).
    ws, path = await env.adopt("one")
    (member,) = await env.ready()
    out = await env.sh(ws, "id -u; cat name.txt; echo made > new.txt; echo $HOME > /home/agent/h")
    assert out["exit_code"] == 0
    assert out["stdout"]["inline"] == "1000\none\n"
    assert (path / "new.txt").read_bytes() == b"made\n", out.get(
        "changes"
    )  # landed through the layer

    sandbox = env.daemon.execution.containers.cached(ws, "layer")
    assert sandbox is not None and sandbox.id == member  # the pool's member, bound
    assert [e["data"]["container"] for e in await env.entries("pool.bound")] == [member[:12]]
    facts = {f.name: f.value for f in sandbox.facts}
    # Observed at bind time for this workspace: the overlay on its layer, its home.
    assert sandbox.layer is not None
    base = os.stat(sandbox.layer.plan.base)
    assert facts["workspace_identity"] == f"{base.st_dev}:{base.st_ino}"
    assert sandbox.home is not None
    home = os.stat(sandbox.home.source)
    assert facts["home_identity"] == f"{home.st_dev}:{home.st_ino}"
    assert (Path(sandbox.home.source) / "h").read_text() == "/home/agent\n"
    verdicts = [e["data"] for e in await env.entries("proc.facts") if e["workspace"] == ws]
    assert [(v["container"], v["ok"]) for v in verdicts] == [(member[:12], True)]

    # A second new workspace gets the refilled member, not the first one's sandbox.
    (again,) = await env.ready()
    assert again != member
    ws2, path2 = await env.adopt("two")
    out = await env.sh(ws2, "cat name.txt; ls")
    assert out["stdout"]["inline"] == "two\nname.txt\nsrc\n"
    sandbox2 = env.daemon.execution.containers.cached(ws2, "layer")
    assert sandbox2 is not None and sandbox2.id == again
    assert not (path2 / "new.txt").exists()


@pytest.mark.parametrize("tamper", ["process", "mount"])
async def test_a_tampered_member_is_refused_and_replaced(
    env: Env, tamper: str, docker_client: Any
) -> None:
    (member,) = await env.ready()
    if tamper == "process":
        argv = ["docker", "exec", "-d", member, "sleep", "600"]
    else:  # from the host, in the member's mount namespace: a tmpfs over its /tmp
        pid = env.daemon.execution.pool.pools["layer"].ready[0].init_pid
        argv = [sys.executable, "-c", MOUNT_IN_NS, str(pid)]
    await trio.run_process(argv, capture_stdout=True, capture_stderr=True)

    ws, _ = await env.adopt("tampered")
    out = await env.sh(ws, "cat name.txt")
    assert (
        out["exit_code"] == 0 and out["stdout"]["inline"] == "tampered\n"
    )  # the usual path ran it
    sandbox = env.daemon.execution.containers.cached(ws, "layer")
    assert sandbox is not None and sandbox.id != member
    refused = [e["data"] for e in await env.entries("pool.refused")]
    assert [r["container"] for r in refused] == [member[:12]]
    assert await env.entries("pool.bound") == []
    (fresh,) = await env.ready()
    assert fresh not in (member, sandbox.id)  # replaced
    assert member not in pool_containers(docker_client, env.daemon.state_dir)


async def test_an_unfillable_pool_degrades_and_says_so(
    tiny_image: str, engine_state: Path, tmp_path: Path, docker_client: Any
) -> None:
    tag = f"substrate-pooltest:{os.getpid()}"
    layer = as_layer("tiny").replace(f'image = "{tiny_image}"', f'image = "{tag}"')
    assert tag in layer
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=layer)
    roots = tmp_path / "roots"
    roots.mkdir()
    chown_tree(roots)
    config = in_process_config(engine_state, roots, profiles, warm_sandboxes={"layer": 1})
    try:
        async with (
            serving(config) as daemon,
            open_client(engine_state / "substrate.sock") as client,
        ):

            async def pool_status() -> Any:
                return (await client.call("daemon.status"))["warm_pool"]["layer"]

            await wait_until_async(
                lambda: daemon.execution.pool.pools["layer"].last_error is not None, 30
            )
            status = await pool_status()
            assert status["ready"] == 0 and status["wanted"] == 1
            assert "image" in status["last_error"]
            path = owned_project(roots / "p", {"a.txt": "a\n"})
            ws = (await client.call("workspace.adopt", path=str(path)))["workspace"]
            tiny = await client.call(
                "proc.run", workspace=ws, profile="tiny", argv=["cat", "a.txt"]
            )
            assert tiny["stdout"]["inline"] == "a\n"  # the daemon serves on

            docker_client.api.tag(tiny_image, *tag.split(":"))  # the image comes back
            out = await client.call(
                "proc.run", workspace=ws, profile="layer", argv=["cat", "a.txt"]
            )
            assert out["stdout"]["inline"] == "a\n"
            await wait_until_async(
                lambda: daemon.execution.pool.pools["layer"].ready, 90, message="no refill"
            )
            assert (await pool_status())["last_error"] is None
    finally:
        docker_client.api.remove_image(tag)  # only the tag this test made


async def test_the_members_go_at_shutdown(
    tiny_image: str, engine_state: Path, tmp_path: Path, docker_client: Any
) -> None:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=as_layer("tiny"))
    roots = tmp_path / "roots"
    roots.mkdir()
    chown_tree(roots)
    config = in_process_config(engine_state, roots, profiles, warm_sandboxes={"layer": 2})
    async with serving(config) as daemon:
        await wait_until_async(lambda: len(daemon.execution.pool.pools["layer"].ready) == 2, 60)
        assert len(pool_containers(docker_client, engine_state)) == 2
    assert pool_containers(docker_client, engine_state) == []


def test_a_killed_daemons_members_go_at_the_next_start(
    engine_daemons: Callable[..., DaemonProcess], docker_client: Any, tiny_image: str
) -> None:
    d = engine_daemons(warm_sandboxes={"default": 2})
    chown_tree(d.adopt_root)
    d.restart()  # now the adopt root tells whom to fill for

    def members() -> list[str]:
        return pool_containers(docker_client, d.state_dir)

    def ready() -> int:
        return int(d.client().call("daemon.status")["warm_pool"]["default"]["ready"])

    wait_until(lambda: ready() == 2, 120, message="pool not filled")
    before = set(members())
    assert len(before) == 2
    d.kill()
    assert set(members()) == before  # nothing removed them: the daemon died
    d.start()
    wait_until(lambda: not before & set(members()), 60, message="the dead pool stayed")
    wait_until(lambda: len(members()) == 2, 120, message="pool not refilled")


async def test_a_thousand_first_commands_are_bounded_by_max_processes(
    tiny_image: str, engine_state: Path, tmp_path: Path
) -> None:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=as_layer("tiny"))
    roots = tmp_path / "roots"
    roots.mkdir()
    chown_tree(roots)
    config = in_process_config(
        engine_state, roots, profiles, warm_sandboxes={"layer": 2}, max_processes=8
    )
    paths = [owned_project(roots / f"w{i}", {"a.txt": f"{i}\n"}) for i in range(1000)]
    outcomes: list[str] = []
    peak = 0
    async with serving(config) as daemon:
        sock = engine_state / "substrate.sock"

        async def first_commands(batch: list[Path]) -> None:
            async with open_client(sock) as client:
                handles = [
                    (await client.call("workspace.adopt", path=str(p)))["workspace"] for p in batch
                ]
                async with trio.open_nursery() as nursery:
                    for ws in handles:
                        nursery.start_soon(one, client, ws)

        async def one(client: AsyncClient, ws: str) -> None:
            try:
                await client.call("proc.run", workspace=ws, profile="layer", argv=["true"])
                outcomes.append("ok")
            except RpcError as exc:
                outcomes.append(str(exc.refusal))

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, daemon.execution.processes.running)
                await trio.sleep(0.005)

        async with trio.open_nursery() as outer:
            outer.start_soon(watch)
            async with trio.open_nursery() as nursery:
                for k in range(20):  # 20 connections of 50 (max_in_flight is 64)
                    nursery.start_soon(first_commands, paths[k * 50 : (k + 1) * 50])
            outer.cancel_scope.cancel()
    assert len(outcomes) == 1000
    assert set(outcomes) <= {"ok", "limit_exceeded"}
    assert outcomes.count("limit_exceeded") > 0 and outcomes.count("ok") > 0
    assert peak <= 8
