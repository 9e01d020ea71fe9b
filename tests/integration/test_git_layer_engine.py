"""The git layer against the real engine (docs/working-layer.md, "The git layer").

A daemon runs in-process with the shipped `default` profile (a working layer; `.git`
writable through the checkout's git layer, `git_refs_allow = ["refs/heads/agent/**"]`,
`git_identity`) on a uid-1000 checkout holding a real repository the test made with the
host's git (hooks off: `-c core.hooksPath=/dev/null`, run by the test, never by
substrate). Inside the sandbox the agent branches, commits, stashes; what leaves the
git layer is new objects (verified) and ref moves, as `ref` entries of the change set.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.config import Config
from substrate.protocol.client import AsyncClient, open_client
from tests.harness.inprocess import in_process_config, profiles_dir, serving
from tests.harness.workspaces import chown_tree

HOST_GIT = ["git", "-c", "core.hooksPath=/dev/null", "-c", "safe.directory=*"]


def host_git(path: Path, *args: str) -> str:
    """The host's git on the test's own repository (hooks off), its stdout."""
    done = subprocess.run(
        [*HOST_GIT, "-C", str(path), *args], check=True, capture_output=True, text=True
    )
    return done.stdout


def host_has(path: Path, oid: str) -> bool:
    """Does the host's object store hold `oid`?"""
    done = subprocess.run([*HOST_GIT, "-C", str(path), "cat-file", "-e", oid], capture_output=True)
    return done.returncode == 0


def make_repo(path: Path) -> None:
    path.mkdir(parents=True)
    host_git(path, "init", "-q", "-b", "main")
    (path / "app.py").write_text("print('hi')\n")
    host_git(path, "add", "app.py")
    host_git(
        path, "-c", "user.name=Person", "-c", "user.email=p@example.com", "commit", "-qm", "first"
    )
    chown_tree(path)


@dataclass
class Env:
    client: AsyncClient
    operator: AsyncClient
    ws: str
    path: Path
    state: Path

    async def sh(self, script: str, **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile="default", argv=["sh", "-c", script], **params
        )

    def head_of(self, ref: str) -> str:
        return host_git(self.path, "rev-parse", ref).strip()


def _config(state: Path, tmp_path: Path) -> Config:
    profiles = tmp_path / "profiles"
    if not profiles.exists():
        profiles_dir(profiles, ["default"])
    return in_process_config(state, tmp_path / "roots", profiles)


