"""substrate.workspace.writes.batch, batch_files and batch_dirs: a change set's files and
directories land in batches with every guarantee of one guarded write: bound to their
base, re-checked under the commit lock right before each rename, one journal entry each
(the chain intact), temp files recorded first and forgotten after, write intents gone
once journaled."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.config import Config
from substrate.errors import PathDenied, PathInvalid, StaleBase
from substrate.fs import fsops
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.restore import restore
from substrate.workspace.writes import (
    TEMP_PREFIX,
    DirChange,
    FileChange,
    Landing,
    Writer,
    batch,
    batch_files,
)
from tests.harness.waiting import wait_until

ACTOR = "agent:0"
FILES: dict[str, str | bytes] = {
    "a.txt": "a\n",
    "b.txt": "b\n",
    "src/one.py": "1\n",
    "src/two.py": "2\n",
    "ci/deploy.yml": "steps: []\n",
    "full/keep.txt": "k\n",
}


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass
class Env:
    root: Path
    ws: Workspace
    writer: Writer
    store: Store
    journal: Journal
    registry: WorkspaceRegistry
    checkpoints: Checkpoints
    #: The new bytes by path, as a command left them.
    new: dict[str, bytes]

    def change(self, path: str, data: bytes | None, mode: int | None = 0o644) -> FileChange:
        """A change of `path` to `data` (None: delete), bound to the checkout as it is."""
        target = self.root / path
        base = sha(target.read_bytes()) if target.is_file() else None
        if data is not None:
            self.new[path] = data
        return FileChange(path, base, None if data is None else sha(data), len(data or b""), mode)

    def source(self, path: str) -> bytes | None:
        return self.new.get(path)

    def apply(self, changes: list[FileChange], **kw: Any) -> list[Landing]:
        return self.writer.batch.apply_files(self.ws, changes, self.source, ACTOR, **kw)

    def entries(self) -> list[dict[str, Any]]:
        return [
            dict(e.data) for e in self.journal.read(limit=10000) if e.kind.startswith("changes.")
        ]

    def rows(self, table: str) -> int:
        return int(self.store.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"])

    def temps_on_disk(self) -> list[str]:
        return [p.name for p in self.root.rglob(f"{TEMP_PREFIX}*")]

    def assert_clean(self) -> None:
        """Nothing of a batch is left: no temp file, record or intent; the chain holds."""
        assert self.temps_on_disk() == []
        assert self.rows("temp_files") == 0
        assert self.rows("write_intents") == 0
        assert self.journal.verify() is None


@pytest.fixture
def policy() -> Policy | None:
    return None


@pytest.fixture
def env(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path], policy: Policy | None
) -> Iterator[Env]:
    root = make_workspace("demo", FILES)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    ws = registry.adopt(str(root), None, policy, ACTOR)
    checkpoints = Checkpoints(store, journal, state, 1 << 20)
    try:
        yield Env(
            root, ws, Writer(store, journal, checkpoints), store, journal, registry, checkpoints, {}
        )
    finally:
        checkpoints.close()
        registry.close()
        store.close()


def statuses(landings: list[Landing]) -> list[str]:
    return [landing.status for landing in landings]


def test_many_files_over_several_chunks_one_entry_each(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "CHUNK", 3)
    monkeypatch.setattr(batch, "MAX_DIRS", 2)
    (env.root / "out").mkdir()
    os.chown(env.root / "out", env.ws.owner_uid, env.ws.owner_gid)
    changes = [env.change(f"out/f{i}.txt", b"%d\n" % i) for i in range(8)]
    changes += [
        env.change("a.txt", b"A\n", 0o600),
        env.change("src/one.py", None, None),
        env.change("src/two.py", b"TWO\n", 0o4755),  # set-id never lands
    ]
    landings = env.apply(changes)
    assert statuses(landings) == ["applied"] * 11
    assert [(env.root / f"out/f{i}.txt").read_bytes() for i in range(8)] == [
        b"%d\n" % i for i in range(8)
    ]
    assert (env.root / "a.txt").read_bytes() == b"A\n"
    assert not (env.root / "src" / "one.py").exists()
    st = os.stat(env.root / "src" / "two.py")
    assert stat.S_IMODE(st.st_mode) == 0o755
    assert (st.st_uid, st.st_gid) == (env.ws.owner_uid, env.ws.owner_gid)
    entries = env.entries()
    assert [(e["path"], e["op"]) for e in entries] == [
        *((f"demo:out/f{i}.txt", "create") for i in range(8)),
        ("demo:a.txt", "replace"),
        ("demo:src/one.py", "delete"),
        ("demo:src/two.py", "replace"),
    ]
    assert [e["plan_digest"] for e in entries] == [landing.plan_digest for landing in landings]
    assert entries[8]["base_sha256"] == sha("a\n") and entries[8]["mode"] == 0o600
    assert entries[10]["mode"] == 0o755 and entries[10]["size"] == 4
    env.assert_clean()
    # Applied again: everything is already there, nothing is journaled twice.
    again = env.apply(changes)
    assert statuses(again) == ["unchanged"] * 11
    assert len(env.entries()) == 11


def test_a_host_edit_racing_the_batch_is_never_overwritten(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    changes = [env.change(p, f"{p} by the command\n".encode()) for p in ("a.txt", "b.txt")]
    changes.append(env.change("src/one.py", None, None))

    def racing_source(path: str) -> bytes | None:
        # While the temp files are written (after the plan), a person edits b.txt.
        if path == "a.txt":
            (env.root / "b.txt").write_text("the host's edit\n")
        return env.source(path)

    # And just before the commit lock, src/one.py.
    real = env.writer.batch._temps_durable

    def edit_then_sync(*args: Any) -> None:
        real(*args)
        (env.root / "src" / "one.py").write_text("kept\n")

    monkeypatch.setattr(env.writer.batch, "_temps_durable", edit_then_sync)
    landings = env.writer.batch.apply_files(env.ws, changes, racing_source, ACTOR)
    assert statuses(landings) == ["applied", "refused", "refused"]
    for landing, now in zip(landings[1:], ("the host's edit\n", "kept\n"), strict=True):
        assert isinstance(landing.refusal, StaleBase)
        assert landing.refusal.data == {"current_sha256": sha(now)}
    assert (env.root / "a.txt").read_text() == "a.txt by the command\n"
    assert (env.root / "b.txt").read_text() == "the host's edit\n"
    assert (env.root / "src" / "one.py").read_text() == "kept\n"
    assert [e["path"] for e in env.entries()] == ["demo:a.txt"]
    env.assert_clean()


def test_a_file_the_host_makes_after_the_last_check_is_never_replaced(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = batch_files.read_current_held

    def then_the_host_creates(
        parent_fd: int, name: str, where: str, limit: int, keep: int | None = None
    ) -> Any:
        found = real(parent_fd, name, where, limit, keep)
        if name == "new.txt":  # checked absent under the lock; the host is faster still
            (env.root / "new.txt").write_text("the host's\n")
        return found

    monkeypatch.setattr(batch_files, "read_current_held", then_the_host_creates)
    [landing] = env.apply([env.change("new.txt", b"the command's\n")])
    assert landing.refusal is not None and landing.refusal.name == "already_exists"
    assert (env.root / "new.txt").read_text() == "the host's\n"
    assert env.entries() == []
    env.assert_clean()


def test_a_parent_swapped_for_a_symlink_mid_batch_is_never_followed(
    env: Env, tmp_path: Path
) -> None:
    decoy, moved = tmp_path / "decoy", tmp_path / "moved"
    decoy.mkdir()
    (decoy / "one.py").write_text("1\n")
    changes = [env.change("src/one.py", b"ONE\n"), env.change("src/new.py", b"NEW\n")]

    def swapping_source(path: str) -> bytes | None:
        if path == "src/one.py":  # after the plan, before the temp files and renames
            (env.root / "src").rename(moved)
            (env.root / "src").symlink_to(decoy)
        return env.source(path)

    landings = env.writer.batch.apply_files(env.ws, changes, swapping_source, ACTOR)
    # Never through the symlink: the decoy is untouched. What landed, landed in the
    # directory the batch held, wherever it is now.
    assert sorted(p.name for p in decoy.iterdir()) == ["one.py"]
    assert (decoy / "one.py").read_text() == "1\n"
    assert os.readlink(env.root / "src") == str(decoy)
    assert statuses(landings) == ["applied", "applied"]
    assert (moved / "one.py").read_text() == "ONE\n" and (moved / "new.py").read_text() == "NEW\n"
    assert [p.name for p in moved.glob(f"{TEMP_PREFIX}*")] == []
    env.assert_clean()


def test_bytes_other_than_the_digested_ones_never_land(env: Env) -> None:
    change = env.change("a.txt", b"scanned\n")
    env.new["a.txt"] = b"swapped after the scan\n"
    assert statuses(env.apply([change])) == ["source_changed"]
    assert (env.root / "a.txt").read_text() == "a\n"
    assert env.entries() == []
    env.assert_clean()


def test_a_failed_syncfs_before_anything_lands_leaves_nothing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From `SYNCFS_FROM` temp files on, one `syncfs` makes them durable: when it fails
    nothing lands and nothing is left."""

    def no_sync(fds: list[int]) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(batch_files, "make_durable", no_sync)
    changes = [env.change("a.txt", b"A\n"), env.change("new.txt", b"n\n")]
    changes += [env.change(f"more{k}.txt", b"m\n") for k in range(batch.SYNCFS_FROM - 2)]
    with pytest.raises(OSError):
        env.apply(changes)
    assert (env.root / "a.txt").read_text() == "a\n"
    assert not (env.root / "new.txt").exists()
    assert not any((env.root / f"more{k}.txt").exists() for k in range(batch.SYNCFS_FROM))
    assert env.entries() == []
    env.assert_clean()


