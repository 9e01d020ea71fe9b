"""Write intents: each guarded write's journal entry, durable before its change lands.

The journal entry a guarded write will get, recorded before its change lands, so a crash
between a change landing and its journal entry never leaves it unjournaled.

Theory of operation. Every guarded write records, before its rename (or unlink), a row
holding the journal entry each of its changes will get: `(batch, workspace, epoch,
intents)` (msgpack of `(path, kind, actor, data, temp)`). A batch (`batch_files`,
`batch_dirs`) commits one row for all its changes with its temp-file records; a single
write (`fs.write`, `fs.patch`, `fs.delete`, a restore's file, an upload's commit)
`submit`s one for itself on the store's group commit, which a helper thread commits
while the writer writes and fsyncs its temp file (the two flushes overlap; the commit is
shared with concurrent writers' entries), and waits for it before the rename
(`Pending.wait`). The transaction that journals the write deletes that row. A row of an
earlier run (epoch) is therefore a write whose entries were never written: it died
somewhere between recording and journaling.

At the next start, before anything writes (`resolve`, from `Writer.recover`), each
change of such a row is checked against the checkout: when the path holds exactly what
the change makes (a file's digest and mode, absent for a delete, a directory made,
removed or given its mode) and its temp file (`temp`) is no longer there (renamed over
the target), the change landed, and its entry is journaled now with `recovered: true`;
otherwise it did not land (the temp file is still there; or something else was written
there since, which then is not ours to claim). Several unjournaled writes of one file
(concurrent writes whose entries were to share one commit) are followed back from what
the file holds now through their bases, so every one that landed is journaled, in the
order they landed. Then the rows are dropped. Rows of a workspace that is not adopted
stay until a start that knows it.

Blocking SQLite and file reads: call from a worker thread or before the loop serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from substrate.errors import NotFound, Refusal
from substrate.fs import paths
from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.group import GroupCommit, Ticket
from substrate.store.journal import Draft, Journal
from substrate.workspace.adopted import Workspace
from substrate.workspace.digests import hash_fd

SCHEMA = """
CREATE TABLE IF NOT EXISTS write_intents (
    batch TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    intents BLOB NOT NULL
);
-- The rows are the writes in flight (and, at a start, those a crash left): read only at
-- a start, by a scan. An index would cost every write's intent and entry a page more.
DROP INDEX IF EXISTS write_intents_workspace;
"""

#: The journal kinds of a batch: a file's change, a directory's, a symlink's.
FILE_KIND = "changes.apply"
DIR_KIND = "changes.apply_dir"
LINK_KIND = "changes.apply_link"


class Intent(msgspec.Struct, frozen=True, array_like=True):
    """One change's journal entry-to-be: `rel` is its workspace-relative path, `temp`
    the temp file its rename consumes (None: a batch's, or a delete)."""

    rel: str
    kind: str
    actor: str
    data: dict[str, Any]
    temp: str | None = None


class _Committer:
    """The one thread that leads intents' group commits while their writers fill their
    temp files, started on first use: it takes tickets from a queue and leads the
    commit that holds each (`GroupCommit.wait`). The writer later waits on the ticket
    itself, so the outcome reaches it through the group commit's own wake-up, with no
    future in between; an error is the writer's to see there."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[GroupCommit, Ticket[None]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def lead(self, group: GroupCommit, ticket: Ticket[None]) -> None:
        """Have the thread lead `ticket`'s commit soon; returns at once."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="write-intents", daemon=True
                    )
                    self._thread.start()
        self._jobs.put((group, ticket))

    def _run(self) -> None:
        while True:
            group, ticket = self._jobs.get()
            with contextlib.suppress(Exception):
                group.wait(ticket)  # its error is its writer's (`Pending.wait`)


_committer = _Committer()


def _forget_committer() -> None:
    # A forked child has none of its parent's threads (nor their locks): it starts its own.
    global _committer
    _committer = _Committer()


os.register_at_fork(after_in_child=_forget_committer)


class Pending:
    """One write's intent on its way to the database (`Intents.submit`)."""

    __slots__ = ("_group", "_ticket", "token")

    def __init__(self, token: str, group: GroupCommit, ticket: Ticket[None]) -> None:
        #: The row's key, for `Intents.drop_in` in the transaction journaling the write.
        self.token = token
        self._group = group
        self._ticket = ticket

    def wait(self) -> None:
        """Return once the intent is durable; raises what its commit raised. Call
        before the rename. (Free when the committer thread has committed it; leads the
        commit itself when that thread has not begun it.)"""
        self._group.wait(self._ticket)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Intent])


