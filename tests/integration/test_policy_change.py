"""A policy that changes under a live sandbox (docs/protocol.md §2): the sandbox follows it.

A sandbox binds the policy's read-only directories when it is made, and the write gate
skips its file-level check when those mounts cover every deny glob. A policy changed
later (the operator's `workspace.set_policy`, or a checkout adopted inside or around the
workspace) must not leave a warm sandbox with the old mounts: the next command would
write a newly denied directory and nothing would catch it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.config import PROJECT_ROOT, Config
from substrate.daemon import Daemon, open_daemon
from substrate.protocol.client import AsyncClient, open_client
from tests.harness.engine import remove_daemon_containers

OWNER = 1000


@dataclass
class Env:
    daemon: Daemon
    agent: AsyncClient
    operator: AsyncClient
    ws: str
    path: Path

    async def sh(self, script: str) -> Any:
        return await self.agent.call(
            "proc.run", workspace=self.ws, profile="tiny", argv=["sh", "-c", script]
        )


@pytest.fixture
def state(docker_client: Any, tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    yield state
    remove_daemon_containers(docker_client, state)


@pytest.fixture
async def env(
    tiny_image: str, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Env]:
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", profiles / "tiny.toml")
    project = tmp_path / "roots" / "project"
    (project / "build").mkdir(parents=True)
    (project / "build" / "keep").write_text("k\n")
    (project / "src").mkdir()
    for base, dirs, files in os.walk(project):
        for name in [*dirs, *files]:
            os.chown(os.path.join(base, name), OWNER, OWNER, follow_symlinks=False)
    os.chown(project, OWNER, OWNER)
    config = Config(
        state_dir=str(state), adopt_roots=[str(project.parent)], profiles_dir=str(profiles)
    )
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        async with (
            open_client(state / "substrate.sock") as agent,
            open_client(state / "operator.sock") as operator,
        ):
            ws = await agent.call("workspace.adopt", path=str(project))
            yield Env(daemon, agent, operator, ws["workspace"], project)
        nursery.cancel_scope.cancel()


async def test_set_policy_reaches_a_warm_sandbox(env: Env) -> None:
    warm = await env.sh("echo before > build/out")
    assert warm["exit_code"] == 0
    (env.path / "build" / "out").unlink()
    info = await env.operator.call(
        "workspace.set_policy", workspace=env.ws, policy={"write_deny": ["build/**"]}
    )
    assert info["policy"]["write_deny"] == [".git/**", "build/**"]
    await env.sh("echo after > build/out; echo fine > src/ok")
    assert not (env.path / "build" / "out").exists()
    assert (env.path / "build" / "keep").read_text() == "k\n"
    assert (env.path / "src" / "ok").read_text() == "fine\n"


async def test_a_nested_checkout_adopted_later_reaches_a_warm_sandbox(env: Env) -> None:
    assert (await env.sh("true"))["exit_code"] == 0
    await env.agent.call(
        "workspace.adopt", path=str(env.path / "build"), policy={"write_deny": ["/**"]}
    )
    await env.sh("echo after > build/out")
    assert not (env.path / "build" / "out").exists()