def test_a_few_temp_files_are_fsynced_each_and_a_failed_fsync_fails_its_change_alone(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `SYNCFS_FROM` temp files no `syncfs` runs (it would flush everything dirty
    on the file system): each is fsynced, and the one whose fsync fails fails alone
    (its temp file gone), the other lands and is journaled."""
    flushed: list[bool] = []
    real_fill = batch_files.fsops.fill

    def fill(fd: int, data: bytes, **kw: Any) -> None:
        flushed.append(kw["fsync"])
        if data == b"A\n":
            raise OSError(errno.EIO, "I/O error")
        real_fill(fd, data, **kw)

    def no_syncfs(fds: list[int]) -> None:
        raise AssertionError("a syncfs for two files")

    monkeypatch.setattr(batch_files.fsops, "fill", fill)
    monkeypatch.setattr(batch_files, "make_durable", no_syncfs)
    monkeypatch.setattr(batch.fsops, "make_durable", no_syncfs)  # the parents' too
    landings = env.apply([env.change("a.txt", b"A\n"), env.change("new.txt", b"n\n")])
    assert statuses(landings) == ["failed", "applied"]
    assert isinstance(landings[0].error, OSError)
    assert flushed == [True, True]
    assert (env.root / "a.txt").read_text() == "a\n"
    assert (env.root / "new.txt").read_text() == "n\n"
    assert [e["path"] for e in env.entries()] == ["demo:new.txt"]
    env.assert_clean()


def test_refusals_are_a_guarded_writes(env: Env) -> None:
    (env.root / "link").symlink_to("a.txt")
    changes = [
        FileChange("b.txt", sha("not b\n"), sha("B\n"), 2, 0o644),  # another base
        FileChange("a.txt", None, sha("A\n"), 2, 0o644),  # exists: bind it to its digest
        FileChange("link", None, sha("L\n"), 2, 0o644),
        FileChange("nodir/x", None, sha("x\n"), 2, 0o644),
        FileChange(f"{TEMP_PREFIX}0011223344556677", None, sha("t\n"), 2, 0o644),
    ]
    env.new.update({"b.txt": b"B\n", "a.txt": b"A\n", "link": b"L\n", "nodir/x": b"x\n"})
    names = [
        landing.refusal.name if landing.refusal else landing.status
        for landing in env.apply(changes)
    ]
    assert names == ["stale_base", "already_exists", "symlink_refused", "not_found", "path_denied"]
    assert (env.root / "a.txt").read_text() == "a\n" and (env.root / "b.txt").read_text() == "b\n"
    env.assert_clean()


@pytest.mark.parametrize(
    "policy", [Policy(write_deny=["*.lock"], require_approval=["ci/**"])], ids=["policy"]
)
def test_policy_and_approvals(env: Env) -> None:
    changes = [
        env.change("poetry.lock", b"x\n"),
        env.change("ci/deploy.yml", b"steps: [go]\n"),
        env.change("b.txt", b"B\n"),
    ]
    dry = env.apply(changes, dry_run=True)
    assert [d.refusal.name if d.refusal else d.status for d in dry] == [
        "path_denied",
        "approval_required",
        "applied",
    ]
    assert env.entries() == [] and (env.root / "b.txt").read_text() == "b\n"
    first = env.apply(changes)
    pending = first[1].refusal
    assert pending is not None and pending.name == "approval_required"
    digest = pending.data["plan_digest"]
    assert dry[1].refusal is not None and digest == dry[1].refusal.data["plan_digest"]
    approval, _ = env.registry.grant_approval(env.ws, digest, 60, "operator:0")
    second = env.apply(changes)
    assert statuses(second) == ["refused", "applied", "unchanged"]
    assert (env.root / "ci" / "deploy.yml").read_text() == "steps: [go]\n"
    assert not (env.root / "poetry.lock").exists()
    [_, entry] = env.entries()
    assert entry["path"] == "demo:ci/deploy.yml" and entry["approval_id"] == approval
    used = env.store.query("SELECT used FROM approvals WHERE id = ?", (approval,))
    assert used[0]["used"] is not None  # used once
    env.assert_clean()


def test_a_checkpoint_keeps_what_a_batch_replaces(env: Env) -> None:
    checkpoint, _ = env.checkpoints.create(env.ws, ACTOR)
    changes = [
        env.change("a.txt", b"A\n", 0o600),
        env.change("src/one.py", None, None),
        env.change("created.txt", b"c\n"),
    ]
    assert statuses(env.apply(changes)) == ["applied"] * 3
    result = restore(env.writer, env.checkpoints, env.journal, env.ws, checkpoint, False, ACTOR)
    assert sorted(r.path for r in result.restored) == [
        "demo:a.txt",
        "demo:created.txt",
        "demo:src/one.py",
    ]
    assert (env.root / "a.txt").read_text() == "a\n"
    assert (env.root / "src" / "one.py").read_text() == "1\n"
    assert not (env.root / "created.txt").exists()


def test_directories_made_moded_and_removed(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "MAX_DIRS", 2)  # three chunks
    (env.root / "empty").mkdir()
    steps = [
        DirChange("new", "mkdir", 0o2750),  # set-gid never lands
        DirChange("new/deeper", "mkdir", None),
        DirChange("src", "chmod", 0o700),
        DirChange("empty", "rmdir"),
        DirChange("full", "rmdir"),  # holds a file: never removed
    ]
    landings = env.writer.batch.apply_dirs(env.ws, steps, ACTOR)
    assert statuses(landings) == ["applied"] * 4 + ["failed"]
    assert landings[4].error is not None and landings[4].error.errno == errno.ENOTEMPTY
    new, deeper = os.stat(env.root / "new"), os.stat(env.root / "new" / "deeper")
    owner = (env.ws.owner_uid, env.ws.owner_gid)
    assert (stat.S_IMODE(new.st_mode), new.st_uid, new.st_gid) == (0o750, *owner)
    assert (stat.S_IMODE(deeper.st_mode), deeper.st_uid, deeper.st_gid) == (0o755, *owner)
    assert stat.S_IMODE(os.stat(env.root / "src").st_mode) == 0o700
    assert not (env.root / "empty").exists() and (env.root / "full" / "keep.txt").exists()
    assert [(e["path"], e["op"], e["mode"]) for e in env.entries()] == [
        ("demo:new", "mkdir", 0o750),
        ("demo:new/deeper", "mkdir", None),
        ("demo:src", "chmod", 0o700),
        ("demo:empty", "rmdir", None),
    ]
    assert statuses(env.writer.batch.apply_dirs(env.ws, steps[:4], ACTOR)) == ["unchanged"] * 4
    env.assert_clean()


def test_rename_new_never_replaces_also_without_renameat2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for libc in ("real", "without renameat2"):
        if libc != "real":
            monkeypatch.setattr(fsops, "_libc", object())  # no renameat2: the fallback
        d = tmp_path / libc
        d.mkdir()
        (d / "tmp").write_text("new\n")
        (d / "taken").write_text("the host's\n")
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(FileExistsError):
                fsops.rename_new(fd, "tmp", "taken")
            fsops.rename_new(fd, "tmp", "free")
        finally:
            os.close(fd)
        assert (d / "taken").read_text() == "the host's\n"
        assert (d / "free").read_text() == "new\n" and not (d / "tmp").exists()


def test_replaced_and_deleted_files_are_released_not_leaked(env: Env) -> None:
    (env.root / "many").mkdir()
    for i in range(40):
        (env.root / "many" / f"f{i}").write_text("old\n")
    before = len(os.listdir("/proc/self/fd"))
    changes = [env.change(f"many/f{i}", b"new\n") for i in range(20)]
    changes += [env.change(f"many/f{i}", None, None) for i in range(20, 40)]
    assert statuses(env.apply(changes)) == ["applied"] * 40
    # The old files' fds go to the background releaser; none stays open.
    wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before, message="fds left open")
    assert sorted(os.listdir(env.root / "many")) == sorted(f"f{i}" for i in range(20))
    env.assert_clean()


def test_pieces_of_one_batch_never_complete_a_git_dir(env: Env) -> None:
    # Executable files named like git's pieces pass git's `access(X_OK)` test, and
    # arrive together: the one that would complete `x` is refused.
    (env.root / "x").mkdir()
    changes = [
        env.change(f"x/{name}", b"ref: refs/heads/m\n", 0o755)
        for name in ("HEAD", "objects", "refs")
    ]
    landings = env.apply(changes)
    assert [landing.status for landing in landings] == ["applied", "applied", "refused"]
    refusal = landings[2].refusal
    assert isinstance(refusal, PathDenied)
    assert refusal.data == {"reason": "git_dir", "git_dir": "x"}
    assert not (env.root / "x" / "refs").exists()
    # Directory steps, in their own batch: `refs` as a directory is refused as well.
    dirs = env.writer.batch.apply_dirs(env.ws, [DirChange("x/refs", "mkdir", None)], ACTOR)
    assert dirs[0].status == "refused" and isinstance(dirs[0].refusal, PathDenied)
    assert not (env.root / "x" / "refs").exists()
    env.assert_clean()


def test_a_batch_never_makes_a_misleading_name(env: Env) -> None:
    landings = env.apply([env.change("ok.txt", b"ok\n"), env.change("a\nb", b"x\n")])
    assert landings[0].status == "applied" and landings[1].status == "refused"
    assert isinstance(landings[1].refusal, PathInvalid)
    assert landings[1].refusal.data["reason"] == "control_character"
    dirs = env.writer.batch.apply_dirs(env.ws, [DirChange("r\u202ed", "mkdir", None)], ACTOR)
    assert isinstance(dirs[0].refusal, PathInvalid)
    assert sorted(p.name for p in env.root.iterdir() if "\n" in p.name or "\u202e" in p.name) == []
    env.assert_clean()