class Intents:
    """The `write_intents` table, for one run (`epoch`): one row per batch in flight."""

    def __init__(self, store: Store, journal: Journal) -> None:
        self._store = store
        self._journal = journal
        self._epoch = journal.epoch
        self._approvals = Approvals(store)
        store.ensure_schema(SCHEMA)

    def add_in(self, db: sqlite3.Connection, workspace: str, intents: Sequence[Intent]) -> str:
        """Record a batch's `intents` inside the caller's transaction (committed before
        its first change lands); returns the batch's token, for `drop_in`. Costs one
        row (the intents as msgpack)."""
        batch = secrets.token_hex(8)
        db.execute(
            "INSERT INTO write_intents(batch, workspace, epoch, intents) VALUES (?, ?, ?, ?)",
            (batch, workspace, self._epoch, _encoder.encode(list(intents))),
        )
        return batch

    def submit(
        self,
        workspace: str,
        intent: Intent,
        also: Callable[[sqlite3.Connection], None] | None = None,
    ) -> Pending:
        """Queue one write's `intent` on the store's group commit and return at once: it
        commits with whatever else is committed next (concurrent writers' entries), or
        when the writer `wait`s for it. `also` runs in the same unit (a temp-name
        top-up: `temp_files.TempFiles.top_up`). Costs one row, and a commit unless
        shared."""
        token = secrets.token_hex(8)
        row = (token, workspace, self._epoch, _encoder.encode([intent]))

        def add(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO write_intents(batch, workspace, epoch, intents) VALUES (?, ?, ?, ?)",
                row,
            )
            if also is not None:
                also(db)

        group = self._store.group
        # No entry's order depends on it: it may pass a write's place still waiting for
        # its directory fsync (`GroupCommit.reserve`).
        ticket = group.submit(add, ordered=False)
        # Committed by another thread while the caller writes and fsyncs its temp file:
        # the two flushes overlap instead of adding up.
        _committer.lead(group, ticket)
        return Pending(token, group, ticket)

    def record(self, workspace: str, intent: Intent) -> Pending:
        """`submit` and wait: the intent is durable on return (for a write that knows
        its entry only under the commit lock: its approval's id)."""
        pending = self.submit(workspace, intent)
        pending.wait()
        return pending

    @staticmethod
    def drop_in(db: sqlite3.Connection, batch: str) -> None:
        """Delete a batch's row inside the transaction that journals its changes."""
        db.execute("DELETE FROM write_intents WHERE batch = ?", (batch,))

    def stale_workspaces(self) -> list[str]:
        """The workspaces holding rows of earlier runs."""
        rows = self._store.query(
            "SELECT DISTINCT workspace FROM write_intents WHERE epoch < ? ORDER BY workspace",
            (self._epoch,),
        )
        return [str(r["workspace"]) for r in rows]

    def resolve(self, ws: Workspace) -> int:
        """Journal, `recovered: true`, every change of an earlier run in `ws` that landed
        (the checkout holds its result, its temp file is gone) but was never journaled,
        consuming the approvals those entries name, and drop every row of earlier runs
        in `ws`; returns how many were journaled. For a directory named in several rows
        only the latest counts; a file's writes are followed back through their bases
        (see the module doc). Costs a query, and a read (a hash) per path."""
        rows = self._store.query(
            "SELECT batch, intents FROM write_intents WHERE workspace = ? AND epoch < ?"
            " ORDER BY rowid",
            (ws.id, self._epoch),
        )
        dirs: dict[str, tuple[int, Intent]] = {}
        files: dict[str, list[tuple[int, Intent]]] = {}
        links: dict[str, list[tuple[int, Intent]]] = {}
        at = 0
        for row in rows:
            for it in _decoder.decode(row["intents"]):
                if it.kind == DIR_KIND:
                    dirs[it.rel] = (at, it)
                elif it.kind == LINK_KIND:
                    links.setdefault(it.rel, []).append((at, it))
                else:
                    files.setdefault(it.rel, []).append((at, it))
                at += 1
        landed: list[tuple[int, Intent]] = []
        with ws.use():
            landed += [(i, it) for i, it in dirs.values() if _dir_holds(ws, it)]
            chains = [(rel, its, False) for rel, its in files.items()]
            chains += [(rel, its, True) for rel, its in links.items()]
            for rel, its, link in chains:
                chain = _landed_chain(ws, rel, its, link=link)
                # Journaled in the order they landed, at the places of their rows.
                landed += zip(sorted(i for i, _ in chain), [it for _, it in chain], strict=True)
        landed.sort(key=lambda pair: pair[0])
        drafts = [
            Draft(it.kind, {**it.data, "recovered": True}, ws.id, it.actor) for _, it in landed
        ]
        approvals = [str(a) for _, it in landed if (a := it.data.get("approval_id")) is not None]
        with self._store.transaction() as db:
            self._journal.append_many_in(db, drafts)
            for approval in approvals:
                self._approvals.consume_in(db, approval, time.time())
            db.executemany(
                "DELETE FROM write_intents WHERE batch = ?", [(r["batch"],) for r in rows]
            )
        return len(drafts)