@pytest.fixture
async def env(sandbox_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    project = tmp_path / "roots" / "project"
    make_repo(project)
    config = _config(engine_state, tmp_path)
    async with (
        serving(config),
        open_client(engine_state / "substrate.sock") as client,
        open_client(engine_state / "operator.sock") as operator,
    ):
        ws = await client.call("workspace.adopt", path=str(project))
        made = Env(client, operator, ws["workspace"], project, engine_state)
        yield made
        await client.call("workspace.release", workspace=made.ws)


def _out(result: Any) -> str:
    return str(result["stdout"]["inline"])


async def test_an_agent_branch_commit_lands_on_the_host(env: Env) -> None:
    main_before = env.head_of("main")
    head_before = (env.path / ".git" / "HEAD").read_text()
    result = await env.sh(
        "git checkout -q -b agent/fix && echo fixed > app.py && git add app.py"
        " && git commit -qm 'fix the app' && git log --format=%s -1"
    )
    assert result["exit_code"] == 0, result["stderr"]
    assert _out(result) == "fix the app\n"
    applied = [e for e in result["changes"]["applied"] if e["op"] == "ref"]
    assert [e["path"] for e in applied] == ["refs/heads/agent/fix"]
    assert "old_oid" not in applied[0]  # created
    assert host_git(env.path, "log", "--format=%s", "-1", "agent/fix") == "fix the app\n"
    host_git(env.path, "fsck", "--strict", "--no-dangling")
    assert env.head_of("main") == main_before
    assert (env.path / ".git" / "HEAD").read_text() == head_before
    # The working tree's edit lands as a file change, as any command's does.
    assert [e["path"] for e in result["changes"]["applied"] if e["op"] != "ref"] == ["app.py"]
    # The agent's own view lasts: the next command is still on its branch.
    again = await env.sh("git rev-parse --abbrev-ref HEAD && git log --format=%s -1")
    assert _out(again) == "agent/fix\nfix the app\n"
    author = await env.sh("git log --format=%an/%cn -1")
    assert _out(author) == "substrate agent/substrate agent\n"


async def test_a_commit_on_the_persons_branch_waits_for_changes_apply(env: Env) -> None:
    before = env.head_of("main")
    result = await env.sh("echo more >> app.py && git commit -qam 'on main'")
    assert result["exit_code"] == 0, result["stderr"]
    changes = result["changes"]
    blocked = [e for e in changes["blocked"] if e.get("op") == "ref"]
    assert [(e["path"], e["reason"]) for e in blocked] == [("refs/heads/main", "ref_denied")]
    assert env.head_of("main") == before
    kept = await env.client.call("changes.get", changeset=changes["changeset"])
    refs = [c for c in kept["changes"] if c["op"] == "ref"]
    assert refs[0]["subjects"] == ["on main"] and refs[0]["old_oid"] == before
    # The agent cannot apply a denied ref; the operator can.
    denied = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert [e["reason"] for e in denied["blocked"] if e.get("op") == "ref"] == ["ref_denied"]
    assert env.head_of("main") == before
    done = await env.operator.call("changes.apply", changeset=changes["changeset"])
    assert [e["path"] for e in done["applied"] if e.get("op") == "ref"] == ["refs/heads/main"]
    assert host_git(env.path, "log", "--format=%s", "-1", "main") == "on main\n"
    host_git(env.path, "fsck", "--strict", "--no-dangling")


async def test_a_host_commit_on_the_same_ref_meanwhile_is_a_conflict(env: Env) -> None:
    first = await env.sh("git checkout -q -b agent/x && git commit -q --allow-empty -m one")
    assert first["exit_code"] == 0, first["stderr"]
    host_git(env.path, "branch", "-f", "agent/x", "main")  # the person moves it back
    second = await env.sh("git commit -q --allow-empty -m two")
    conflicts = [e for e in second["changes"]["conflicts"] if e.get("op") == "ref"]
    assert [(e["path"], e["reason"]) for e in conflicts] == [("refs/heads/agent/x", "host_changed")]
    assert env.head_of("agent/x") == env.head_of("main")


async def test_a_hook_written_in_the_sandbox_never_reaches_the_host(env: Env) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="default")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    # `.git` is the git layer's overlay, observed from inside: not a read-only part.
    assert ".git" not in facts["readonly_dirs"]
    assert facts["workspace_identity:.git"] != facts["workspace_identity"]
    result = await env.sh(
        "printf '#!/bin/sh\\ntouch /tmp/x\\n' > .git/hooks/pre-commit"
        " && chmod +x .git/hooks/pre-commit && git config core.fsmonitor 'touch MARKER'"
        " && ls .git/hooks/pre-commit"
    )
    assert result["exit_code"] == 0, result["stderr"]
    assert not (env.path / ".git" / "hooks" / "pre-commit").exists()
    assert "fsmonitor" not in (env.path / ".git" / "config").read_text()
    assert result["changes"]["counts"]["applied"] == 0


async def test_stash_and_pop_work_across_commands(env: Env) -> None:
    stashed = await env.sh("echo wip >> app.py && git stash -q && cat app.py")
    assert stashed["exit_code"] == 0, stashed["stderr"]
    assert _out(stashed) == "print('hi')\n"
    popped = await env.sh("git stash pop -q && cat app.py")
    assert popped["exit_code"] == 0, popped["stderr"]
    assert _out(popped) == "print('hi')\nwip\n"
    # The stash ref moved in the layer only (refs/stash is not an agent branch).
    assert "refs/stash" not in host_git(env.path, "for-each-ref", "--format=%(refname)")


async def test_release_without_keep_git_drops_the_layer(env: Env) -> None:
    await env.sh("git checkout -q -b agent/gone")
    info = await env.client.call("workspace.info", workspace=env.ws)
    assert info["git_layer"]["bytes"] > 0
    released = await env.client.call("workspace.release", workspace=env.ws, keep_git=False)
    assert released["git"] == "removed"
    again = await env.client.call("workspace.adopt", path=str(env.path))
    env.ws = again["workspace"]
    result = await env.sh("git rev-parse --abbrev-ref HEAD")
    assert _out(result) == "main\n"


async def test_a_forged_object_is_refused_and_its_ref_never_moves(env: Env) -> None:
    # The commit's loose object is replaced by another object's bytes: its name no
    # longer hashes from its content.
    script = (
        "git checkout -q -b agent/forge && git commit -q --allow-empty -m forged"
        " && c=$(git rev-parse HEAD) && t=$(git rev-parse HEAD^{tree})"
        " && o=.git/objects && cp -f $o/$(echo $t | cut -c1-2)/$(echo $t | cut -c3-)"
        " $o/$(echo $c | cut -c1-2)/$(echo $c | cut -c3-) && echo $c"
    )
    result = await env.sh(script)
    assert result["exit_code"] == 0, result["stderr"]
    forged = _out(result).strip()
    blocked = [e for e in result["changes"]["blocked"] if e.get("op") == "ref"]
    assert [(e["path"], e["reason"]) for e in blocked] == [
        ("refs/heads/agent/forge", "missing_object")
    ]
    assert not host_has(env.path, forged)
    assert "agent/forge" not in host_git(env.path, "branch", "--list")
    host_git(env.path, "fsck", "--strict", "--no-dangling")


