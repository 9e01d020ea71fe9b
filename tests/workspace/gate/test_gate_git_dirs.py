"""The write gate and what host git would discover (docs/write-gate.md, "Git directories").

A directory that became a git directory by content during a command (`discoverable`:
`HEAD` + `objects` + `refs`, or `HEAD` + `commondir`, under any name) is undone like a
denied creation: the pieces the sandbox added are removed, nothing else. A repository
that was there before the command stays, and what the sandbox changes inside it is
reverted as inside `.git`. Every `.git` at any depth (directory, file, symlink) is
write-denied for sandboxed code as for guarded writes (`policy.is_git_path`).

The "command" is the test changing files between `before` and `after`; who made each
change is either everyone-is-the-sandbox or a fake attribution source that the test
tells, as the kernel would (see test_gate_attribution.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from substrate.config import Config
from substrate.schema.proc import PolicyBlocked
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import discoverable
from substrate.workspace.gate import (
    EVERY_CHANGE_IS_THE_SANDBOXS,
    GitContent,
    SnapshotGate,
    Touches,
)
from substrate.workspace.gate.attribution import Attribution, Key, handle_at, key
from substrate.workspace.registry import Workspace, WorkspaceRegistry

FSMONITOR = "[core]\n\tfsmonitor = touch /tmp/MARKER\n"
BARE = {
    "HEAD": "ref: refs/heads/main\n",
    "objects/info/packs": "",
    "refs/heads/main": "0" * 40 + "\n",
    "config": "[core]\n\tbare = true\n",
}


@dataclass
class FakeWatch:
    sandbox: set[Key] = field(default_factory=set)
    others: set[Key] = field(default_factory=set)

    def touches(self) -> Touches:
        return Touches(frozenset(self.sandbox), frozenset(self.others))

    def close(self) -> None:
        return None


@dataclass
class FakeAttribution:
    watches: list[FakeWatch] = field(default_factory=list)

    def watch(self, root_fd: int, sandbox_pid: int | None) -> FakeWatch:
        self.watches.append(FakeWatch())
        return self.watches[-1]


@dataclass
class Env:
    root: Path
    ws: Workspace
    gate: SnapshotGate
    journal: Journal
    source: FakeAttribution | None

    async def around(self, command: Callable[[Path], object]) -> list[PolicyBlocked]:
        ticket = await self.gate.before(self.ws, sandbox_pid=1)
        command(self.root)
        return await self.gate.after(self.ws, ticket)

    def saw(self, rel: str, *, sandbox: bool) -> None:
        """Tell the fake source that the sandbox (or someone else) touched `rel`."""
        assert self.source is not None
        parent, _, name = rel.rpartition("/")
        fd = os.open(self.root / parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            found = handle_at(fd)
        finally:
            os.close(fd)
        assert found is not None
        watch = self.source.watches[-1]
        (watch.sandbox if sandbox else watch.others).add(key(found, name))

    def entries(self) -> dict[str, dict[str, object]]:
        return {
            str(e.data["path"]): e.data
            for e in self.journal.read(limit=1000)
            if e.kind == "policy.blocked"
        }


def _env(
    adopt_root: Path,
    tmp_path: Path,
    root: Path,
    policy: Policy | None,
    source: FakeAttribution | None,
) -> Iterator[Env]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(
        Config(state_dir=str(state), adopt_roots=[str(adopt_root)]), store, journal, state
    )
    ws = registry.adopt(str(root), None, policy, "test")
    attribution: Attribution = source if source is not None else EVERY_CHANGE_IS_THE_SANDBOXS
    try:
        yield Env(
            root,
            ws,
            SnapshotGate(state / "gate", journal, attribution=attribution),
            journal,
            source,
        )
    finally:
        registry.close()
        store.close()


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    """The default policy (only `.git/**`), `.git` present: what the shipped rw profiles
    run against."""
    root = make_workspace("gd", {"src/main.py": "print(1)\n", "tools/README": "mine\n"}, git=True)
    yield from _env(adopt_root, tmp_path, root, None, None)


@pytest.fixture
def attributed(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> Iterator[Env]:
    root = make_workspace("gd", {"src/main.py": "print(1)\n"}, git=True)
    yield from _env(adopt_root, tmp_path, root, Policy(write_deny=["*.lock"]), FakeAttribution())


def outcome(blocked: list[PolicyBlocked]) -> list[tuple[str, str, bool, str, str | None]]:
    return sorted((b.path, b.change, b.reverted, b.rule, b.reason) for b in blocked)


def gone(path: Path) -> bool:
    return not os.path.lexists(path)


def is_git_dir(path: Path) -> bool:
    return discoverable.completes(set(os.listdir(path)))


def plant(root: Path, where: str = "tools") -> None:
    """What the finding's command did: HEAD, objects/, refs/ and a config that runs a
    command, written into `where`."""
    d = root / where
    (d / "objects" / "ab").mkdir(parents=True, exist_ok=True)
    (d / "objects" / "ab" / "cdef").write_bytes(b"blob")
    (d / "refs" / "heads").mkdir(parents=True, exist_ok=True)
    (d / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "config").write_text(FSMONITOR)


def repo(root: Path, where: str) -> None:
    """A bare repository by content at `where`, made on the host, owned by the owner."""
    for rel, text in BARE.items():
        path = root / where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for base, dirs, files in os.walk(root / where):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(base, name), 1000, 1000)


# --- the rule per directory (pure) ------------------------------------------------------------


def test_git_content_per_directory() -> None:
    baseline = GitContent()
    assert baseline.entries("", ["src", "HEAD"]) == frozenset()
    assert baseline.entries("repo", ["HEAD", "objects", "refs", "config"]) is None
    assert baseline.entries("wt", ["HEAD", "commondir"]) is None
    assert baseline.git_dir_of("repo/config") == "repo"
    assert baseline.git_dir_of("src/main.py") is None
    after = GitContent(baseline.pieces)
    # The root held HEAD: only what completes it now is denied.
    assert after.entries("", ["src", "HEAD", "objects", "refs"]) == {"objects", "refs"}
    assert after.entries("repo", ["config"]) is None  # a repository then: all of it, still
    assert after.entries("new", ["HEAD", "refs"]) == frozenset()  # not complete
    assert after.git_dir_of("objects/ab/cd") == ""
    assert after.git_dir_of("HEAD") is None
    assert after.git_dir_of("repo/hooks/x") == "repo"


# --- a git directory by content the command made -------------------------------------------


async def test_a_git_dir_by_content_the_command_made_is_undone_with_the_default_policy(
    env: Env,
) -> None:
    # The finding: `tools/` made a repository by content; host git run in it would run
    # `core.fsmonitor`. With only `.git/**` denied the gate used to take no snapshot.
    def command(root: Path) -> None:
        plant(root)
        (root / "tools" / "build.sh").write_text("make\n")
        (root / "src" / "new.py").write_text("fine\n")

    blocked = await env.around(command)
    assert outcome(blocked) == [
        ("gd:tools/HEAD", "create", True, "write_deny", "git_dir"),
        ("gd:tools/objects", "create", True, "write_deny", "git_dir"),
        ("gd:tools/refs", "create", True, "write_deny", "git_dir"),
    ]
    assert not is_git_dir(env.root / "tools")
    fd = os.open(env.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert discoverable.GitDirs(fd).beneath(("tools", "config")) is None
    finally:
        os.close(fd)
    # Everything else the command wrote is an ordinary file again, and stays.
    assert (env.root / "tools" / "config").read_text() == FSMONITOR
    assert (env.root / "tools" / "build.sh").read_text() == "make\n"
    assert (env.root / "tools" / "README").read_text() == "mine\n"
    assert (env.root / "src" / "new.py").read_text() == "fine\n"
    entries = env.entries()
    assert {e["reason"] for e in entries.values()} == {"git_dir"}
    assert {e["git_dir"] for e in entries.values()} == {"gd:tools"}
    assert entries["gd:tools/HEAD"]["before"] is None


async def test_only_the_pieces_the_command_added_are_removed(env: Env) -> None:
    # `tools/refs/` was the person's (a directory of that name, not a repository): the
    # command completed it with HEAD and objects/. Removing those two is enough.
    (env.root / "tools" / "refs").mkdir()
    (env.root / "tools" / "refs" / "notes.txt").write_text("the person's\n")

    def command(root: Path) -> None:
        (root / "tools" / "HEAD").write_text("ref: refs/heads/main\n")
        (root / "tools" / "objects").mkdir()

    blocked = await env.around(command)
    assert outcome(blocked) == [
        ("gd:tools/HEAD", "create", True, "write_deny", "git_dir"),
        ("gd:tools/objects", "create", True, "write_deny", "git_dir"),
    ]
    assert (env.root / "tools" / "refs" / "notes.txt").read_text() == "the person's\n"
    assert not is_git_dir(env.root / "tools")


async def test_a_worktree_admin_dir_and_a_nested_one_are_undone(env: Env) -> None:
    # HEAD + commondir is the other form; a directory deep down counts like any.
    def command(root: Path) -> None:
        (root / "a" / "b").mkdir(parents=True)
        (root / "a" / "b" / "HEAD").write_text("x\n")
        (root / "a" / "b" / "commondir").write_text("../../.git\n")

    blocked = await env.around(command)
    assert outcome(blocked) == [
        ("gd:a/b/HEAD", "create", True, "write_deny", "git_dir"),
        ("gd:a/b/commondir", "create", True, "write_deny", "git_dir"),
    ]
    assert os.listdir(env.root / "a" / "b") == []


async def test_the_checkout_root_made_a_bare_repository_is_undone(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> None:
    root = make_workspace("plain", {"a.txt": "a\n"})
    for env in _env(adopt_root, tmp_path, root, None, None):
        blocked = await env.around(plant_root)
        assert outcome(blocked) == [
            ("plain:HEAD", "create", True, "write_deny", "git_dir"),
            ("plain:objects", "create", True, "write_deny", "git_dir"),
            ("plain:refs", "create", True, "write_deny", "git_dir"),
        ]
        assert not is_git_dir(root)
        assert {e["git_dir"] for e in env.entries().values()} == {"plain:."}


def plant_root(root: Path) -> None:
    plant(root, ".")


# --- a repository that was there before the command -----------------------------------------


async def test_a_repository_that_was_there_stays_and_is_guarded_inside(env: Env) -> None:
    # Made on the host after the sandbox was created (so not mounted read-only in it):
    # the gate's baseline holds it. It stays; what the command changes in it is undone.
    repo(env.root, "fixtures/bare")
    assert await env.around(lambda root: None) == []
    assert is_git_dir(env.root / "fixtures" / "bare")

    def command(root: Path) -> None:
        (root / "fixtures" / "bare" / "config").write_text(FSMONITOR)
        (root / "fixtures" / "bare" / "hooks").mkdir()
        (root / "fixtures" / "bare" / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
        (root / "fixtures" / "bare" / "HEAD").unlink()

    blocked = await env.around(command)
    assert outcome(blocked) == [
        ("gd:fixtures/bare/HEAD", "delete", True, "write_deny", "git_dir"),
        ("gd:fixtures/bare/config", "modify", True, "write_deny", "git_dir"),
        ("gd:fixtures/bare/hooks", "create", True, "write_deny", "git_dir"),
    ]
    bare = env.root / "fixtures" / "bare"
    assert {rel: (bare / rel).read_text() for rel in BARE} == BARE
    assert not (bare / "hooks").exists()
    assert is_git_dir(bare)


async def test_a_repository_moved_away_whole_is_not_taken_for_a_new_one(env: Env) -> None:
    # A directory removed and another made at its name: only names new *at that path*
    # count, so a repository that was there keeps being one, whatever the command did
    # with its own files (here nothing: it was moved out and back).
    repo(env.root, "fixtures/bare")

    def command(root: Path) -> None:
        os.rename(root / "fixtures" / "bare", root / "fixtures" / "away")
        os.rename(root / "fixtures" / "away", root / "fixtures" / "bare")

    assert await env.around(command) == []
    assert is_git_dir(env.root / "fixtures" / "bare")


# --- attribution: only what the sandbox made ------------------------------------------------


async def test_a_repository_the_person_made_during_the_command_stays(attributed: Env) -> None:
    env = attributed
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    # The person runs `git init --bare mine` on the host while the command runs...
    repo(env.root, "mine")
    for piece in ("HEAD", "objects", "refs", "config"):
        env.saw(f"mine/{piece}", sandbox=False)
    # ... and the sandbox plants one in `tools/`.
    plant(env.root)
    for piece in ("HEAD", "objects", "refs", "config"):
        env.saw(f"tools/{piece}", sandbox=True)
    env.saw("tools/objects/ab", sandbox=True)
    env.saw("tools/objects/ab/cdef", sandbox=True)
    env.saw("tools/refs/heads", sandbox=True)
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [
        ("gd:mine/HEAD", "create", False, "write_deny", "unattributed"),
        ("gd:mine/objects", "create", False, "write_deny", "unattributed"),
        ("gd:mine/refs", "create", False, "write_deny", "unattributed"),
        ("gd:tools/HEAD", "create", True, "write_deny", "git_dir"),
        ("gd:tools/objects", "create", True, "write_deny", "git_dir"),
        ("gd:tools/refs", "create", True, "write_deny", "git_dir"),
    ]
    assert is_git_dir(env.root / "mine")
    assert {rel: (env.root / "mine" / rel).read_text() for rel in BARE} == BARE
    assert not is_git_dir(env.root / "tools")
    entries = env.entries()
    assert entries["gd:mine/HEAD"]["git_dir"] == "gd:mine"
    assert entries["gd:mine/HEAD"]["attribution"] == "changed outside"


async def test_a_piece_the_person_put_in_the_sandboxs_objects_keeps_it(attributed: Env) -> None:
    # Removing `tools/objects` would delete the person's file in it: that piece is
    # `mixed` and kept; the sandbox's HEAD alone goes, and that is enough.
    env = attributed
    ticket = await env.gate.before(env.ws, sandbox_pid=1)
    plant(env.root)
    for piece in ("HEAD", "objects", "refs", "config"):
        env.saw(f"tools/{piece}", sandbox=True)
    env.saw("tools/refs/heads", sandbox=True)
    env.saw("tools/objects/ab", sandbox=True)
    env.saw("tools/objects/ab/cdef", sandbox=False)
    blocked = await env.gate.after(env.ws, ticket)
    assert outcome(blocked) == [
        ("gd:tools/HEAD", "create", True, "write_deny", "git_dir"),
        ("gd:tools/objects", "create", False, "write_deny", "mixed"),
        ("gd:tools/refs", "create", True, "write_deny", "git_dir"),
    ]
    assert (env.root / "tools" / "objects" / "ab" / "cdef").read_bytes() == b"blob"
    assert not is_git_dir(env.root / "tools")


# --- `.git` at any depth: directory, file, symlink -------------------------------------------


async def test_a_git_name_the_command_made_at_any_depth_is_removed(
    env: Env, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def command(root: Path) -> None:
        (root / "sub").mkdir()
        os.symlink(elsewhere, root / "sub" / ".git")  # a symlink named .git
        (root / "lib").mkdir()
        (root / "lib" / ".git").write_text("gitdir: /home/agent/planted\n")  # a .git file
        (root / "vendor" / "x" / ".git" / "hooks").mkdir(parents=True)  # a nested .git dir
        (root / "vendor" / "x" / "main.c").write_text("int main;\n")

    blocked = await env.around(command)
    assert outcome(blocked) == [
        ("gd:lib/.git", "create", True, "write_deny", None),
        ("gd:sub/.git", "create", True, "write_deny", None),
        ("gd:vendor/x/.git", "create", True, "write_deny", None),
    ]
    assert gone(env.root / "sub" / ".git")
    assert gone(env.root / "lib" / ".git")
    assert gone(env.root / "vendor" / "x" / ".git")
    assert (env.root / "vendor" / "x" / "main.c").read_text() == "int main;\n"
    assert elsewhere.is_dir()  # a symlink is removed, never followed


async def test_a_root_git_symlink_or_file_the_command_made_is_removed(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> None:
    root = make_workspace("nogit", {"a.txt": "a\n"})
    for env in _env(adopt_root, tmp_path, root, None, None):
        blocked = await env.around(lambda r: os.symlink("/home/agent/repo", r / ".git"))
        assert outcome(blocked) == [("nogit:.git", "create", True, "write_deny", None)]
        assert gone(root / ".git")
        blocked = await env.around(lambda r: (r / ".git").write_text("gitdir: ../x\n"))
        assert outcome(blocked) == [("nogit:.git", "create", True, "write_deny", None)]
        assert gone(root / ".git")
