"""A guarded write cut off by a crash between its rename and its journal commit is
journaled at the next start, `recovered: true`; one that did not land journals nothing
(docs/protocol.md §4, "Crash"; `substrate.workspace.writes.intents`).

Each crash is real: the write (or eight at once) runs in a forked child that dies (`os._exit`, no cleanup,
as `kill -9` would) at the injected point, then the parent opens the state again as a
restart does and runs the start-up recovery (`Writer.recover`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.config import Config
from substrate.fs import fsops
from substrate.schema.fs import (
    DeleteParams,
    Edit,
    PatchParams,
    WriteParams,
    patch_request,
    write_request,
)
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.store.group import GroupCommit
from substrate.store.journal import Journal
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.digests import Digests
from substrate.workspace.registry import TEMP_PREFIX, Workspace, WorkspaceRegistry
from substrate.workspace.uploads import Uploads
from substrate.workspace.writes import (
    WRITE_KINDS,
    Intent,
    Intents,
    LinkChange,
    UploadWriter,
    Writer,
    batch_links,
    drift_report,
)

ACTOR = "agent:0"
FILES: dict[str, str | bytes] = {"a.txt": "a\n", "b.txt": "b\n", "ci/deploy.yml": "steps: []\n"}
#: The exit code of a child that died at the injected point.
DIED = 9


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Env:
    root: Path
    state: Path
    adopt_root: Path
    store: Store
    journal: Journal
    registry: WorkspaceRegistry
    checkpoints: Checkpoints
    writer: Writer
    uploads: Uploads
    upload_writer: UploadWriter
    #: The state opened again by `restart` (closed by the fixture).
    again: Env | None = None
    closed: bool = False

    @property
    def ws(self) -> Workspace:
        return self.registry.all()[0]

    def write(self, path: str, text: str, base: str | None, **kw: Any) -> None:
        p = WriteParams(workspace=self.ws.id, path=path, content=text, base_sha256=base, **kw)
        self.writer.write(self.ws, write_request(p), ACTOR)

    def sha(self, rel: str) -> str:
        return sha((self.root / rel).read_bytes())

    def entries(self, rel: str) -> list[Any]:
        """The write entries of `rel`, oldest first."""
        return [
            e
            for e in self.journal.read(limit=10000, kinds=WRITE_KINDS)
            if e.data["path"] == f"{self.ws.root_id}:{rel}"
        ]

    def rows(self, table: str) -> int:
        return int(self.store.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.uploads.close()
        self.checkpoints.close()
        self.registry.close()
        self.store.close()


def open_env(adopt_root: Path, state: Path, root: Path | None) -> Env:
    """The state as a start opens it (a new run, epoch); adopts `root` the first time."""
    state.mkdir(mode=0o700, exist_ok=True)
    store = Store(state / "substrate.db")
    journal = Journal(store)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    registry = WorkspaceRegistry(config, store, journal, state)
    if root is not None:
        registry.adopt(str(root), None, Policy(require_approval=["ci/**"]), ACTOR)
    checkpoints = Checkpoints(store, journal, state, 1 << 30)
    uploads = Uploads(state, max_bytes=1 << 30, max_open=8, idle_s=600.0)
    return Env(
        Path(registry.all()[0].host_path),
        state,
        adopt_root,
        store,
        journal,
        registry,
        checkpoints,
        Writer(store, journal, checkpoints),
        uploads,
        UploadWriter(store, journal, Digests(), checkpoints),
    )


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    made: Env | None = open_env(adopt_root, tmp_path / "state", make_workspace("demo", FILES))
    first = made
    try:
        yield first
    finally:
        while made is not None:
            made.close()
            made = made.again


def restart(env: Env) -> Env:
    """Close the state, open it again as the next start, run the start-up recovery."""
    env.close()
    again = env.again = open_env(env.adopt_root, env.state, None)
    again.writer.recover(again.registry.get)
    return again


def die_after_the_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    """The write's journal transaction never commits: the process dies while building it
    (after the rename and the directory fsync, before COMMIT)."""

    def dying(*_args: Any, **_kw: Any) -> None:
        os._exit(DIED)

    monkeypatch.setattr(Journal, "append_in", dying)


def die_at_the_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process dies just before the rename: the temp file is there, the target is
    its base."""

    def dying(*_args: Any, **_kw: Any) -> None:
        os._exit(DIED)

    monkeypatch.setattr(fsops, "rename_into", dying)


