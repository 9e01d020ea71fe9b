"""Concurrent guarded writes sharing durability points: each entry is given to the group
commit only after its directory fsync, in the order the writes renamed, and a failed
fsync fails only its own write."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from substrate.fs import fsops
from substrate.schema.fs import WriteParams, write_request
from substrate.workspace.writes import dir_sync
from tests.workspace.writes.test_writer import ACTOR, WS, Env, open_env

WRITERS = 8
ROUNDS = 4


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    files: dict[str, str | bytes] = {f"d/f{k}.txt": f"v0 {k}\n" for k in range(WRITERS)}
    e = open_env(adopt_root, tmp_path / "state", make_workspace("demo", files), None)
    try:
        yield e
    finally:
        e.registry.close()
        e.store.close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_concurrent_writes_are_each_journaled_after_their_fsync_in_rename_order(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 writers, 4 rounds each, in one directory: every write is journaled once, the
    entries in the order of the renames, and none before a directory fsync that began
    after its rename ended; the shared fsyncs and commits are fewer than the writes."""
    lock = threading.Lock()
    renames: list[str] = []
    fsyncs: list[tuple[int, int]] = []  # (renames done when it began, when it ended)
    seen_at_entry: dict[str, int] = {}  # path → fsyncs ended that covered it, at its entry
    rename_into = fsops.rename_into
    append_in = env.journal.append_in

    def counting_rename(dir_fd: int, temp: str, name: str, *, fsync: bool = True) -> None:
        rename_into(dir_fd, temp, name, fsync=fsync)
        with lock:
            renames.append(name)

    real_fsync = dir_sync.os.fsync

    def observed_fsync(fd: int) -> None:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            real_fsync(fd)  # a temp file's (the patch reaches every os.fsync)
            return
        with lock:
            began = len(renames)
        real_fsync(fd)
        with lock:
            fsyncs.append((began, len(renames)))

    def checked_append(db: Any, kind: str, data: Any, **kw: Any) -> Any:
        name = str(data["path"]).rsplit("/", 1)[-1]
        with lock:
            at = max(i for i, n in enumerate(renames) if n == name)
            seen_at_entry[f"{name}#{at}"] = sum(1 for began, _ in fsyncs if began > at)
        return append_in(db, kind, data, **kw)

    monkeypatch.setattr(fsops, "rename_into", counting_rename)
    monkeypatch.setattr(dir_sync.os, "fsync", observed_fsync)
    monkeypatch.setattr(env.journal, "append_in", checked_append)
    commits: list[str] = []
    env.store._db.set_trace_callback(lambda sql: sql == "COMMIT" and commits.append(sql))
    errors: list[BaseException] = []
    start = threading.Barrier(WRITERS)

    def one(k: int) -> None:
        try:
            base = sha(f"v0 {k}\n".encode())
            start.wait()
            for r in range(1, ROUNDS + 1):
                p = WriteParams(
                    workspace=WS, path=f"d/f{k}.txt", content=f"v{r} {k}\n", base_sha256=base
                )
                base = env.writer.write(env.ws, write_request(p), ACTOR).new_sha256 or ""
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    entries = [e for e in env.journal.read(limit=1000) if e.kind == "fs.write"]
    assert len(entries) == WRITERS * ROUNDS == len(renames)
    # The journal's order is the renames' (the commit lock's) order.
    assert [str(e.data["path"]).rsplit("/", 1)[-1] for e in entries] == renames
    # Every entry was written after a directory fsync that began after its rename.
    assert len(seen_at_entry) == len(renames) and min(seen_at_entry.values()) >= 1
    for k in range(WRITERS):
        assert (env.root / f"d/f{k}.txt").read_text() == f"v{ROUNDS} {k}\n"
    assert env.journal.verify() is None
    assert not env.store.query("SELECT * FROM write_intents")
    # Shared: fewer directory fsyncs and commits than writes (8 at once).
    assert len(fsyncs) <= len(renames) and len(commits) < 2 * len(renames)


def test_a_failed_directory_fsync_fails_its_write_alone(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fsync after a rename fails: that write raises and gets no entry (its intent
    stays for the next start to settle), its reserved place is given up, and the next
    write commits as usual."""
    real_fsync = dir_sync.os.fsync
    failing = [True]

    def flaky(fd: int) -> None:
        if failing[0] and stat.S_ISDIR(os.fstat(fd).st_mode):
            failing[0] = False
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(dir_sync.os, "fsync", flaky)
    p = WriteParams(workspace=WS, path="d/f0.txt", content="v1 0\n", base_sha256=sha(b"v0 0\n"))
    with pytest.raises(OSError, match="Input/output error"):
        env.writer.write(env.ws, write_request(p), ACTOR)
    assert not [e for e in env.journal.read(limit=100) if e.kind == "fs.write"]
    assert len(env.store.query("SELECT * FROM write_intents")) == 1  # the next start's
    q = WriteParams(workspace=WS, path="d/f1.txt", content="v1 1\n", base_sha256=sha(b"v0 1\n"))
    env.writer.write(env.ws, write_request(q), ACTOR)
    entries = [e for e in env.journal.read(limit=100) if e.kind == "fs.write"]
    assert [e.data["path"] for e in entries] == ["demo:d/f1.txt"]
    env.store.group.flush()  # nothing left waiting on the dropped place
