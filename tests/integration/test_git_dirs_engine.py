"""Git directories by content, a `.git` file's target and passthrough binds, against the
real engine (docs/confinement.md, "What host tools discover").

A daemon runs in-process on a uid-1000 checkout whose git dir is a `--separate-git-dir`
store (`.git` is the file `gitdir: gitstore`), with the tiny profile as a working layer
(`layer`) and with a passthrough `node_modules` (`pass`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.protocol.client import AsyncClient, open_client
from tests.harness.inprocess import (
    as_layer,
    in_process_config,
    owned_project,
    profiles_dir,
    serving,
)

HEAD = "ref: refs/heads/main\n"


@dataclass
class Env:
    client: AsyncClient
    ws: str
    path: Path

    async def sh(self, script: str, profile: str = "layer") -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=["sh", "-c", script]
        )


@pytest.fixture
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    layer = as_layer("tiny")
    passing = layer.replace("passthrough = []", 'passthrough = ["node_modules"]')
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=layer, **{"pass": passing})
    project = owned_project(
        tmp_path / "roots" / "project",
        {
            ".git": "gitdir: gitstore\n",
            "gitstore/HEAD": HEAD,
            "gitstore/config": "[core]\n\tbare = false\n",
            "gitstore/objects/info/packs": "",
            "gitstore/refs/heads/main": "0" * 40 + "\n",
            "gitstore/hooks/README": "hooks\n",
            "src/app.py": "print('hi')\n",
            "node_modules/pkg/index.js": "module.exports = 1\n",
        },
    )
    config = in_process_config(engine_state, project.parent, profiles)
    async with serving(config), open_client(engine_state / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(project))
        yield Env(client, ws["workspace"], project)
        await client.call("workspace.release", workspace=ws["workspace"])


async def test_a_git_dir_planted_by_content_never_lands(env: Env) -> None:
    script = (
        "mkdir -p tools/objects/ab tools/refs/heads"
        f" && printf '{HEAD}' > tools/HEAD"
        " && printf '[core]\\n\\tfsmonitor = touch MARKER\\n\\tworktree = ..\\n' > tools/config"
        " && echo blob > tools/objects/ab/cdef && echo x > tools/refs/heads/main"
        " && echo ok > src/ok.py"
    )
    result = await env.sh(script)
    assert result["exit_code"] == 0
    changes = result["changes"]
    blocked = {(e["path"], e["reason"]) for e in changes["blocked"]}
    for piece in ("tools/HEAD", "tools/config", "tools/objects", "tools/refs"):
        assert (piece, "git_dir") in blocked
    assert sorted(e["path"] for e in changes["applied"]) == ["src/ok.py", "tools"]
    assert (env.path / "src" / "ok.py").read_text() == "ok\n"
    assert os.listdir(env.path / "tools") == []


async def test_the_git_dir_a_git_file_names_is_read_only_in_the_sandbox(env: Env) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="layer")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert {".git", "gitstore"} <= set(facts["readonly_dirs"])
    result = await env.sh(
        "echo '#!/bin/sh' > gitstore/hooks/post-checkout; echo $?;"
        " printf '[core]\\n\\tfsmonitor = touch MARKER\\n' >> gitstore/config; echo $?"
    )
    codes = result["stdout"]["inline"].split()
    assert codes[0] != "0" and codes[1] != "0"
    assert not (env.path / "gitstore" / "hooks" / "post-checkout").exists()
    assert (env.path / "gitstore" / "config").read_text() == "[core]\n\tbare = false\n"


async def test_passthrough_binds_are_nosuid_nodev(env: Env) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="pass")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["passthrough"] == ["node_modules"]
    assert facts["passthrough_options"] == ["node_modules: rw,nosuid,nodev"]
    result = await env.sh("grep ' /workspace/node_modules ' /proc/self/mountinfo", "pass")
    options = result["stdout"]["inline"].split()[5].split(",")
    assert {"rw", "nosuid", "nodev"} <= set(options)
    assert stat.S_ISDIR((env.path / "node_modules").stat().st_mode)


async def test_what_a_command_leaves_in_a_passthrough_dir_is_reported_and_neutralised(
    env: Env,
) -> None:
    nm = env.path / "node_modules"
    result = await env.sh(
        "cd node_modules && mkdir -p evil/.git/objects evil/.git/refs"
        f" && printf '{HEAD}' > evil/.git/HEAD"
        " && printf '[core]\\n\\tfsmonitor = touch MARKER\\n' > evil/.git/config"
        " && echo x > run && chmod 4755 run && ln run run2 && ln -s /etc/shadow shadow"
        " && ln -s / rootlink && mkfifo pipe",
        "pass",
    )
    assert result["exit_code"] == 0
    found = {
        (e["path"], e["reason"]): e.get("mode")
        for e in result["changes"]["blocked"]
        if e.get("rule") == "passthrough"
    }
    assert found == {
        ("node_modules/evil/.git", "git_dir"): 0,
        ("node_modules/run", "setid"): 0o755,
        ("node_modules/run2", "hard_link"): None,
        ("node_modules/shadow", "symlink"): None,
        ("node_modules/rootlink", "symlink"): None,
        ("node_modules/pipe", "fifo"): None,
    }
    # Each finding is named in the journal as well (docs/working-layer.md).
    journal = await env.client.call("journal.read", workspace=env.ws, limit=10000)
    named = {
        (e["data"]["path"].split(":", 1)[1], e["data"]["reason"]): e["data"]
        for e in journal["entries"]
        if e["kind"] == "changes.blocked" and e["data"].get("rule") == "passthrough"
    }
    assert set(named) == set(found)
    assert {(d["outcome"], d["op"], d["generation"]) for d in named.values()} == {
        ("blocked", None, result["changes"]["generation"])
    }
    assert stat.S_IMODE((nm / "evil" / ".git" / "HEAD").stat().st_mode) == 0
    assert stat.S_IMODE((nm / "run2").stat().st_mode) == 0o755  # one inode, bits gone
    # A set-id file the command made keeps its bytes and loses its bits.
    again = await env.sh("cd node_modules && echo y > tool && chmod 6755 tool", "pass")
    entries = [e for e in again["changes"]["blocked"] if e.get("rule") == "passthrough"]
    assert {
        "path": "node_modules/tool",
        "reason": "setid",
        "rule": "passthrough",
        "mode": 0o755,
    } in entries
    assert stat.S_IMODE((nm / "tool").stat().st_mode) == 0o755
    assert (nm / "tool").read_text() == "y\n"