async def test_review_keeps_ref_entries_pending_and_discard_drops_them(env: Env) -> None:
    reviewed = await env.sh(
        "git checkout -q -b agent/r && git commit -q --allow-empty -m r", changes="review"
    )
    pending = [e for e in reviewed["changes"]["pending"] if e.get("op") == "ref"]
    assert [e["path"] for e in pending] == ["refs/heads/agent/r"]
    assert "agent/r" not in host_git(env.path, "branch", "--list")
    done = await env.client.call("changes.apply", changeset=reviewed["changes"]["changeset"])
    assert [e["path"] for e in done["applied"] if e.get("op") == "ref"] == ["refs/heads/agent/r"]
    assert host_git(env.path, "log", "--format=%s", "-1", "agent/r") == "r\n"
    dropped = await env.sh("git commit -q --allow-empty -m d", changes="discard")
    assert dropped["changes"]["counts"]["applied"] == 0
    assert host_git(env.path, "log", "--format=%s", "-1", "agent/r") == "r\n"
    # The sandbox's own view keeps its commit; it is not offered again unless moved.
    view = await env.sh("git log --format=%s -1")
    assert _out(view) == "d\n" and view["changes"].get("changeset") is None


async def test_the_git_layer_lasts_across_a_daemon_restart(
    sandbox_image: str, engine_state: Path, tmp_path: Path
) -> None:
    project = tmp_path / "roots" / "project"
    make_repo(project)
    config = _config(engine_state, tmp_path)
    scripts = [
        "git checkout -q -b agent/keep && git commit -q --allow-empty -m kept",
        "git rev-parse --abbrev-ref HEAD && git log --format=%s -1",
    ]
    outputs = []
    for script in scripts:  # one daemon each, on the same state dir
        async with serving(config), open_client(engine_state / "substrate.sock") as client:
            ws = (await client.call("workspace.adopt", path=str(project)))["workspace"]
            result = await client.call(
                "proc.run", workspace=ws, profile="default", argv=["sh", "-c", script]
            )
            assert result["exit_code"] == 0, result["stderr"]
            outputs.append(_out(result))
            await client.call("workspace.release", workspace=ws)
    assert outputs[1] == "agent/keep\nkept\n"


async def test_refs_the_host_packs_later_are_not_read_as_the_sandboxs_moves(env: Env) -> None:
    host_git(env.path, "branch", "agent/old", "main")
    host_git(env.path, "pack-refs", "--all")
    host_git(env.path, "branch", "agent/keep", "main")  # loose: its directory stays
    # Deleting a packed branch makes the sandbox's own copy of packed-refs.
    gone = await env.sh("git branch -D agent/old")
    assert [(e["path"], e.get("new_oid")) for e in gone["changes"]["applied"]] == [
        ("refs/heads/agent/old", None)
    ]
    host_git(env.path, "branch", "agent/new", "main")
    seen = await env.sh("git branch --list 'agent/*'")
    assert _out(seen).split() == ["agent/keep", "agent/new"]  # the host's loose refs
    # Packed by the host now: the sandbox's older packed-refs hides them in its view.
    host_git(env.path, "pack-refs", "--all")
    after = await env.sh("git branch --list 'agent/*'")
    assert after["changes"].get("changeset") is None, after["changes"]
    assert env.head_of("agent/new") == env.head_of("agent/keep") == env.head_of("main")


async def test_a_git_file_gets_no_git_layer_and_stays_read_only(env: Env) -> None:
    worktree = env.path.parent / "worktree"
    worktree.mkdir()
    (worktree / ".git").write_text("gitdir: ../project/.git\n")
    (worktree / "a.txt").write_text("a\n")
    chown_tree(worktree)
    ws = (await env.client.call("workspace.adopt", path=str(worktree)))["workspace"]
    result = await env.client.call(
        "proc.run",
        workspace=ws,
        profile="default",
        argv=["sh", "-c", "echo x >> .git; echo $?"],
    )
    assert _out(result).strip() != "0"
    assert (worktree / ".git").read_text() == "gitdir: ../project/.git\n"
    entries = (await env.client.call("journal.read", limit=10000))["entries"]
    outcomes = [e["data"]["outcome"] for e in entries if e["kind"] == "layer.git"]
    assert outcomes == ["gitfile"]
    await env.client.call("workspace.release", workspace=ws)


