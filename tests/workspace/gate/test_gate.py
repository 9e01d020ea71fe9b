"""substrate.workspace.gate without Docker: the walk, the kept bytes and revert on a real tree.

The pure diff is tested in test_gate_diff.py.

The "command" here is the test itself changing files between `before` and `after`, as a
sandboxed process would through the bind mount.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.config import Config
from substrate.fs import fsops
from substrate.schema.proc import PolicyBlocked
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import gate
from substrate.workspace.gate import EVERY_CHANGE_IS_THE_SANDBOXS, SnapshotGate, snapshot
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.writes import TEMP_PREFIX, TempFiles

OWNER = 1000
LOCK = b"# poetry lock\npackage = []\n"
DENY = ["*.lock", ".env", "secrets/*.pem", "build/"]


# --- the gate on a real tree -----------------------------------------------------------------


@dataclass
class Env:
    root: Path
    state: Path
    ws: Workspace
    gate: SnapshotGate
    journal: Journal
    registry: WorkspaceRegistry
    config: Config

    async def around(self, command: Callable[[Path], object]) -> list[PolicyBlocked]:
        ticket = await self.gate.before(self.ws)
        command(self.root)
        return await self.gate.after(self.ws, ticket)

    def blocked_entries(self) -> list[dict[str, object]]:
        return [e.data for e in self.journal.read(limit=1000) if e.kind == "policy.blocked"]


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    root = make_workspace(
        "gated",
        {"poetry.lock": LOCK, "src/main.py": "print(1)\n", "secrets/k.pem": "KEY\n"},
        git=True,
    )
    os.chmod(root / "poetry.lock", 0o640)
    os.utime(root / "poetry.lock", ns=(1_000_000_000, 1_000_000_000))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(root), None, Policy(write_deny=DENY), "test")
    try:
        yield Env(
            root,
            state,
            ws,
            SnapshotGate(state / "gate", journal, attribution=EVERY_CHANGE_IS_THE_SANDBOXS),
            journal,
            registry,
            config,
        )
    finally:
        registry.close()
        store.close()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def as_owner(path: Path) -> None:
    os.chown(path, OWNER, OWNER, follow_symlinks=False)


def changes(blocked: list[PolicyBlocked]) -> list[tuple[str, str, bool]]:
    return sorted((b.path, b.change, b.reverted) for b in blocked)


async def test_nothing_changed_nothing_blocked(env: Env) -> None:
    assert await env.around(lambda root: (root / "src" / "main.py").write_text("x\n")) == []
    assert env.blocked_entries() == []


async def test_creations_are_removed_allowed_files_stay(env: Env) -> None:
    def command(root: Path) -> None:
        (root / ".env").write_text("TOKEN=hunter2\n")
        (root / "sub").mkdir()
        (root / "sub" / "new.lock").write_text("x")
        (root / "build").mkdir()
        (root / "build" / "out.o").write_bytes(b"\0")
        (root / "allowed.txt").write_text("fine\n")

    blocked = await env.around(command)
    assert changes(blocked) == [
        ("gated:.env", "create", True),
        ("gated:build", "create", True),
        ("gated:sub/new.lock", "create", True),
    ]
    assert not (env.root / ".env").exists()
    assert not (env.root / "build").exists()
    assert not (env.root / "sub" / "new.lock").exists()
    assert (env.root / "allowed.txt").read_text() == "fine\n"
    entries = env.blocked_entries()
    assert {e["path"] for e in entries} == {b.path for b in blocked}
    assert "hunter2" not in json.dumps(entries)  # digests, never bytes
    dotenv = next(e for e in entries if e["path"] == "gated:.env")
    assert dotenv["before"] is None
    assert dotenv["after"]["sha256"] == hashlib.sha256(b"TOKEN=hunter2\n").hexdigest()  # type: ignore[index]


async def test_modify_is_restored_byte_for_byte_with_owner_mode_mtime(env: Env) -> None:
    lock = env.root / "poetry.lock"
    before = os.stat(lock)

    def command(root: Path) -> None:
        (root / "poetry.lock").write_text("tampered\n")
        os.chmod(root / "poetry.lock", 0o666)

    blocked = await env.around(command)
    assert changes(blocked) == [("gated:poetry.lock", "modify", True)]
    after = os.stat(lock)
    assert lock.read_bytes() == LOCK
    assert stat.S_IMODE(after.st_mode) == 0o640
    assert (after.st_uid, after.st_gid) == (OWNER, OWNER)
    assert after.st_mtime_ns == before.st_mtime_ns


async def test_replace_by_rename_and_by_a_directory(env: Env) -> None:
    def command(root: Path) -> None:
        (root / "tmp").write_text("other\n")
        os.rename(root / "tmp", root / "poetry.lock")
        (root / "secrets" / "k.pem").unlink()
        (root / "secrets" / "k.pem").mkdir()
        (root / "secrets" / "k.pem" / "inner").write_text("x")

    blocked = await env.around(command)
    assert changes(blocked) == [
        ("gated:poetry.lock", "modify", True),
        ("gated:secrets/k.pem", "modify", True),
    ]
    assert (env.root / "poetry.lock").read_bytes() == LOCK
    assert (env.root / "secrets" / "k.pem").read_text() == "KEY\n"


async def test_delete_is_restored_even_with_its_directory(env: Env) -> None:
    def command(root: Path) -> None:
        (root / "poetry.lock").unlink()
        (root / "secrets" / "k.pem").unlink()
        (root / "secrets").rmdir()

    blocked = await env.around(command)
    assert changes(blocked) == [
        ("gated:poetry.lock", "delete", True),
        ("gated:secrets/k.pem", "delete", True),
    ]
    assert (env.root / "poetry.lock").read_bytes() == LOCK
    assert stat.S_IMODE(os.stat(env.root / "poetry.lock").st_mode) == 0o640
    assert (env.root / "secrets" / "k.pem").read_text() == "KEY\n"
    assert os.stat(env.root / "secrets").st_uid == OWNER  # the re-made parent is the owner's


async def test_chmod_is_restored(env: Env) -> None:
    blocked = await env.around(lambda root: os.chmod(root / "poetry.lock", 0o4755))
    assert changes(blocked) == [("gated:poetry.lock", "chmod", True)]
    assert stat.S_IMODE(os.stat(env.root / "poetry.lock").st_mode) == 0o640
    assert (env.root / "poetry.lock").read_bytes() == LOCK


async def test_symlinks_at_denied_names_are_removed_never_followed(
    env: Env, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("outside\n")

    def command(root: Path) -> None:
        os.symlink(outside, root / ".env")
        as_owner(root / ".env")
        (root / "poetry.lock").unlink()
        os.symlink(outside, root / "poetry.lock")

    blocked = await env.around(command)
    assert changes(blocked) == [
        ("gated:.env", "create", True),
        ("gated:poetry.lock", "modify", True),
    ]
    assert not (env.root / ".env").is_symlink()
    assert not (env.root / "poetry.lock").is_symlink()
    assert (env.root / "poetry.lock").read_bytes() == LOCK
    assert outside.read_text() == "outside\n"


async def test_git_dir_is_left_to_the_read_only_mount_but_a_new_one_is_removed(
    env: Env, adopt_root: Path, make_workspace: Callable[..., Path]
) -> None:
    # .git exists: bound read-only in sandboxes, so the gate does not walk it.
    blocked = await env.around(lambda root: (root / ".git" / "x").write_text("x"))
    assert blocked == []
    (env.root / ".git" / "x").unlink()
    # Gone before the command (nothing was mounted): creating it is blocked.
    os.rename(env.root / ".git", env.root / "git-away")
    blocked = await env.around(lambda root: (root / ".git" / "hooks").mkdir(parents=True))
    assert changes(blocked) == [("gated:.git", "create", True)]
    assert not (env.root / ".git").exists()


async def test_too_large_to_keep_is_reported_not_reverted(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "MAX_KEPT_FILE", 4)
    blocked = await env.around(lambda root: (root / "poetry.lock").write_text("tampered\n"))
    assert changes(blocked) == [("gated:poetry.lock", "modify", False)]
    (entry,) = env.blocked_entries()
    assert "not restored" in str(entry["reason"])


async def test_overlapping_commands_share_one_baseline(env: Env) -> None:
    first = await env.gate.before(env.ws)
    (env.root / "poetry.lock").write_text("written by the first\n")
    second = await env.gate.before(env.ws)  # must not take the tampered file as its base
    (env.root / ".env").write_text("by the second\n")
    blocked = await env.gate.after(env.ws, first)
    assert changes(blocked) == [
        ("gated:.env", "create", True),
        ("gated:poetry.lock", "modify", True),
    ]
    assert await env.gate.after(env.ws, second) == []
    assert (env.root / "poetry.lock").read_bytes() == LOCK


async def test_kept_bytes_are_private_and_collected(env: Env) -> None:
    await env.around(lambda root: None)
    store = env.state / "gate" / env.ws.id
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert sorted(os.listdir(store)) == sorted(
        {sha(env.root / "poetry.lock"), sha(env.root / "secrets" / "k.pem")}
    )
    # Changed on the host between commands: the new bytes are the baseline, the old go.
    (env.root / "poetry.lock").write_bytes(b"new lock\n")
    assert await env.around(lambda root: None) == []
    assert sha(env.root / "poetry.lock") in os.listdir(store)
    assert hashlib.sha256(LOCK).hexdigest() not in os.listdir(store)


async def test_default_policy_walks_but_reads_nothing_while_git_is_a_mounted_dir(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> None:
    # Only `.git/**` denied and `.git` exists: the read-only mount enforces it, so the
    # walk reads and keeps no file. It still runs (a directory may become a git
    # directory by content: test_gate_git_dirs.py). Without `.git`, creating one is caught.
    root = make_workspace("plain", {"a.txt": "a\n"}, git=True)
    state = tmp_path / "state2"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(
        Config(state_dir=str(state), adopt_roots=[str(adopt_root)]), store, journal, state
    )
    try:
        ws = registry.adopt(str(root), None, None, "test")
        gate = SnapshotGate(state / "gate", journal, attribution=EVERY_CHANGE_IS_THE_SANDBOXS)
        ticket = await gate.before(ws)
        assert os.listdir(state / "gate" / ws.id) == []  # nothing kept: nothing was read
        assert await gate.after(ws, ticket) == []
        os.rename(root / ".git", root / "git-away")
        ticket = await gate.before(ws)
        (root / ".git").mkdir()
        blocked = await gate.after(ws, ticket)
        assert changes(blocked) == [("plain:.git", "create", True)]
    finally:
        registry.close()
        store.close()


# --- names that are not UTF-8, require_approval, the sandbox's read-only mounts --------------


async def test_names_that_are_not_utf8_are_reported_escaped(env: Env) -> None:
    root = os.fsencode(env.root)

    def command(_: Path) -> None:
        os.mkdir(root + b"/d\xff")
        with open(root + b"/d\xff/\xfe.lock", "wb") as f:
            f.write(b"x")
        with open(root + b"/poetry.lock", "ab") as f:
            f.write(b"tampered")
        with open(root + b"/ok\xff", "wb") as f:
            f.write(b"allowed")

    blocked = await env.around(command)
    assert changes(blocked) == [
        ("gated:d\\xff/\\xfe.lock", "create", True),
        ("gated:poetry.lock", "modify", True),
    ]
    assert os.listdir(root + b"/d\xff") == []
    assert (env.root / "poetry.lock").read_bytes() == LOCK
    assert {e["path"] for e in env.blocked_entries()} == {b.path for b in blocked}


async def test_require_approval_globs_are_gated_like_denied_ones(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> None:
    root = make_workspace("approvals", {"app.cfg": "safe\n", "conf/db.cfg": "local\n"}, git=True)
    state = tmp_path / "state3"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(
        Config(state_dir=str(state), adopt_roots=[str(adopt_root)]), store, journal, state
    )
    try:
        ws = registry.adopt(str(root), None, Policy(require_approval=["*.cfg"]), "test")
        gate_ = SnapshotGate(state / "gate", journal, attribution=EVERY_CHANGE_IS_THE_SANDBOXS)
        ticket = await gate_.before(ws)  # `.git` is mounted, but approvals need the gate
        (root / "app.cfg").write_text("open\n")
        (root / "conf" / "db.cfg").unlink()
        (root / "new.cfg").write_text("n\n")
        (root / "other.txt").write_text("fine\n")
        blocked = await gate_.after(ws, ticket)
        assert changes(blocked) == [
            ("approvals:app.cfg", "modify", True),
            ("approvals:conf/db.cfg", "delete", True),
            ("approvals:new.cfg", "create", True),
        ]
        assert {b.rule for b in blocked} == {"require_approval"}
        entries = [e.data for e in journal.read(limit=100) if e.kind == "policy.blocked"]
        assert {e["rule"] for e in entries} == {"require_approval"}
        assert (root / "app.cfg").read_text() == "safe\n"
        assert (root / "conf" / "db.cfg").read_text() == "local\n"
        assert not (root / "new.cfg").exists()
        assert (root / "other.txt").read_text() == "fine\n"
    finally:
        registry.close()
        store.close()


async def test_paths_the_sandbox_mounted_read_only_are_not_walked(env: Env) -> None:
    nested = env.root / "vendor" / ".git"
    nested.mkdir(parents=True)
    st = os.lstat(nested)
    mounted = {**gate.readonly_identities(env.ws), "vendor/.git": (st.st_dev, st.st_ino)}
    ticket = await env.gate.before(env.ws, mounted)
    (nested / "x.lock").write_text("x")  # impossible through a read-only mount
    assert await env.gate.after(env.ws, ticket) == []
    # Without the mount (another inode there now), the same write is caught.
    ticket = await env.gate.before(env.ws)
    (nested / "y.lock").write_text("y")
    assert changes(await env.gate.after(env.ws, ticket)) == [
        ("gated:vendor/.git/y.lock", "create", True)
    ]


# --- deep and wide trees, temp files of restores ---------------------------------------------


async def test_a_tree_deeper_than_the_recursion_limit_is_removed(env: Env) -> None:
    depth = sys.getrecursionlimit() + 1000

    def command(root: Path) -> None:
        # Made through dir fds: the path is longer than PATH_MAX.
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in ["build", *["d"] * depth]:
                os.mkdir(name, dir_fd=fd)
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nxt
            with open(os.open("out.lock", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
                f.write("x")
        finally:
            os.close(fd)

    blocked = await env.around(command)
    assert changes(blocked) == [("gated:build", "create", True)]
    assert not (env.root / "build").exists()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_the_walk_holds_one_dir_fd_however_wide_the_tree(env: Env) -> None:
    """150 sibling directories under an fd limit with 60 to spare: every one is walked."""
    wide = [env.root / "wide" / f"d{i:03}" for i in range(150)]
    for d in wide:
        d.mkdir(parents=True)
        (d / "f.lock").write_text("locked\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + 60, hard))
    try:
        blocked = await env.around(
            lambda root: [(d / "f.lock").write_text("tampered\n") for d in wide]
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(blocked) == 150 and all(b.reverted for b in blocked)
    assert {(d / "f.lock").read_text() for d in wide} == {"locked\n"}


def _put(path: bytes, data: bytes, mode: str = "wb") -> None:
    with open(path, mode) as f:
        f.write(data)


class Crash(BaseException):
    """The daemon dies here: nothing after it runs, no cleanup either."""


@pytest.mark.parametrize("where", [b"poetry.lock", b"d\xff/k.lock"])
async def test_a_restore_cut_by_a_crash_leaves_a_recorded_temp_file_cleaned_at_start(
    env: Env, monkeypatch: pytest.MonkeyPatch, where: bytes
) -> None:
    target = os.fsencode(env.root) + b"/" + where
    os.makedirs(os.path.dirname(target), exist_ok=True)
    _put(target, LOCK)
    store = env.journal.store

    def rows() -> list[tuple[object, ...]]:
        return [tuple(r) for r in store.query("SELECT workspace, dir, name FROM temp_files")]

    def temps() -> list[bytes]:
        return [
            n for n in os.listdir(os.path.dirname(target)) if n.startswith(TEMP_PREFIX.encode())
        ]

    def tamper(_: Path) -> None:
        _put(target, b"tampered", "ab")

    # A restore that finishes leaves neither a temp file nor its record.
    assert [b.reverted for b in await env.around(tamper)] == [True]
    assert rows() == [] and temps() == []

    def crash(*args: object) -> None:
        raise Crash

    monkeypatch.setattr(fsops, "rename_into", crash)
    monkeypatch.setattr(fsops, "unlink_quietly", lambda *args: None)
    monkeypatch.setattr(TempFiles, "forget", lambda *args: None)
    with pytest.raises(Crash):
        await env.around(tamper)
    monkeypatch.undo()
    assert len(temps()) == 1 and len(rows()) == 1

    # The next start (a new epoch on the same database) removes exactly that file.
    registry = WorkspaceRegistry(env.config, store, Journal(store), env.state)
    try:
        assert registry.clean_stale_temp_files() == 1
    finally:
        registry.close()
    assert temps() == [] and rows() == []
