"""The write gate against the real engine: sandboxed commands writing denied paths.

A daemon runs in-process with a workspace adopted under `write_deny = ["*.lock", ".env"]`
(plus the implicit `.git/**`); each test runs a fixed literal `sh -c` script inside the
tiny sandbox and checks the host tree, the `policy_blocked` result and the journal.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.config import Config
from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, open_client
from substrate.workspace import discoverable
from tests.harness import chown_tree, wait_until_async
from tests.harness.inprocess import owned_project, profiles_dir, serving

OWNER = 1000
LOCK = b"# lock file\n[[package]]\nname = 'x'\n"
GIT_CONFIG = "[core]\n\tbare = false\n"


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    path: Path

    async def sh(self, script: str) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile="tiny", argv=["sh", "-c", script]
        )

    def blocked_entries(self) -> list[dict[str, Any]]:
        return [e.data for e in self.daemon.journal.read(limit=10000) if e.kind == "policy.blocked"]


def blocked(result: Any) -> list[tuple[str, str, bool]]:
    return sorted((b["path"], b["change"], b["reverted"]) for b in result["policy_blocked"])


@pytest.fixture
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"])
    project = owned_project(
        tmp_path / "roots" / "project",
        {
            ".git/HEAD": "ref: refs/heads/main\n",
            ".git/config": GIT_CONFIG,
            "poetry.lock": LOCK,
            "src/app.py": "print('hi')\n",
        },
    )
    os.chmod(project / "poetry.lock", 0o640)
    config = Config(
        state_dir=str(engine_state), adopt_roots=[str(project.parent)], profiles_dir=str(profiles)
    )
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        ws = await client.call(
            "workspace.adopt", path=str(project), policy={"write_deny": ["*.lock", ".env"]}
        )
        yield Env(daemon, client, ws["workspace"], project)


async def test_created_denied_files_are_removed_allowed_ones_stay(env: Env) -> None:
    result = await env.sh(
        "echo TOKEN=hunter2 > .env && echo lock > poetry2.lock && mkdir -p sub"
        " && echo x > sub/Cargo.lock && echo fine > src/new.py"
    )
    assert result["exit_code"] == 0
    assert blocked(result) == [
        ("project:.env", "create", True),
        ("project:poetry2.lock", "create", True),
        ("project:sub/Cargo.lock", "create", True),
    ]
    assert not (env.path / ".env").exists()
    assert not (env.path / "poetry2.lock").exists()
    assert not (env.path / "sub" / "Cargo.lock").exists()
    assert (env.path / "src" / "new.py").read_text() == "fine\n"
    assert (env.path / "src" / "new.py").stat().st_uid == OWNER
    entries = env.blocked_entries()
    assert sorted((e["path"], e["change"]) for e in entries) == [
        (p, c) for p, c, _ in blocked(result)
    ]
    assert "hunter2" not in json.dumps(entries)
    (exited,) = [e for e in env.daemon.journal.read(limit=10000) if e.kind == "proc.exited"]
    assert len(exited.data["policy_blocked"]) == 3


async def test_modified_lock_is_restored_byte_for_byte_with_its_mode(env: Env) -> None:
    before = os.stat(env.path / "poetry.lock")
    result = await env.sh("echo tampered >> poetry.lock && chmod 777 poetry.lock")
    assert result["exit_code"] == 0
    assert blocked(result) == [("project:poetry.lock", "modify", True)]
    after = os.stat(env.path / "poetry.lock")
    assert (env.path / "poetry.lock").read_bytes() == LOCK
    assert stat.S_IMODE(after.st_mode) == 0o640
    assert (after.st_uid, after.st_gid, after.st_mtime_ns) == (
        OWNER,
        OWNER,
        before.st_mtime_ns,
    )
    (entry,) = env.blocked_entries()
    assert entry["before"]["sha256"] == hashlib.sha256(LOCK).hexdigest()
    assert entry["after"]["sha256"] == hashlib.sha256(LOCK + b"tampered\n").hexdigest()


async def test_deleted_denied_file_is_restored(env: Env) -> None:
    result = await env.sh("rm poetry.lock")
    assert blocked(result) == [("project:poetry.lock", "delete", True)]
    assert (env.path / "poetry.lock").read_bytes() == LOCK
    assert stat.S_IMODE(os.stat(env.path / "poetry.lock").st_mode) == 0o640


async def test_chmod_of_denied_file_is_restored(env: Env) -> None:
    result = await env.sh("chmod 755 poetry.lock")
    assert blocked(result) == [("project:poetry.lock", "chmod", True)]
    assert stat.S_IMODE(os.stat(env.path / "poetry.lock").st_mode) == 0o640


async def test_symlink_at_denied_name_is_removed(env: Env) -> None:
    result = await env.sh("ln -s /etc/passwd .env && ln -sf src/app.py poetry.lock")
    assert result["exit_code"] == 0
    assert blocked(result) == [
        ("project:.env", "create", True),
        ("project:poetry.lock", "modify", True),
    ]
    assert not (env.path / ".env").is_symlink() and not (env.path / ".env").exists()
    assert not (env.path / "poetry.lock").is_symlink()
    assert (env.path / "poetry.lock").read_bytes() == LOCK
    assert (env.path / "src" / "app.py").read_text() == "print('hi')\n"


async def test_git_config_is_read_only_inside(env: Env) -> None:
    result = await env.sh("echo '[core] hooksPath = /tmp' >> .git/config")
    assert result["exit_code"] != 0
    assert "Read-only file system" in result["stderr"]["inline"]
    assert (env.path / ".git" / "config").read_text() == GIT_CONFIG
    assert result["policy_blocked"] == []  # the mount refused it: nothing to revert


async def test_a_clean_command_reports_nothing_and_the_next_one_still_checks(env: Env) -> None:
    assert (await env.sh("cat poetry.lock > /dev/null"))["policy_blocked"] == []
    result = await env.sh("echo x > .env")
    assert blocked(result) == [("project:.env", "create", True)]


async def test_names_that_are_not_utf8_are_reported_escaped_and_the_record_ends(
    env: Env,
) -> None:
    # `printf '\377'` makes the byte 0xff: a name no UTF-8 decoder accepts.
    result = await env.sh(
        "mkdir -p \"$(printf 'd\\377')\" && echo x > \"$(printf 'd\\377/\\376.lock')\""
        " && echo y > \"$(printf 'x\\377.lock')\" && echo z > \"$(printf 'ok\\377')\""
    )
    assert result["exit_code"] == 0, result
    assert blocked(result) == [
        ("project:d\\xff/\\xfe.lock", "create", True),
        ("project:x\\xff.lock", "create", True),
    ]
    top = set(os.listdir(os.fsencode(env.path)))
    assert b"x\xff.lock" not in top
    assert b"ok\xff" in top  # allowed: left alone
    assert os.listdir(os.fsencode(env.path) + b"/d\xff") == []
    entries = env.blocked_entries()
    assert sorted(e["path"] for e in entries) == [p for p, _, _ in blocked(result)]
    status = await env.client.call("proc.status", proc=result["proc"])
    assert status["state"] == "exited"


async def test_require_approval_paths_are_reverted_for_sandboxed_code(env: Env) -> None:
    project = env.path.parent / "approvals"
    (project / "conf").mkdir(parents=True)
    (project / "app.cfg").write_text("mode = safe\n")
    (project / "conf" / "db.cfg").write_text("host = local\n")
    for base, dirs, files in os.walk(project):
        for name in [*dirs, *files]:
            os.chown(os.path.join(base, name), OWNER, OWNER, follow_symlinks=False)
    os.chown(project, OWNER, OWNER)
    ws = await env.client.call(
        "workspace.adopt", path=str(project), policy={"require_approval": ["*.cfg"]}
    )
    result = await env.client.call(
        "proc.run",
        workspace=ws["workspace"],
        profile="tiny",
        argv=["sh", "-c", "echo 'mode = open' > app.cfg; rm conf/db.cfg; echo n > new.cfg"],
    )
    assert result["exit_code"] == 0
    assert sorted((b["path"], b["change"], b["reverted"]) for b in result["policy_blocked"]) == [
        ("approvals:app.cfg", "modify", True),
        ("approvals:conf/db.cfg", "delete", True),
        ("approvals:new.cfg", "create", True),
    ]
    assert {b["rule"] for b in result["policy_blocked"]} == {"require_approval"}
    assert (project / "app.cfg").read_text() == "mode = safe\n"
    assert (project / "conf" / "db.cfg").read_text() == "host = local\n"
    assert not (project / "new.cfg").exists()


async def test_a_host_edit_during_a_command_is_never_reverted(env: Env) -> None:
    # A person created `poetry.lock` on the host while an agent's command ran,
    # and the gate deleted it as the sandbox's doing. The command writes `.env` (denied,
    # reverted), then waits for `src/go`; meanwhile the host creates `poetry.lock` and
    # `host.lock` (denied paths both). Only the sandbox's change is undone.
    (env.path / "poetry.lock").unlink()  # between commands: not gated
    mine = b"# the person's own lock\n"
    results: list[Any] = []

    async def command() -> None:
        results.append(
            await env.sh("echo TOKEN=x > .env; while [ ! -e src/go ]; do sleep 0.02; done")
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(command)
        await wait_until_async((env.path / ".env").exists)
        (env.path / "poetry.lock").write_bytes(mine)
        (env.path / "host.lock").write_bytes(mine)
        (env.path / "src" / "go").write_text("")
    (result,) = results
    assert result["exit_code"] == 0
    assert blocked(result) == [
        ("project:.env", "create", True),
        ("project:host.lock", "create", False),
        ("project:poetry.lock", "create", False),
    ]
    reasons = {b["path"]: b["reason"] for b in result["policy_blocked"]}
    assert reasons == {
        "project:.env": None,
        "project:host.lock": "unattributed",
        "project:poetry.lock": "unattributed",
    }
    assert not (env.path / ".env").exists()
    assert (env.path / "poetry.lock").read_bytes() == mine
    assert (env.path / "host.lock").read_bytes() == mine
    entries = {e["path"]: e for e in env.blocked_entries()}
    assert entries["project:poetry.lock"]["reverted"] is False
    assert entries["project:poetry.lock"]["reason"] == "unattributed"
    assert entries["project:.env"]["reverted"] is True


async def test_a_denied_file_the_sandbox_and_the_host_both_changed_is_kept(env: Env) -> None:
    # Reverting would undo the host's edit too: the change is reported `mixed`, kept.
    async def command() -> None:
        results.append(
            await env.sh("echo sandbox >> poetry.lock; while [ ! -e src/go ]; do sleep 0.02; done")
        )

    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(command)
        lock = env.path / "poetry.lock"
        await wait_until_async(lambda: lock.read_bytes().endswith(b"sandbox\n"))
        lock.write_bytes(lock.read_bytes() + b"host\n")
        (env.path / "src" / "go").write_text("")
    (result,) = results
    assert blocked(result) == [("project:poetry.lock", "modify", False)]
    assert result["policy_blocked"][0]["reason"] == "mixed"
    assert (env.path / "poetry.lock").read_bytes() == LOCK + b"sandbox\nhost\n"


async def test_a_git_dir_by_content_a_command_plants_is_undone(env: Env) -> None:
    # A command wrote `tools/HEAD`, `tools/objects/`, `tools/refs/` and a `tools/config`
    # running `core.fsmonitor`: a repository by content, which host git run in `tools/`
    # would have obeyed. Under the default policy (only `.git/**`, mounted read-only)
    # the gate took no snapshot and it stayed. A repository the person made on the host
    # before the command (after the sandbox was created: not mounted read-only in it)
    # stays untouched, and the command's ordinary files stay.
    project = owned_project(
        env.path.parent / "plain",
        {".git/HEAD": "ref: refs/heads/main\n", ".git/config": GIT_CONFIG, "src/a.py": "a\n"},
    )
    ws = (await env.client.call("workspace.adopt", path=str(project)))["workspace"]

    async def sh(script: str) -> Any:
        return await env.client.call(
            "proc.run", workspace=ws, profile="tiny", argv=["sh", "-c", script]
        )

    assert (await sh("true"))["policy_blocked"] == []  # the sandbox exists from here on
    mine = {
        "HEAD": b"ref: refs/heads/main\n",
        "objects/info/packs": b"",
        "refs/heads/main": b"0" * 40 + b"\n",
        "config": b"[core]\n\tbare = true\n",
    }
    nested = project / "vendor" / "lib"
    for rel, data in mine.items():
        (nested / rel).parent.mkdir(parents=True, exist_ok=True)
        (nested / rel).write_bytes(data)
    chown_tree(project / "vendor")
    result = await sh(
        "mkdir -p tools/objects/ab tools/refs/heads && echo 'ref: refs/heads/main' > tools/HEAD"
        " && printf '[core]\\n\\tfsmonitor = touch /tmp/MARKER\\n' > tools/config"
        " && echo blob > tools/objects/ab/cdef && echo notes > tools/notes.txt"
        " && echo fine > src/new.py"
    )
    assert result["exit_code"] == 0, result
    assert sorted(
        (b["path"], b["change"], b["reverted"], b["rule"], b["reason"])
        for b in result["policy_blocked"]
    ) == [
        ("plain:tools/HEAD", "create", True, "write_deny", "git_dir"),
        ("plain:tools/objects", "create", True, "write_deny", "git_dir"),
        ("plain:tools/refs", "create", True, "write_deny", "git_dir"),
    ]
    assert not discoverable.completes(set(os.listdir(project / "tools")))
    assert (project / "tools" / "config").read_text() == "[core]\n\tfsmonitor = touch /tmp/MARKER\n"
    assert (project / "tools" / "notes.txt").read_text() == "notes\n"
    assert (project / "src" / "new.py").read_text() == "fine\n"
    assert (project / "src" / "new.py").stat().st_uid == OWNER
    # The person's repository: every byte where it was, still a repository.
    assert {rel: (nested / rel).read_bytes() for rel in mine} == mine
    assert discoverable.completes(set(os.listdir(nested)))
    entries = [e for e in env.blocked_entries() if str(e["path"]).startswith("plain:")]
    assert {(e["reason"], e["git_dir"]) for e in entries} == {("git_dir", "plain:tools")}