def _dir_holds(ws: Workspace, it: Intent) -> bool:
    """The checkout holds what the directory step `it` makes."""
    parts = tuple(it.rel.split("/"))
    op, mode = it.data.get("op"), it.data.get("mode")
    try:
        with paths.opened_dir(ws.root_fd, parts[:-1], it.rel) as parent:
            st = paths.lstat_at(parent, parts[-1])
    except NotFound:
        return op == "rmdir"
    except Refusal:
        return False
    if st is None:
        return op == "rmdir"
    return stat.S_ISDIR(st.st_mode) and (
        op == "mkdir" or (op == "chmod" and stat.S_IMODE(st.st_mode) == mode)
    )


def _landed_chain(
    ws: Workspace, rel: str, its: list[tuple[int, Intent]], *, link: bool = False
) -> list[tuple[int, Intent]]:
    """Which of the unjournaled changes `its` of the file `rel` (a symlink's, `link`)
    landed, oldest first: the latest whose result the path holds now (digest and mode;
    absent for a delete) and whose temp file is gone, then the latest whose result is
    that one's base, and so on. Empty when the path is not a regular file (a link), nor
    absent, or is unreadable; a file's delete landed when a link stands there now."""
    parts = tuple(rel.split("/"))
    try:
        with paths.opened_dir(ws.root_fd, parts[:-1], rel) as parent:
            state = _link_state if link else _file_state
            sha, mode = state(parent, parts[-1], rel)
            left = list(its)
            chain: list[tuple[int, Intent]] = []
            while True:
                found = next(
                    (
                        (i, it)
                        for i, it in reversed(left)
                        if it.data.get("new_sha256") == sha
                        and (chain or sha is None or it.data.get("mode") == mode)
                        and (it.temp is None or paths.lstat_at(parent, it.temp) is None)
                    ),
                    None,
                )
                if found is None:
                    return chain[::-1]
                chain.append(found)
                left.remove(found)
                sha = found[1].data.get("base_sha256")
    except NotFound:
        # The directory is gone: only deletes can have landed, and only the latest.
        deletes = [(i, it) for i, it in its if it.data.get("new_sha256") is None]
        return deletes[-1:]
    except (Refusal, OSError):
        return []


def _file_state(parent: int, name: str, rel: str) -> tuple[str | None, int | None]:
    """(digest, mode) of the regular file `name` in `parent`, (None, None) when absent
    or a symlink; refuses `not_a_file` for anything else. Hashed as a stream."""
    st = paths.lstat_at(parent, name)
    if st is None or stat.S_ISLNK(st.st_mode):  # a link stands where the file was
        return None, None
    fd = paths.open_regular(parent, name, rel)
    try:
        return hash_fd(fd), stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _link_state(parent: int, name: str, rel: str) -> tuple[str | None, int | None]:
    """(digest of its target, None) of the symlink `name` in `parent` (read, never
    followed), (None, None) when absent or not a link (a link's delete landed)."""
    st = paths.lstat_at(parent, name)
    if st is None or not stat.S_ISLNK(st.st_mode):
        return None, None
    target = os.readlink(os.fsencode(name), dir_fd=parent)
    return hashlib.sha256(target).hexdigest(), None