def crash(fault: Callable[[pytest.MonkeyPatch], None], op: Callable[[], object]) -> None:
    """Run `op` in a forked child with `fault` injected; the child must die of it."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            with pytest.MonkeyPatch.context() as mp:
                fault(mp)
                op()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == DIED


def temp_files(root: Path) -> list[str]:
    return [n for _d, ds, fs in os.walk(root) for n in ds + fs if n.startswith(TEMP_PREFIX)]


def assert_consistent(env: Env) -> None:
    """The chain holds, no write drifted, nothing of the crashed run is left."""
    assert env.journal.verify() is None
    assert [r[4] for r in drift_report(env.ws, env.journal) if r[4] != "match"] == []
    assert env.rows("write_intents") == 0
    env.registry.clean_stale_temp_files()
    assert temp_files(env.root) == []


# --- landed, journal lost: journaled at start ------------------------------------------------


def test_a_write_that_landed_before_its_journal_commit_is_journaled_at_start(env: Env) -> None:
    base = env.sha("a.txt")
    crash(die_after_the_rename, lambda: env.write("a.txt", "A\n", base))
    assert (env.root / "a.txt").read_text() == "A\n"
    assert env.entries("a.txt") == []

    env = restart(env)
    [entry] = env.entries("a.txt")
    assert (entry.kind, entry.actor, entry.data["recovered"]) == ("fs.write", ACTOR, True)
    assert (entry.data["op"], entry.data["base_sha256"]) == ("replace", base)
    assert entry.data["new_sha256"] == env.sha("a.txt") == sha(b"A\n")
    assert entry.data["size"] == 2 and entry.data["mode"] == 0o644
    assert_consistent(env)
    # A second start finds nothing more to journal.
    env = restart(env)
    assert len(env.entries("a.txt")) == 1


def test_a_create_patch_and_delete_that_landed_are_journaled_at_start(env: Env) -> None:
    crash(die_after_the_rename, lambda: env.write("new/c.txt", "C\n", None, create_parents=True))
    patch = PatchParams(
        workspace=env.ws.id,
        path="b.txt",
        base_sha256=env.sha("b.txt"),
        edits=[Edit(old="b", new="B")],
    )
    crash(die_after_the_rename, lambda: env.writer.patch(env.ws, patch_request(patch), ACTOR))
    gone = DeleteParams(workspace=env.ws.id, path="a.txt", base_sha256=env.sha("a.txt"))
    crash(die_after_the_rename, lambda: env.writer.delete(env.ws, gone, ACTOR))
    assert not (env.root / "a.txt").exists()

    env = restart(env)
    [created] = env.entries("new/c.txt")
    assert (created.kind, created.data["op"], created.data["recovered"]) == (
        "fs.write",
        "create",
        True,
    )
    assert created.data["new_sha256"] == env.sha("new/c.txt")
    [patched] = env.entries("b.txt")
    assert (patched.kind, patched.data["recovered"]) == ("fs.patch", True)
    assert patched.data["new_sha256"] == env.sha("b.txt") == sha(b"B\n")
    [deleted] = env.entries("a.txt")
    assert (deleted.kind, deleted.data["op"], deleted.data["new_sha256"]) == (
        "fs.delete",
        "delete",
        None,
    )
    assert deleted.data["recovered"] is True
    assert_consistent(env)


def test_an_approved_write_that_landed_is_journaled_and_its_approval_used(env: Env) -> None:
    rel = "ci/deploy.yml"
    p = WriteParams(
        workspace=env.ws.id, path=rel, content="x\n", base_sha256=env.sha(rel), dry_run=True
    )
    plan = env.writer.write(env.ws, write_request(p), ACTOR)
    approval, _ = env.registry.grant_approval(env.ws, plan.plan_digest, 600.0, "operator")
    crash(die_after_the_rename, lambda: env.write(rel, "x\n", plan.base_sha256))

    env = restart(env)
    [entry] = env.entries(rel)
    assert (entry.data["recovered"], entry.data["approval_id"]) == (True, approval)
    assert env.writer.batch._approvals.find(env.ws.id, plan.plan_digest, time.time()) is None
    assert_consistent(env)


def test_writes_of_one_file_whose_entries_were_all_lost_are_journaled_in_order(
    env: Env,
) -> None:
    """Two writes of one file landed and their entries (to share one commit) were lost:
    both are journaled, in the order they landed, followed back from what the file
    holds through their bases; a third that never landed (its temp file is still
    there) is not."""
    first, second, third = env.sha("a.txt"), sha(b"one\n"), sha(b"two\n")
    (env.root / "a.txt").write_text("two\n")  # what the two renames left
    (env.root / f"{TEMP_PREFIX}0123456789abcdef").write_text("three\n")

    def intent(base: str, new: str, temp: str) -> Intent:
        data = {"path": f"{env.ws.root_id}:a.txt", "op": "replace", "base_sha256": base}
        data |= {"new_sha256": new, "size": 4, "mode": 0o644, "approval_id": None}
        return Intent("a.txt", "fs.write", ACTOR, data, temp)

    intents = Intents(env.store, env.journal)
    with env.store.transaction() as db:
        # Recorded out of order: concurrent writers' intents need not commit in the
        # order their renames happen.
        intents.add_in(db, env.ws.id, [intent(second, third, f"{TEMP_PREFIX}2")])
        intents.add_in(
            db, env.ws.id, [intent(third, sha(b"three\n"), f"{TEMP_PREFIX}0123456789abcdef")]
        )
        intents.add_in(db, env.ws.id, [intent(first, second, f"{TEMP_PREFIX}1")])

    env = restart(env)
    entries = env.entries("a.txt")
    assert [(e.data["base_sha256"], e.data["new_sha256"]) for e in entries] == [
        (first, second),
        (second, third),
    ]
    assert all(e.data["recovered"] for e in entries)
    assert env.journal.verify() is None
    assert env.rows("write_intents") == 0


def test_a_restored_file_that_landed_is_journaled_at_start(env: Env) -> None:
    crash(
        die_after_the_rename,
        lambda: env.writer.restore_file(
            env.ws, "a.txt", env.sha("a.txt"), b"back\n", 0o600, False, ACTOR
        ),
    )
    env = restart(env)
    [entry] = env.entries("a.txt")
    assert (entry.kind, entry.data["recovered"], entry.data["mode"]) == (
        "workspace.restore_file",
        True,
        0o600,
    )
    assert entry.data["new_sha256"] == env.sha("a.txt")
    assert_consistent(env)


def test_an_upload_that_landed_before_its_journal_commit_is_journaled_at_start(
    env: Env,
) -> None:
    data = os.urandom(100_000)
    base = env.sha("b.txt")
    up = env.uploads.begin(
        ACTOR,
        workspace=env.ws.id,
        path="b.txt",
        base_sha256=base,
        size=len(data),
        sha256=sha(data),
        mode=None,
        create_parents=False,
    )
    env.uploads.chunk(ACTOR, up.id, 0, data)

    def commit() -> None:
        fd = env.uploads.open_spool(up)
        env.upload_writer.commit(env.ws, up, fd, False, None, ACTOR)

    crash(die_after_the_rename, commit)
    env = restart(env)
    [entry] = env.entries("b.txt")
    assert (entry.kind, entry.data["recovered"], entry.data["upload"]) == (
        "fs.upload",
        True,
        up.id,
    )
    assert entry.data["new_sha256"] == env.sha("b.txt") == sha(data)
    assert_consistent(env)


def test_a_write_under_a_live_checkpoint_that_landed_is_journaled_at_start(env: Env) -> None:
    env.checkpoints.create(env.ws, ACTOR)
    base = env.sha("a.txt")
    crash(die_after_the_rename, lambda: env.write("a.txt", "A\n", base))
    env = restart(env)
    [entry] = env.entries("a.txt")
    assert entry.data["recovered"] is True and entry.data["new_sha256"] == env.sha("a.txt")
    assert_consistent(env)


# --- not landed: nothing journaled, the target as it was -------------------------------------


def test_a_write_that_did_not_land_journals_nothing_and_leaves_the_target(env: Env) -> None:
    base = env.sha("a.txt")
    crash(die_at_the_rename, lambda: env.write("a.txt", "A\n", base))
    assert len(temp_files(env.root)) == 1  # the temp file, never renamed

    env = restart(env)
    assert env.entries("a.txt") == []
    assert env.sha("a.txt") == base
    assert_consistent(env)


def test_a_rewrite_of_the_same_bytes_that_did_not_land_journals_nothing(env: Env) -> None:
    """The target holds the new bytes (they are its base) but the temp file is still
    there: the rename never happened, so nothing is claimed."""
    base = env.sha("a.txt")
    crash(die_at_the_rename, lambda: env.write("a.txt", "a\n", base))
    env = restart(env)
    assert env.entries("a.txt") == []
    assert_consistent(env)


def test_a_landed_write_edited_on_the_host_before_the_start_is_not_claimed(env: Env) -> None:
    base = env.sha("a.txt")
    crash(die_after_the_rename, lambda: env.write("a.txt", "A\n", base))
    (env.root / "a.txt").write_text("person\n")

    env = restart(env)
    assert env.entries("a.txt") == []
    assert (env.root / "a.txt").read_text() == "person\n"
    assert env.rows("write_intents") == 0


# --- symlinks of a change set (`batch_links`) --------------------------------------------------


def _die_at_the_batch_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    def dying(*_args: Any, **_kw: Any) -> None:
        os._exit(DIED)

    monkeypatch.setattr(Journal, "append_many_in", dying)


def _die_at_the_link_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    def dying(*_args: Any, **_kw: Any) -> None:
        os._exit(DIED)

    monkeypatch.setattr(batch_links, "rename_new", dying)


def test_a_link_that_landed_is_journaled_at_start_and_one_that_did_not_leaves_nothing(
    env: Env,
) -> None:
    link = [LinkChange("ln", None, "a.txt")]
    crash(_die_at_the_batch_journal, lambda: env.writer.batch.apply_links(env.ws, link, ACTOR))
    again = restart(env)
    assert os.readlink(again.root / "ln") == "a.txt"
    (entry,) = [e for e in again.journal.read() if e.kind == "changes.apply_link"]
    assert entry.data["recovered"] is True
    assert entry.data["new_sha256"] == hashlib.sha256(b"a.txt").hexdigest()
    other = [LinkChange("ln2", None, "b.txt")]
    crash(_die_at_the_link_rename, lambda: again.writer.batch.apply_links(again.ws, other, ACTOR))
    third = restart(again)
    assert not os.path.lexists(third.root / "ln2")
    assert [e.kind for e in third.journal.read()].count("changes.apply_link") == 1
    assert_consistent(third)  # the recorded temp link of the crashed run is gone too


# --- a crash in a group commit of 8 concurrent writes ----------------------------------------

CONCURRENT = 8


def _die_in_a_shared_commit(after: int, acked: Path) -> Callable[[pytest.MonkeyPatch], None]:
    """Once `after` writes were acknowledged, the process dies inside the first group
    commit that holds several units (concurrent writes' intents and entries): every
    unit has run in the open transaction, COMMIT never happens."""

    def fault(monkeypatch: pytest.MonkeyPatch) -> None:
        real = GroupCommit._commit

        def commit(self: GroupCommit, batch: list[Any]) -> None:
            if len(batch) < 2 or len(acked.read_bytes().splitlines()) < after:
                return real(self, batch)
            with self._transaction() as db:
                for ticket in batch:
                    ticket.work(db)
                os._exit(DIED)

        monkeypatch.setattr(GroupCommit, "_commit", commit)

    return fault


def _write_concurrently(env: Env, acked: Path) -> None:
    """Eight threads replace a file each, bound to the last digest, recording each
    acknowledged (path, new digest) in `acked` as it returns (survives `os._exit`)."""
    out = os.open(acked, os.O_WRONLY | os.O_APPEND)

    def one(k: int) -> None:
        rel = f"c{k}.txt"
        base = env.sha(rel)
        for version in range(1, 400):
            p = WriteParams(
                workspace=env.ws.id, path=rel, content=f"{rel} v{version}\n" * 64,
                base_sha256=base,
            )  # fmt: skip
            base = env.writer.write(env.ws, write_request(p), ACTOR).new_sha256 or ""
            os.write(out, f"{rel} {base}\n".encode())

    threads = [threading.Thread(target=one, args=(k,)) for k in range(CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("after", [1, 24, 64])
def test_a_crash_in_a_group_commit_of_8_writes_leaves_each_all_or_nothing(
    env: Env, tmp_path: Path, after: int
) -> None:
    """Eight writers at once; the process dies inside a commit their intents and entries
    share. At the next start each file holds the bytes of its last journal entry (a
    write is all-or-nothing: landed and journaled, `recovered: true` when its entry was
    in the lost commit, or not landed and not journaled), and every acknowledged write
    is there with its entry, committed before it was acknowledged."""
    for k in range(CONCURRENT):
        env.write(f"c{k}.txt", f"c{k} v0\n", None)
    acked = tmp_path / f"acked-{after}"
    acked.write_bytes(b"")
    crash(_die_in_a_shared_commit(after, acked), lambda: _write_concurrently(env, acked))

    env = restart(env)
    assert_consistent(env)
    for k in range(CONCURRENT):
        rel = f"c{k}.txt"
        entries = env.entries(rel)
        last = entries[-1].data["new_sha256"]
        assert last == env.sha(rel), f"{rel}: holds bytes no entry names"
        # The chain of the file's entries is unbroken: each is bound to the one before.
        for before, entry in itertools.pairwise(entries):
            assert entry.data["base_sha256"] == before.data["new_sha256"]
    journaled = {
        (e.data["path"].split(":", 1)[1], e.data["new_sha256"]): e
        for e in env.journal.read(limit=100000, kinds=WRITE_KINDS)
    }
    lines = acked.read_bytes().decode().splitlines()
    assert len(lines) >= after
    for line in lines:
        rel, digest = line.split(" ")
        entry = journaled.get((rel, digest))
        assert entry is not None, f"{rel}: an acknowledged write has no journal entry"
        assert not entry.data.get("recovered"), "an acknowledged write's entry was not durable"
