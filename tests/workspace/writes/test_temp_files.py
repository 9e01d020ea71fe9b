"""substrate.workspace.writes.temp_files: guarded-write temp files are recorded, and only
recorded ones cleaned.

In-process tests drive `WorkspaceRegistry.clean_stale_temp_files` and `Writer` over a
private state dir (a "restart" is a new Journal, hence a new epoch, on the same database);
the daemon test restarts a real daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.config import Config
from substrate.protocol.client import Client
from substrate.schema.fs import WriteParams, write_request
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace, WorkspaceRegistry
from substrate.workspace.writes import Writer
from substrate.workspace.writes.temp_files import RESERVE, RESERVED_DIRS, TEMP_PREFIX, TempFiles
from tests.harness import wait_until

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

PATIENCE_S = 30.0
OLD = (1_000_000_000, 1_000_000_000)  # a time long before any run


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Env:
    """An in-process registry and writer; `restart()` is a daemon start on the same state."""

    config: Config
    state: Path
    root: Path
    store: Store
    journal: Journal
    registry: WorkspaceRegistry
    ws: Workspace

    def restart(self) -> None:
        self.registry.close()
        self.store.close()
        self.store = Store(self.state / "substrate.db")
        self.journal = Journal(self.store)
        self.registry = WorkspaceRegistry(self.config, self.store, self.journal, self.state)
        self.ws = self.registry.get(self.ws.id)

    def rows(self) -> list[tuple[str, str, str]]:
        return [
            (r["workspace"], r["dir"], r["name"])
            for r in self.store.query("SELECT * FROM temp_files ORDER BY dir, name")
        ]

    def earlier_run(self) -> TempFiles:
        """The records of a run before this one (what a crashed daemon left)."""
        return TempFiles(self.store, self.journal.epoch - 1)


@pytest.fixture
def env(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Env]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    config = Config(state_dir=str(state), adopt_roots=[str(adopt_root)])
    store = Store(state / "substrate.db")
    journal = Journal(store)
    registry = WorkspaceRegistry(config, store, journal, state)
    root = make_workspace("demo", {"a.txt": "alpha\n", "src/m.py": "x = 1\n"})
    ws = registry.adopt(str(root), None, None, "agent:0")
    e = Env(config, state, root, store, journal, registry, ws)
    try:
        yield e
    finally:
        e.registry.close()
        e.store.close()


def test_cleaner_removes_exactly_the_recorded_files_of_earlier_runs(
    env: Env, tmp_path: Path
) -> None:
    root = env.root
    (root / "deep" / "er").mkdir(parents=True)
    earlier = env.earlier_run()
    stale = [((), "aaaa"), (("src",), "bbbb"), (("deep", "er"), "cccc")]
    for dirs, tail in stale:
        root.joinpath(*dirs, TEMP_PREFIX + tail).write_text("half-written")
        earlier.record(env.ws.id, dirs, TEMP_PREFIX + tail)
    # This run's write in flight: recorded in this epoch, never touched.
    TempFiles(env.store, env.journal.epoch).record(env.ws.id, (), TEMP_PREFIX + "live")
    (root / f"{TEMP_PREFIX}live").write_text("a write of this run, still in flight")
    # Recorded, but what stands there now is not a file substrate made.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{TEMP_PREFIX}dddd").write_text("not ours")
    (root / "link").symlink_to(outside)
    earlier.record(env.ws.id, ("link",), TEMP_PREFIX + "dddd")  # through a symlinked dir
    # A change set's link is made under a recorded temp name too: a recorded link goes
    # (unlinked, never followed: what it points to stays).
    (root / f"{TEMP_PREFIX}sym").symlink_to(outside / f"{TEMP_PREFIX}dddd")
    earlier.record(env.ws.id, (), TEMP_PREFIX + "sym")
    (root / f"{TEMP_PREFIX}dir").mkdir()
    earlier.record(env.ws.id, (), TEMP_PREFIX + "dir")  # a directory now
    earlier.record(env.ws.id, ("gone",), TEMP_PREFIX + "eeee")  # its directory is gone
    earlier.record("ws_0000000000000000", (), TEMP_PREFIX + "ffff")  # no such workspace
    # Never recorded: a user's file with our prefix, however old.
    users = root / f"{TEMP_PREFIX}users-own"
    users.write_text("mine")
    os.utime(users, OLD)

    assert env.registry.clean_stale_temp_files() == 4

    assert not any(root.joinpath(*dirs, TEMP_PREFIX + tail).exists() for dirs, tail in stale)
    assert (root / f"{TEMP_PREFIX}live").exists()
    assert (outside / f"{TEMP_PREFIX}dddd").read_text() == "not ours"
    assert not (root / f"{TEMP_PREFIX}sym").is_symlink()
    assert (root / f"{TEMP_PREFIX}dir").is_dir()
    assert users.read_text() == "mine"
    # Every record of an earlier run is settled; this run's stays until its write ends.
    assert env.rows() == [(env.ws.id, "", TEMP_PREFIX + "live")]
    entry = env.journal.read()[-1]
    assert entry.kind == "workspace.temp_cleaned" and entry.data == {"files": 4}
    assert env.registry.clean_stale_temp_files() == 0
    assert env.journal.read()[-1] == entry  # nothing cleaned: nothing journaled


def test_a_temp_file_is_recorded_before_it_exists_and_forgotten_after(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = Writer(env.store, env.journal)
    seen: list[tuple[list[tuple[str, str, str]], bool]] = []
    real_open = os.open

    opened: list[str] = []

    def watching_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if isinstance(path, str) and path.startswith(TEMP_PREFIX):
            opened.append(path)
            seen.append((env.rows(), os.path.lexists(env.root / "src" / path)))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", watching_open)
    plan = writer.write(
        env.ws,
        write_request(
            WriteParams(workspace=env.ws.id, path="src/new.txt", content="x\n", base_sha256=None)
        ),
        "agent:0",
    )
    assert plan.applied
    [(rows, existed)] = seen
    [name] = opened
    # Committed before the file existed, with the names reserved alongside it.
    assert (env.ws.id, "src", name) in rows and not existed
    assert {(w, d) for w, d, _ in rows} == {(env.ws.id, "src")} and len(rows) == RESERVE
    # Forgotten with the write's journal entry; what stays names no file.
    left = env.rows()
    assert (env.ws.id, "src", name) not in left and len(left) == RESERVE - 1
    assert not any((env.root / "src" / n).exists() for _, _, n in left)


def test_a_crashed_write_is_cleaned_at_a_fast_restart(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon dies between the temp file and the rename; it starts again at once.

    The temp file is as young as can be: only its record says it is a previous run's.
    """

    class Crash(BaseException):
        pass

    def crash(*args: Any) -> None:
        raise Crash

    writer = Writer(env.store, env.journal)
    monkeypatch.setattr(writer, "_commit", crash)
    monkeypatch.setattr(writer, "_abandon", lambda *args: None)  # no cleanup: it died
    with pytest.raises(Crash):
        writer.write(
            env.ws,
            write_request(
                WriteParams(
                    workspace=env.ws.id, path="a.txt", content="new\n", base_sha256=sha(b"alpha\n")
                )
            ),
            "agent:0",
        )
    left = [n for n in os.listdir(env.root) if n.startswith(TEMP_PREFIX)]
    assert len(left) == 1 and (env.ws.id, "", left[0]) in env.rows()
    assert len(env.rows()) == RESERVE  # the file's name and the reserved ones

    env.restart()
    assert env.registry.clean_stale_temp_files() == 1
    assert [n for n in os.listdir(env.root) if n.startswith(TEMP_PREFIX)] == []
    assert env.rows() == []
    assert (env.root / "a.txt").read_text() == "alpha\n"


