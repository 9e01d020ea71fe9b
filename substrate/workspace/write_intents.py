"""Write intents: a batch's journal entries, recorded before its first change lands, so a
crash between a change landing and its journal entry never leaves it unjournaled.

Theory of operation. A batch of guarded writes (`substrate.workspace.batch_writes`)
lands many changes and then journals them all in one transaction. Before the first lands
it commits, with its temp-file records, one row holding the journal entry each change
will get: `(batch, workspace, epoch, intents)` (msgpack of `(path, kind, actor, data)`).
The transaction that journals the batch deletes that row. A row of an earlier run
(epoch) is therefore a batch whose entries were never written: it died somewhere between
recording and journaling.

At the next start, before anything writes (`resolve`, from
`process.layer_recovery.finish_applying`), each change of such a row is checked against
the checkout: when the path holds exactly what the change makes (a file's digest and
mode, absent for a delete, a directory made, removed or given its mode), the change
landed, and its entry is journaled now with `recovered: true`; otherwise it did not land
(or something else was written there since, which then is not ours to claim). Then the
row is dropped. Rows of a workspace that is not adopted stay until a start that knows
it.

Blocking SQLite and file reads: call from a worker thread or before the loop serves.
"""

from __future__ import annotations

import secrets
import sqlite3
import stat
from collections.abc import Sequence
from typing import Any

import msgspec

from substrate.errors import NotFound, Refusal
from substrate.store.db import Store
from substrate.store.journal import Draft, Journal
from substrate.workspace import paths
from substrate.workspace.registry import Workspace
from substrate.workspace.write_base import MAX_PATCH_FILE, read_current

SCHEMA = """
CREATE TABLE IF NOT EXISTS write_intents (
    batch TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    intents BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS write_intents_workspace ON write_intents(workspace, epoch);
"""

#: The journal kinds of a batch: a file's change, a directory's.
FILE_KIND = "changes.apply"
DIR_KIND = "changes.apply_dir"


class Intent(msgspec.Struct, frozen=True, array_like=True):
    """One change's journal entry-to-be: `rel` is its workspace-relative path."""

    rel: str
    kind: str
    actor: str
    data: dict[str, Any]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Intent])


class Intents:
    """The `write_intents` table, for one run (`epoch`): one row per batch in flight."""

    def __init__(self, store: Store, journal: Journal) -> None:
        self._store = store
        self._journal = journal
        self._epoch = journal.epoch
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
        """Journal, `recovered: true`, every change of an earlier run's batch in `ws` that
        landed (the checkout holds its result) but was never journaled, and drop every
        row of earlier runs in `ws`; returns how many were journaled. For a path named
        in several batches only the latest counts. Costs a query, and a read per intent."""
        rows = self._store.query(
            "SELECT batch, intents FROM write_intents WHERE workspace = ? AND epoch < ?"
            " ORDER BY rowid",
            (ws.id, self._epoch),
        )
        latest: dict[tuple[str, str], Intent] = {}
        for row in rows:
            for it in _decoder.decode(row["intents"]):
                latest[(it.kind, it.rel)] = it
        landed: list[Draft] = []
        with ws.use():
            for it in latest.values():
                if _holds(ws, it):
                    data = {**it.data, "recovered": True}
                    landed.append(Draft(it.kind, data, ws.id, it.actor))
        with self._store.transaction() as db:
            self._journal.append_many_in(db, landed)
            db.executemany(
                "DELETE FROM write_intents WHERE batch = ?", [(r["batch"],) for r in rows]
            )
        return len(landed)


def _holds(ws: Workspace, it: Intent) -> bool:
    """The checkout holds what the change `it` makes."""
    parts = tuple(it.rel.split("/"))
    op, mode = it.data.get("op"), it.data.get("mode")
    try:
        with paths.opened_dir(ws.root_fd, parts[:-1], it.rel) as parent:
            st = paths.lstat_at(parent, parts[-1])
            if st is None:
                return op in ("delete", "rmdir")
            if it.kind == DIR_KIND:
                is_dir = stat.S_ISDIR(st.st_mode)
                return is_dir and (
                    op == "mkdir" or (op == "chmod" and stat.S_IMODE(st.st_mode) == mode)
                )
            if op == "delete" or not stat.S_ISREG(st.st_mode):
                return False
            now = read_current(parent, parts[-1], it.rel, MAX_PATCH_FILE)
    except NotFound:
        return op in ("delete", "rmdir")
    except Refusal:
        return False
    return now.sha256 == it.data.get("new_sha256") and now.mode == mode