async def test_a_ref_under_require_approval_waits_for_the_operators_grant(env: Env) -> None:
    await env.operator.call(
        "workspace.set_policy",
        workspace=env.ws,
        policy={"require_approval": [".git/refs/heads/agent/gated"]},
    )
    result = await env.sh("git checkout -q -b agent/gated && git commit -q --allow-empty -m g")
    pending = [e for e in result["changes"]["pending"] if e.get("op") == "ref"]
    assert [(e["path"], e["reason"]) for e in pending] == [
        ("refs/heads/agent/gated", "approval_required")
    ]
    cs = result["changes"]["changeset"]
    again = await env.client.call("changes.apply", changeset=cs)  # not granted yet
    assert [e["path"] for e in again["pending"]] == ["refs/heads/agent/gated"]
    assert "agent/gated" not in host_git(env.path, "branch", "--list")
    await env.operator.call(
        "approval.grant", workspace=env.ws, plan_digest=pending[0]["plan_digest"]
    )
    done = await env.client.call("changes.apply", changeset=cs)
    assert [e["path"] for e in done["applied"] if e.get("op") == "ref"] == [
        "refs/heads/agent/gated"
    ]
    assert host_git(env.path, "log", "--format=%s", "-1", "agent/gated") == "g\n"


def _baseline(env: Env) -> tuple[int, int]:
    """(inode, mtime) of the checkout's git-layer baseline (rewritten by a conclusion
    that found something, left as it is by one that did not)."""
    [found] = (env.state / "gitlayers").glob("*/baseline")
    st = found.stat()
    return st.st_ino, st.st_mtime_ns


async def test_commands_that_leave_git_alone_change_nothing_and_moves_still_land(
    env: Env,
) -> None:
    first = await env.sh(
        "git checkout -q -b agent/q && git commit -q --allow-empty -m one && git rev-parse HEAD"
    )
    assert first["exit_code"] == 0, first["stderr"]
    one = _out(first).strip()
    assert [e["path"] for e in first["changes"]["applied"]] == ["refs/heads/agent/q"]
    before = _baseline(env)
    for argv in ("true", "cat app.py", "git status --short"):
        quiet = await env.sh(argv)
        assert quiet["exit_code"] == 0, quiet["stderr"]
        assert quiet["changes"].get("changeset") is None, quiet["changes"]
    assert _baseline(env) == before  # not rewritten: nothing to conclude
    # A command that only runs `git commit`: its ref entry, as ever.
    second = await env.sh("git commit -q --allow-empty -m two")
    applied = [e for e in second["changes"]["applied"] if e["op"] == "ref"]
    assert [(e["path"], e["old_oid"]) for e in applied] == [("refs/heads/agent/q", one)]
    assert host_git(env.path, "log", "--format=%s", "-1", "agent/q") == "two\n"
    await env.sh("true")
    # The ref's file in the git layer written again in place (the same inode, no new
    # name in any directory): still the sandbox's move.
    back = await env.sh("c=$(git rev-parse HEAD~1) && echo $c > .git/refs/heads/agent/q")
    assert back["exit_code"] == 0, back["stderr"]
    moved = [e for e in back["changes"]["applied"] if e["op"] == "ref"]
    assert [(e["path"], e["new_oid"]) for e in moved] == [("refs/heads/agent/q", one)]
    assert env.head_of("agent/q") == one


async def test_a_ref_the_host_makes_between_quiet_commands_is_the_base_of_the_next_move(
    env: Env,
) -> None:
    for _ in range(2):
        await env.sh("true")
    host_git(env.path, "branch", "agent/h", "main")
    chown_tree(env.path / ".git")  # the person's own (this test's git runs as root)
    main = env.head_of("main")
    seen = await env.sh("git rev-parse agent/h")  # a command that writes nothing
    assert _out(seen).strip() == main and seen["changes"].get("changeset") is None
    # The sandbox's view then held the host's new ref: its move starts from there.
    moved = await env.sh("git checkout -q agent/h && git commit -q --allow-empty -m h")
    assert moved["exit_code"] == 0, moved["stderr"]
    assert not moved["changes"].get("conflicts"), moved["changes"]
    applied = [e for e in moved["changes"]["applied"] if e["op"] == "ref"]
    assert [(e["path"], e["old_oid"]) for e in applied] == [("refs/heads/agent/h", main)]
    assert host_git(env.path, "log", "--format=%s", "-1", "agent/h") == "h\n"
