"""Temp files in workspaces: recorded before they exist, so only ours are ever cleaned.

Theory of operation. A guarded write (and the write gate restoring a file) puts its new
bytes in `.substrate-tmp-<16 hex>` in the target's directory, then renames it over the
target. The name is a row `(workspace, dir, name, epoch)` committed (fsynced) to the
state database before the file is created (`TempFiles.create`); the row is deleted in the
transaction that journals the applied write (or once the restore's rename is done), or
after the temp file is unlinked when the write fails (`TempFiles.discard`).

For guarded writes (`TempFiles(..., reserve=RESERVE)`, `writer`) `create` does not
commit a row per file: it takes a name reserved earlier for that directory, and when
none is left it reserves `RESERVE` fresh ones there in one commit, so a run of writes in
one directory pays one fsynced commit per `RESERVE` files instead of one each. A
reserved name is durable before any file has it, which is all the cleaner relies on; a
reservation never used is a row naming a file that never existed, which the cleaner
passes over. At most `RESERVE` names are held for each of the `RESERVED_DIRS`
directories used last (an older directory's are deleted).

A single guarded write tops a directory's reserve up on the commit it makes anyway:
when fewer than `RESERVE // 2` names are left there (`top_up`), `RESERVE` fresh ones
are recorded in the transaction of its intent (`intents`, committed before its rename)
and join the reserve once that commit is durable (`topped_up`). A steady run of writes
in one directory thus pays no commit of its own for names after the first.

A batch of writes (`batch_files`) commits the rows of all its temp files in one
transaction before creating the first (`record_many_in`) and forgets them in the one
that journals the batch (`forget_many_in`). A crash therefore leaves, at worst, rows
naming files that may exist. At the next start `WorkspaceRegistry.clean_stale_temp_files`
visits exactly the rows of earlier runs (epochs, `stale`) and `remove_recorded` opens
each recorded directory beneath the workspace root fd without following a symlink and
unlinks the name only if it is still a regular file.

A file with the prefix that substrate never recorded - a user's, or a sandbox's - is never
touched, whatever its age; guarded writes refuse names with the prefix
(`check_not_reserved`), so an agent cannot make one through substrate either.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence

from substrate.errors import PathDenied, Refusal
from substrate.fs import fsops, paths
from substrate.store.db import Store

TEMP_PREFIX = ".substrate-tmp-"
#: Names reserved (recorded) at once for a directory that has none left.
RESERVE = 8
#: Directories whose unused reserved names are kept; past this the least recently used
#: directory's are dropped (their rows deleted).
RESERVED_DIRS = 16

SCHEMA = """
CREATE TABLE IF NOT EXISTS temp_files (
    workspace TEXT NOT NULL,
    dir TEXT NOT NULL,
    name TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    PRIMARY KEY (workspace, dir, name)
);
"""


def new_name() -> str:
    """A fresh random temp-file name (`TEMP_PREFIX` + 16 hex)."""
    return TEMP_PREFIX + secrets.token_hex(8)


#: A recorded temp file: workspace id, directory components beneath its root, name.
Record = tuple[str, tuple[str, ...], str]


def _dir_key(dirs: Sequence[str]) -> str | bytes:
    """The `dir` column: the components joined by `/`, as bytes (a BLOB) when a name is
    not UTF-8 (a sandbox may make any name; SQLite text cannot hold its bytes)."""
    joined = "/".join(dirs)
    try:
        joined.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(joined)
    return joined


class TempFiles:
    """The temp files in workspaces, as recorded in the state database by run (epoch).

    Every method is blocking (one SQLite transaction, fsynced); call it from a thread.
    """

    def __init__(self, store: Store, epoch: int, *, reserve: int = 1) -> None:
        self._store = store
        self._epoch = epoch
        #: Names recorded at once for a directory that has none left: `RESERVE` for the
        #: guarded writes' run of files, 1 (a commit per file, no row left behind) for
        #: rarer users such as the gate's restores.
        self._reserve = max(1, reserve)
        store.ensure_schema(SCHEMA)
        #: (workspace, dir key) → names recorded in this run and not yet used, most
        #: recently used directory last.
        self._reserved: OrderedDict[tuple[str, str | bytes], list[str]] = OrderedDict()
        self._reserved_lock = threading.Lock()
        #: Directories whose top-up (`top_up`) is on its way to the database.
        self._topping: set[tuple[str, str | bytes]] = set()

    def record(self, workspace: str, dirs: Sequence[str], name: str) -> None:
        """Commit the row for a temp file about to be created (before creating it)."""
        with self._store.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO temp_files(workspace, dir, name, epoch)"
                " VALUES (?, ?, ?, ?)",
                (workspace, _dir_key(dirs), name, self._epoch),
            )

    def record_many_in(
        self, db: sqlite3.Connection, workspace: str, temps: Sequence[tuple[Sequence[str], str]]
    ) -> None:
        """Record the temp files `(dirs, name)` about to be created, inside the caller's
        transaction (a batch's: committed before the first is created)."""
        db.executemany(
            "INSERT OR REPLACE INTO temp_files(workspace, dir, name, epoch) VALUES (?, ?, ?, ?)",
            [(workspace, _dir_key(dirs), name, self._epoch) for dirs, name in temps],
        )

    @staticmethod
    def forget_many_in(
        db: sqlite3.Connection, workspace: str, temps: Sequence[tuple[Sequence[str], str]]
    ) -> None:
        """`forget_in` for many temp files in one statement."""
        db.executemany(
            "DELETE FROM temp_files WHERE workspace = ? AND dir = ? AND name = ?",
            [(workspace, _dir_key(dirs), name) for dirs, name in temps],
        )

    def create(
        self, workspace: str, dir_fd: int, dirs: Sequence[str], where: str
    ) -> tuple[str, int]:
        """Create (`O_CREAT | O_EXCL | O_NOFOLLOW`, 0600) a new temp file under a recorded
        name in `dir_fd`, the directory `dirs` beneath the workspace's root. Returns its
        name and an fd open for writing; the caller renames it or `discard`s it.

        The name was recorded (committed, fsynced) before the file exists, so a crash at
        any later point leaves a record to clean by. A name that something already holds
        (maybe planted) is passed over for another. Refuses `path_denied` when eight
        recorded names in a row are taken. Costs one commit per `reserve` files made in
        a directory, and one more when a creation fails.
        """
        for _ in range(8):
            name = self._take(workspace, dirs)
            try:
                fd = fsops.create_exclusive(dir_fd, name)
            except BaseException as exc:
                # Not ours (something holds the name, a symlink included) or not made:
                # the record must go.
                self.forget(workspace, dirs, name)
                if isinstance(exc, FileExistsError):
                    continue
                raise
            return name, fd
        raise PathDenied(f"{where}: could not create a temp file")

    def _take(self, workspace: str, dirs: Sequence[str]) -> str:
        """A name recorded for `dirs` in this run and never used: a reserved one, or the
        first of the `reserve` fresh ones recorded now (one commit)."""
        key = (workspace, _dir_key(dirs))
        with self._reserved_lock:
            names = self._reserved.get(key)
            if names:
                self._reserved.move_to_end(key)
                return names.pop()
        fresh = [new_name() for _ in range(self._reserve)]
        evicted: list[tuple[tuple[str, str | bytes], list[str]]] = []
        with self._reserved_lock:
            while len(self._reserved) >= RESERVED_DIRS and key not in self._reserved:
                evicted.append(self._reserved.popitem(last=False))
        with self._store.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO temp_files(workspace, dir, name, epoch)"
                " VALUES (?, ?, ?, ?)",
                [(workspace, key[1], name, self._epoch) for name in fresh],
            )
            # Names of directories no longer kept will never be used: their rows go
            # (a row naming no file is harmless; this only keeps the table small).
            db.executemany(
                "DELETE FROM temp_files WHERE workspace = ? AND dir = ? AND name = ?",
                [(ws, d, name) for (ws, d), names in evicted for name in names],
            )
        if len(fresh) > 1:
            # Only once committed: a name is handed out only when its row is durable.
            with self._reserved_lock:
                # Kept last first: `pop` takes them in the order they were made.
                self._reserved.setdefault(key, [])[:0] = reversed(fresh[1:])
                self._reserved.move_to_end(key)
        return fresh[0]

    def top_up(self, workspace: str, dirs: Sequence[str]) -> TopUp | None:
        """Fresh names for `dirs` to record inside a transaction the caller commits anyway
        (`TopUp.record_in`), when its reserve runs low and no top-up is under way; None
        otherwise. The caller ends it with `topped_up` (after the commit, or not)."""
        if self._reserve < 2:
            return None
        key = (workspace, _dir_key(dirs))
        with self._reserved_lock:
            names = self._reserved.get(key)
            if names is None or len(names) >= self._reserve // 2 or key in self._topping:
                return None
            self._topping.add(key)
        fresh = [new_name() for _ in range(self._reserve)]
        return TopUp(key, fresh, [(workspace, key[1], name, self._epoch) for name in fresh])

    def topped_up(self, top: TopUp, committed: bool) -> None:
        """End `top`: its names join the reserve when `committed` (durable: only then is
        a name handed out); else they are left (a row naming no file is harmless)."""
        with self._reserved_lock:
            self._topping.discard(top.key)
            if committed and top.key in self._reserved:
                self._reserved[top.key][:0] = reversed(top.names)

    def discard(self, workspace: str, dir_fd: int, dirs: Sequence[str], name: str) -> None:
        """Unlink a temp file that will not be renamed, then forget its record."""
        fsops.unlink_quietly(dir_fd, name)
        self.forget(workspace, dirs, name)

    def forget(self, workspace: str, dirs: Sequence[str], name: str) -> None:
        """Delete the row of a temp file that is gone (renamed or unlinked)."""
        with self._store.transaction() as db:
            self.forget_in(db, workspace, dirs, name)

    @staticmethod
    def forget_in(db: sqlite3.Connection, workspace: str, dirs: Sequence[str], name: str) -> None:
        """`forget` inside the caller's transaction (the one journaling the write)."""
        db.execute(
            "DELETE FROM temp_files WHERE workspace = ? AND dir = ? AND name = ?",
            (workspace, _dir_key(dirs), name),
        )

    def stale(self) -> list[Record]:
        """Rows left by earlier runs: their writes can no longer be in flight."""
        rows = self._store.query(
            "SELECT workspace, dir, name FROM temp_files WHERE epoch < ?"
            " ORDER BY workspace, dir, name",
            (self._epoch,),
        )
        out: list[Record] = []
        for row in rows:
            raw = row["dir"]
            joined = os.fsdecode(raw) if isinstance(raw, bytes) else str(raw)
            out.append((str(row["workspace"]), tuple(filter(None, joined.split("/"))), row["name"]))
        return out


