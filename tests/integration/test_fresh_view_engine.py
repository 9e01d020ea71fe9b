"""The fresh view against the real engine: a command sees the checkout as it is when it
starts (docs/working-layer.md, "The fresh view").

A daemon runs in-process with a `layer` profile (the tiny one with `workspace =
"layer"`) over a checkout owned by uid 1000 that is a git repository the test made. Each
test runs a first command that looks every name up (so its generation's overlay has
seen them, and stays mounted: that command changed nothing), then changes the checkout
on the host as a person would — in place, by an editor's rename, create, delete, chmod,
a directory rename, `git checkout` of another branch, `git pull`, `git stash` (host git
with hooks off and no global config, in the repository the test made, its files then
owned by uid 1000) — and a second command must see the change.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.daemon import Daemon
from substrate.layer.mounts import lower_watch
from substrate.layer.mounts.working_layer import CTIME_SLACK_NS
from substrate.protocol.client import AsyncClient, open_client
from tests.harness.inprocess import (
    as_layer,
    in_process_config,
    owned_project,
    profiles_dir,
    serving,
)
from tests.harness.workspaces import chown_tree

pytestmark = pytest.mark.docker

OWNER = 1000
#: Every name the first command looks up (`_look`), present or not.
NAMES = ["a.txt", "b.txt", "new.txt", "run.sh", "d/x.txt", "e/x.txt", "only-other.txt"]


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    path: Path

    async def sh(self, script: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.call(
            "proc.run", workspace=self.ws, profile="layer", argv=["sh", "-c", script]
        )
        return result

    async def out(self, script: str) -> str:
        result = await self.sh(script)
        assert result["exit_code"] == 0, result
        return str(result["stdout"]["inline"])

    async def look(self) -> None:
        """Look every name up (cat, stat, ls) in a command that changes nothing: its
        generation stays mounted, having seen them."""
        script = "; ".join(f"cat {n} 2>/dev/null; stat -c %a {n} 2>/dev/null" for n in NAMES)
        result = await self.sh(f"{script}; ls -R . >/dev/null; cat .git/HEAD; true")
        assert result["exit_code"] == 0
        changes = result["changes"]
        assert not any(changes["counts"].values()) and changes.get("changeset") is None


def git(path: Path, *args: str) -> str:
    """Host git as the person would run it: no hooks, no global or system config; what it
    leaves is then owned by uid 1000 as the person's would be (it runs as root here: the
    test's temporary directories are not uid 1000's to enter)."""
    config = path.parent / ".person.gitconfig"  # a clone's helpers read no `-c`
    config.write_text("[safe]\n\tdirectory = *\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(path.parent),
        "GIT_CONFIG_GLOBAL": str(config),
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(
        [
            "git",
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "user.name=person",
            "-c",
            "user.email=person@example.invalid",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "safe.directory=*",
            "-C",
            str(path),
            *args,
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    chown_tree(path)
    return done.stdout


def as_owner_write(path: Path, data: str) -> None:
    path.write_text(data)
    os.chown(path, OWNER, OWNER)


@pytest.fixture
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=as_layer("tiny"))
    project = owned_project(
        tmp_path / "roots" / "project",
        {"a.txt": "a1\n", "b.txt": "b1\n", "run.sh": "echo ran\n", "d/x.txt": "x1\n"},
    )
    git(project, "init", "-q", "-b", "main")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "one")
    config = in_process_config(engine_state, project.parent, profiles)
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(project))
        yield Env(daemon, client, ws["workspace"], project)


async def test_an_edit_in_place_is_seen(env: Env) -> None:
    await env.look()
    fd = os.open(env.path / "a.txt", os.O_WRONLY)  # same inode, other bytes
    os.write(fd, b"A2")
    os.close(fd)
    assert await env.out("cat a.txt") == "A2\n"


async def test_a_replace_by_rename_is_seen(env: Env) -> None:
    await env.look()
    as_owner_write(env.path / ".a.txt.swp", "saved by an editor\n")
    os.rename(env.path / ".a.txt.swp", env.path / "a.txt")
    await trio.sleep(2 * CTIME_SLACK_NS / 1e9)  # clearly before the next command
    assert await env.out("cat a.txt") == "saved by an editor\n"
    # And a change of it by a command is based on the saved file: applied, not a
    # conflict (the command saw it; a save in the last 50 ms before a command starts
    # is a conflict, as ever: docs/working-layer.md, "Host edits during a command").
    result = await env.sh("echo mine >> a.txt")
    assert [e["path"] for e in result["changes"].get("applied", [])] == ["a.txt"]
    assert not result["changes"].get("conflicts")
    assert (env.path / "a.txt").read_text() == "saved by an editor\nmine\n"


async def test_a_create_is_seen(env: Env) -> None:
    await env.look()  # `new.txt` was looked up while missing
    as_owner_write(env.path / "new.txt", "made on the host\n")
    assert await env.out("cat new.txt") == "made on the host\n"


async def test_a_delete_is_seen(env: Env) -> None:
    await env.look()
    (env.path / "b.txt").unlink()
    assert await env.out("test -e b.txt && echo present || echo absent") == "absent\n"


async def test_a_mode_change_is_seen(env: Env) -> None:
    await env.look()
    assert await env.out("./run.sh 2>/dev/null || echo refused") == "refused\n"
    os.chmod(env.path / "run.sh", 0o755)
    assert await env.out("stat -c %a run.sh; ./run.sh") == "755\nran\n"


async def test_a_directory_rename_is_seen(env: Env) -> None:
    await env.look()
    os.rename(env.path / "d", env.path / "e")
    assert await env.out("cat e/x.txt; test -e d && echo d || echo no-d") == "x1\nno-d\n"


async def test_a_host_git_checkout_of_another_branch_is_seen(env: Env) -> None:
    git(env.path, "checkout", "-q", "-b", "other")
    as_owner_write(env.path / "a.txt", "a-other\n")
    as_owner_write(env.path / "only-other.txt", "o\n")
    (env.path / "b.txt").unlink()
    git(env.path, "add", "-A")
    git(env.path, "commit", "-q", "-m", "other")
    git(env.path, "checkout", "-q", "main")
    await env.look()
    git(env.path, "checkout", "-q", "other")
    seen = await env.out("cat .git/HEAD a.txt only-other.txt; ls")
    assert seen.split("\n")[:3] == ["ref: refs/heads/other", "a-other", "o"]
    assert "b.txt" not in seen.split("\n")[3:]
    # And back: the first branch's files again.
    git(env.path, "checkout", "-q", "main")
    seen = await env.out("cat .git/HEAD a.txt b.txt; test -e only-other.txt || echo gone")
    assert seen == "ref: refs/heads/main\na1\nb1\ngone\n"


async def test_a_host_git_stash_is_seen(env: Env) -> None:
    as_owner_write(env.path / "a.txt", "work in progress\n")
    await env.look()
    assert await env.out("cat a.txt") == "work in progress\n"
    git(env.path, "stash", "-q")
    assert await env.out("cat a.txt") == "a1\n"
    git(env.path, "stash", "pop", "-q")
    assert await env.out("cat a.txt") == "work in progress\n"


async def test_a_host_git_pull_is_seen(env: Env, tmp_path: Path) -> None:
    upstream = tmp_path / "upstream"
    git(env.path, "clone", "-q", "--no-hardlinks", ".", str(upstream))
    git(upstream, "checkout", "-q", "-b", "side")
    (upstream / "a.txt").write_text("a-pulled\n")
    (upstream / "d" / "pulled.txt").write_text("p\n")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-q", "-m", "upstream")
    await env.look()
    git(env.path, "pull", "-q", "--ff-only", str(upstream), "side")
    assert await env.out("cat a.txt d/pulled.txt") == "a-pulled\np\n"


async def test_an_unchanged_checkout_keeps_its_generation_mounted(env: Env) -> None:
    await env.look()
    before = (await env.client.call("daemon.status"))["fresh_view"]
    for _ in range(3):
        result = await env.sh("cat a.txt")
        assert result["changes"]["generation"] == 0
    after = (await env.client.call("daemon.status"))["fresh_view"]
    assert after["remounts"] == before["remounts"]
    assert after["layers"] == 1 and after["degraded"] == 0 and after["watched_dirs"] >= 3
    # A host change: exactly one remount, seen by the next command.
    as_owner_write(env.path / "b.txt", "b2\n")
    assert await env.out("cat b.txt") == "b2\n"
    assert (await env.client.call("daemon.status"))["fresh_view"]["remounts"] == (
        before["remounts"] + 1
    )


async def test_a_change_set_applied_costs_the_next_command_no_remount(env: Env) -> None:
    # The next generation is mounted after the apply: it shows the set already, so the
    # apply's own writes to the checkout do not make the next command mount it again.
    await env.look()
    remounts = (await env.client.call("daemon.status"))["fresh_view"]["remounts"]
    wrote = await env.sh("echo made > made.txt; echo more >> a.txt; rm b.txt")
    assert sorted(e["path"] for e in wrote["changes"]["applied"]) == ["a.txt", "b.txt", "made.txt"]
    seen = await env.out("cat made.txt a.txt; test -e b.txt || echo no-b")
    assert seen == "made\na1\nmore\nno-b\n"
    assert (await env.client.call("daemon.status"))["fresh_view"]["remounts"] == remounts


async def test_a_watch_past_its_bound_remounts_every_command(
    tiny_image: str, engine_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lower_watch, "MAX_WATCHED_DIRS", 1)
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=as_layer("tiny"))
    project = owned_project(tmp_path / "roots" / "p", {"a.txt": "a1\n", "d/x.txt": "x\n"})
    config = in_process_config(engine_state, project.parent, profiles)
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(project))
        env = Env(daemon, client, ws["workspace"], project)
        assert await env.out("cat a.txt") == "a1\n"
        status = (await client.call("daemon.status"))["fresh_view"]
        assert (status["degraded"], status["reasons"]) == (1, ["too_many_dirs"])
        before = status["remounts"]
        as_owner_write(project / ".a.swp", "a2\n")
        os.rename(project / ".a.swp", project / "a.txt")
        assert await env.out("cat a.txt") == "a2\n"
        assert await env.out("cat a.txt") == "a2\n"
        after = (await client.call("daemon.status"))["fresh_view"]["remounts"]
        assert after == before + 2  # every command, changed or not


def _in_a_layer(state_dir: str, name: str) -> bool:
    return bool(sorted(Path(state_dir).glob(f"layers/*/upper/*/{name}")))


async def test_a_create_beside_a_host_save_during_the_command_applies(env: Env) -> None:
    # The watch names what the host changed: a create beside an unrelated save in the
    # same directory is no conflict; a create of a name the host removed still is.
    started = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", "echo n > d/new.txt && echo b > d/b2.txt && touch m && sleep 60"],
    )
    with trio.fail_after(30):
        while True:  # the command made `m` in its layer: it wrote the rest before
            if _in_a_layer(env.daemon.config.state_dir, "m"):
                break
            await trio.sleep(0.02)
    as_owner_write(env.path / "d" / ".x.swp", "saved\n")
    os.rename(env.path / "d" / ".x.swp", env.path / "d" / "x.txt")
    as_owner_write(env.path / "d" / "b2.txt", "person's\n")
    (env.path / "d" / "b2.txt").unlink()
    await env.client.call("proc.signal", proc=started["proc"], signal="TERM")
    result = await env.client.call("proc.wait", proc=started["proc"])
    changes = result["changes"]
    assert sorted(e["path"] for e in changes["applied"]) == ["d/new.txt", "m"]
    assert [(e["path"], e["reason"]) for e in changes["conflicts"]] == [
        ("d/b2.txt", "host_changed")
    ]
    assert (env.path / "d" / "new.txt").read_text() == "n\n"
    assert (env.path / "d" / "x.txt").read_text() == "saved\n"
    assert not (env.path / "d" / "b2.txt").exists()


async def test_a_guarded_write_then_a_chmod_in_the_sandbox_applies(env: Env) -> None:
    # A file substrate itself wrote into the checkout (fs.write) while the sandbox lived
    # is the checkout as the next command starts: its chmod there is a change of the
    # command's, applied, never a `host_changed` conflict.
    await env.look()
    await env.client.call(
        "fs.write", workspace=env.ws, path="f.txt", base_sha256=None, content="made\n"
    )
    result = await env.sh("chmod a-w f.txt")
    assert result["exit_code"] == 0
    changes = result["changes"]
    assert changes["counts"]["conflicts"] == 0, changes
    assert [c["path"] for c in changes["applied"]] == ["f.txt"]
    assert (env.path / "f.txt").stat().st_mode & 0o222 == 0


async def test_a_host_edit_after_a_guarded_write_is_still_a_conflict(env: Env) -> None:
    await env.look()
    await env.client.call(
        "fs.write", workspace=env.ws, path="f.txt", base_sha256=None, content="made\n"
    )
    started = await env.client.call(
        "proc.start", workspace=env.ws, profile="layer",
        argv=["sh", "-c", "cat f.txt >/dev/null; sleep 2; chmod a-w f.txt"],
    )  # fmt: skip
    await trio.sleep(0.5)
    as_owner_write(env.path / "f.txt", "the person's\n")  # while the command sleeps
    result = await env.client.call("proc.wait", proc=started["proc"])
    changes = result["changes"]
    assert [c["path"] for c in changes["conflicts"]] == ["f.txt"], changes
    assert (env.path / "f.txt").read_text() == "the person's\n"
