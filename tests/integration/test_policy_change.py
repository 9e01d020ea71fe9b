"""A policy that changes under a live sandbox (docs/protocol.md §2): the sandbox follows it.

A sandbox binds the policy's read-only directories when it is made, and the write gate
skips its file-level check when those mounts cover every deny glob. A policy changed
later (the operator's `workspace.set_policy`, or a checkout adopted inside or around the
workspace) must not leave a warm sandbox with the old mounts: the next command would
write a newly denied directory and nothing would catch it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, open_client
from tests.harness.inprocess import in_process_config, owned_project, profiles_dir, serving

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
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"])
    project = owned_project(tmp_path / "roots" / "project", {"build/keep": "k\n"})
    (project / "src").mkdir()
    os.chown(project / "src", OWNER, OWNER)
    config = in_process_config(engine_state, project.parent, profiles)
    async with (
        serving(config) as daemon,
        open_client(engine_state / "substrate.sock") as agent,
        open_client(engine_state / "operator.sock") as operator,
    ):
        ws = await agent.call("workspace.adopt", path=str(project))
        yield Env(daemon, agent, operator, ws["workspace"], project)


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