def test_a_users_prefixed_file_survives_a_daemon_restart(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory()
    root = d.make_workspace(files={"a.txt": "alpha\n"})
    users = root / f"{TEMP_PREFIX}foo"
    users.write_text("the user's own file\n")
    os.utime(users, OLD)
    ws = d.adopt(root)
    d.stop()
    # What a crash leaves: a recorded temp file of that run (written here while it is down).
    ours = root / f"{TEMP_PREFIX}0123456789abcdef"
    ours.write_text("half-written")
    db = sqlite3.connect(d.state_dir / "substrate.db")
    with db:
        db.execute(
            "INSERT INTO temp_files(workspace, dir, name, epoch) VALUES (?, '', ?, 1)",
            (ws, ours.name),
        )
    db.close()

    d.start()
    wait_until(
        lambda: d.journal(kinds={"workspace.temp_cleaned"}),
        PATIENCE_S,
        message="the start-up cleaner never reported",
    )
    assert not ours.exists()
    assert users.read_text() == "the user's own file\n"
    with Client(d.agent_path) as c:
        listed = {e["name"] for e in c.call("fs.list", workspace=ws)["entries"]}
    assert users.name in listed


def test_a_run_of_writes_in_a_directory_records_its_names_with_its_intents(env: Env) -> None:
    writer = Writer(env.store, env.journal)
    commits: list[str] = []
    base = sha(b"x = 1\n")
    env.store._db.set_trace_callback(lambda sql: sql == "COMMIT" and commits.append(sql))
    for i in range(2 * RESERVE + 1):
        data = f"x = {i + 2}\n"
        plan = writer.write(
            env.ws,
            write_request(
                WriteParams(workspace=env.ws.id, path="src/m.py", content=data, base_sha256=base)
            ),
            "agent:0",
        )
        base = plan.new_sha256
    # Per write its intent's commit (before the rename) and its journal entry's (one
    # writer at a time: neither is shared), and one reservation for the first write: the
    # later names ride on intents' commits whenever fewer than RESERVE // 2 are left.
    assert len(commits) == 2 * (2 * RESERVE + 1) + 1
    assert [n for n in os.listdir(env.root / "src") if n.startswith(TEMP_PREFIX)] == []
    assert RESERVE // 2 <= len(env.rows()) < RESERVE + RESERVE // 2


def test_reserved_names_are_bounded_and_a_restart_passes_over_them(env: Env) -> None:
    writer = Writer(env.store, env.journal)
    for i in range(RESERVED_DIRS + 3):
        writer.write(
            env.ws,
            write_request(
                WriteParams(
                    workspace=env.ws.id,
                    path=f"d{i}/f.txt",
                    content="x\n",
                    base_sha256=None,
                    create_parents=True,
                )
            ),
            "agent:0",
        )
    # The oldest directories' names were dropped with their rows.
    assert len(env.rows()) == RESERVED_DIRS * (RESERVE - 1)
    assert {d for _, d, _ in env.rows()} == {f"d{i}" for i in range(3, RESERVED_DIRS + 3)}
    # A user's file at a name never reserved, beside reserved ones: never touched.
    users = env.root / "d5" / f"{TEMP_PREFIX}users-own"
    users.write_text("mine")
    env.restart()
    assert env.registry.clean_stale_temp_files() == 0  # reserved names name no file
    assert env.rows() == [] and users.read_text() == "mine"


def test_a_reservation_that_did_not_commit_hands_out_no_name(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    temps = TempFiles(env.store, env.journal.epoch, reserve=RESERVE)
    real = Store.transaction

    @contextlib.contextmanager
    def failing_commit(self: Store) -> Iterator[sqlite3.Connection]:
        with real(self) as db:
            yield db
            raise sqlite3.OperationalError("disk I/O error")  # rolled back, not committed

    monkeypatch.setattr(Store, "transaction", failing_commit)
    root_fd = os.open(env.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(sqlite3.OperationalError):
            temps.create(env.ws.id, root_fd, (), "demo:x")
        assert env.rows() == []
        assert not any(n.startswith(TEMP_PREFIX) for n in os.listdir(env.root))
        monkeypatch.setattr(Store, "transaction", real)
        name, fd = temps.create(env.ws.id, root_fd, (), "demo:x")
        os.close(fd)
        # A fresh reservation: every name handed out has its row.
        assert (env.ws.id, "", name) in env.rows() and len(env.rows()) == RESERVE
        temps.discard(env.ws.id, root_fd, (), name)
    finally:
        os.close(root_fd)