class TopUp:
    """Names to record for a directory inside another commit (`TempFiles.top_up`)."""

    __slots__ = ("key", "names", "rows")

    def __init__(
        self, key: tuple[str, str | bytes], names: list[str], rows: list[tuple[object, ...]]
    ) -> None:
        self.key = key
        self.names = names
        self.rows = rows

    def record_in(self, db: sqlite3.Connection) -> None:
        """Insert the names' rows inside the caller's transaction."""
        db.executemany(
            "INSERT OR REPLACE INTO temp_files(workspace, dir, name, epoch) VALUES (?, ?, ?, ?)",
            self.rows,
        )


def remove_recorded(root_fd: int, dirs: Sequence[str], name: str) -> bool | None:
    """Unlink a recorded temp file if it is still there as a regular file or a symlink
    (a change set's link is made under a temp name too: `batch_links`; unlinking a
    link never touches what it points to).

    Returns True when it was removed, False when nothing is to be done (absent, not a
    regular file or a link, its directory gone or reached only through a symlink), None when it
    could not be decided now (keep the record and try at the next start). Never follows
    a symlink: the directory is opened beneath `root_fd` as every read and write does.
    """
    if not name.startswith(TEMP_PREFIX) or "/" in name:
        return False  # not a name substrate makes: never touched
    try:
        parent = paths.open_dir(root_fd, dirs, "temp file")
    except Refusal as refusal:
        return None if refusal.name in ("internal", "path_denied") else False
    except OSError:
        return None
    try:
        found = paths.lstat_at(parent, name)
        if found is None or not (stat.S_ISREG(found.st_mode) or stat.S_ISLNK(found.st_mode)):
            return False
        os.unlink(name, dir_fd=parent)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return None
    finally:
        os.close(parent)


def check_not_reserved(parts: tuple[str, ...], where: str) -> None:
    """Refuse a name substrate uses for its temp files: it must never write or delete one."""
    if any(part.startswith(TEMP_PREFIX) for part in parts):
        raise PathDenied(
            f"{where}: names starting with {TEMP_PREFIX!r} are reserved for substrate's temp files",
            reserved_prefix=TEMP_PREFIX,
        )
