"""The working layer against the real engine: a `workspace = "layer"` profile.

A daemon runs in-process with a workspace adopted under `write_deny = ["*.lock", ".env"]`
(plus the implicit `.git/**`) and a profile `layer` (the tiny one with `workspace =
"layer"`). Commands write into the overlay; what they change reaches the checkout only
when they end, through the guarded path, and the result's `changes` says what became of
each change. Every test ends with no mount left under the state dir.
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
from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for
from substrate.sandbox.layers import mounted_under, unmount_under

OWNER = 1000
LOCK = b"# lock file\n"


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    path: Path
    state: Path

    async def sh(self, script: str, profile: str = "layer") -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=["sh", "-c", script]
        )


def _mounts_under(state: Path) -> list[str]:
    return [m.mount_point for m in mounted_under(str(state))]


@pytest.fixture
def leftovers(docker_client: Any, tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    yield state
    daemon_id = daemon_id_for(state)
    for ctr in docker_client.api.containers(
        all=True, filters={"label": f"{LABEL_DAEMON}={daemon_id}"}
    ):
        docker_client.api.remove_container(ctr["Id"], force=True, v=True)
    left = _mounts_under(state)
    if left:  # never leave a test's mount behind, and fail the test for it
        unmount_under(str(state), keep_base=False)
    assert left == []


@pytest.fixture
async def env(
    tiny_image: str, leftovers: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Env]:
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    tiny = (PROJECT_ROOT / "profiles" / "tiny.toml").read_text()
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", profiles / "tiny.toml")
    (profiles / "layer.toml").write_text(tiny.replace('workspace = "rw"', 'workspace = "layer"'))
    root = tmp_path / "roots"
    project = root / "project"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "poetry.lock").write_bytes(LOCK)
    (project / "src").mkdir()
    (project / "src" / "app.py").write_text("print('hi')\n")
    (project / "old.txt").write_text("old\n")
    for base, dirs, files in os.walk(project):
        for name in [*dirs, *files]:
            os.chown(os.path.join(base, name), OWNER, OWNER, follow_symlinks=False)
    os.chown(project, OWNER, OWNER)
    config = Config(state_dir=str(leftovers), adopt_roots=[str(root)], profiles_dir=str(profiles))
    async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
        await nursery.start(daemon.serve)
        async with open_client(leftovers / "substrate.sock") as client:
            ws = await client.call(
                "workspace.adopt",
                path=str(project),
                policy={"write_deny": ["*.lock", ".env"]},
            )
            yield Env(daemon, client, ws["workspace"], project, leftovers)
        nursery.cancel_scope.cancel()


async def test_the_sandbox_sees_a_verified_layer_and_a_read_only_git(env: Env) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="layer")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["workspace_mount"] == "layer"
    assert facts["readonly_dirs"] == [".git"]
    result = await env.sh("touch .git/x; echo $?; cat old.txt")
    assert result["exit_code"] == 0
    assert result["stdout"]["inline"].split("\n")[1] == "old"
    assert result["stdout"]["inline"].split("\n")[0] != "0"
    assert not (env.path / ".git" / "x").exists()
    layers = env.state / "layers"
    assert any(m.startswith(f"{layers}/") for m in _mounts_under(env.state))
    await env.client.call("workspace.release", workspace=env.ws)
    # The sandbox's mounts are gone with it; the layer directory's own bind goes at stop.
    assert _mounts_under(env.state) == [str(layers)]
