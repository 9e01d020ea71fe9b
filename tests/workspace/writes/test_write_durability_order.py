"""The order of one guarded write's durable steps (docs/protocol.md §4), recorded from the
calls it makes: the temp file's fsync and the intent's commit before the rename, the
directory fsync after it, the journal entry written and committed only after that
fsync, the reply after the commit; and the replaced file, held open across the rename,
closed only after the directory fsync (never freed inside the rename)."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from substrate.fs import fsops
from substrate.store.group import GroupCommit
from substrate.workspace.writes import writer
from tests.workspace.writes.test_writer import Env, open_env


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    e = open_env(adopt_root, tmp_path / "state", make_workspace("demo", {"d/f.txt": "v0\n"}), None)
    try:
        yield e
    finally:
        e.registry.close()
        e.store.close()


class Recorder:
    """The write's steps, in the order they ended (one list, any thread)."""

    def __init__(self, env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
        self.env = env
        self.events: list[str] = []
        self._lock = threading.Lock()
        #: The inode of the file the write replaces, and whether it was open at the rename.
        self.old_ino = os.stat(env.root / "d" / "f.txt").st_ino
        self.old_open_at_rename = False
        real_fsync, real_rename = os.fsync, fsops.rename_into
        real_commit, real_release = GroupCommit._commit, writer.RELEASER.release
        real_append = env.journal.append_in

        def fsync(fd: int) -> None:
            real_fsync(fd)
            self.note("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync temp")

        def rename_into(dir_fd: int, temp: str, name: str, *, fsync: bool = True) -> None:
            self.old_open_at_rename = self.holds(self.old_ino)
            real_rename(dir_fd, temp, name, fsync=fsync)
            self.note("rename")

        def commit(group: GroupCommit, batch: list[Any]) -> None:
            real_commit(group, batch)
            # What the committed (synchronous=FULL: durable) database holds now.
            intents = env.store.query("SELECT COUNT(*) AS n FROM write_intents")[0]["n"]
            self.note(f"commit: {intents} intent(s), {len(env.write_entries())} entry(ies)")

        def release(fd: int) -> None:
            ino = os.fstat(fd).st_ino
            real_release(fd)
            self.note("release old" if ino == self.old_ino else "release other")

        def append_in(*args: Any, **kwargs: Any) -> Any:
            self.note("entry written")
            return real_append(*args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(fsops, "rename_into", rename_into)
        monkeypatch.setattr(GroupCommit, "_commit", commit)
        monkeypatch.setattr(writer.RELEASER, "release", release)
        monkeypatch.setattr(env.journal, "append_in", append_in)

    def note(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    @staticmethod
    def holds(ino: int) -> bool:
        """Does this process hold an fd of the inode `ino`?"""
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.stat(f"/proc/self/fd/{name}").st_ino == ino:
                    return True
            except OSError:
                continue
        return False

    def at(self, event: str) -> int:
        assert event in self.events, (event, self.events)
        return self.events.index(event)


def test_temp_file_and_intent_durable_before_the_rename_entry_after_the_directory(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder(env, monkeypatch)
    plan = env.write("d/f.txt", "v1\n", env.sha("d/f.txt"))
    rec.note("returned")
    assert plan.applied and (env.root / "d" / "f.txt").read_text() == "v1\n"
    ev = rec.events
    rename = rec.at("rename")
    # Before the rename: the temp file's bytes, and a commit holding the intent.
    assert rec.at("fsync temp") < rename
    assert rec.at("commit: 1 intent(s), 0 entry(ies)") < rename
    # After it: the directory, then the entry written and committed, then the reply.
    dir_fsync = rec.at("fsync dir")
    assert rename < dir_fsync < rec.at("entry written")
    assert rec.at("entry written") < rec.at("commit: 0 intent(s), 1 entry(ies)")
    assert rec.at("commit: 0 intent(s), 1 entry(ies)") < rec.at("returned")
    # No entry in any commit before the directory fsync.
    assert not any("1 entry" in e for e in ev[:dir_fsync])
    # The replaced file was open across the rename and let go only after the directory
    # fsync, so the rename did not free it.
    assert rec.old_open_at_rename
    assert dir_fsync < rec.at("release old") < rec.at("returned")


def test_a_write_whose_directory_fsync_fails_lets_go_of_the_replaced_file_and_has_no_entry(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename landed but was not made durable: the write raises, its intent stays for
    the next start to settle, no entry is written, and the replaced file's fd is not
    leaked (it is let go, through the releaser or at once)."""
    rec = Recorder(env, monkeypatch)
    recorded_fsync = os.fsync

    def failing(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(5, "Input/output error")
        recorded_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        env.write("d/f.txt", "v1\n", env.sha("d/f.txt"))
    assert "entry written" not in rec.events
    assert rec.at("rename") < rec.at("release old")
    assert env.write_entries() == []
    assert env.store.query("SELECT COUNT(*) AS n FROM write_intents")[0]["n"] == 1
