"""The SQLite side of the journal export: committed entries in batches, and the cursor.

Theory of operation. `JournalSource` reads the state database's `journal` table on a
read-only connection of its own, never the daemon's: in WAL mode a reader takes no
lock a writer waits for, so reading, however slow, never delays a request. It reads
only committed entries, in seq order, at most `max_entries` or about `max_bytes` of
data per batch, so memory stays bounded whatever the journal's length.

The cursor (`journal_export_cursor`, in the same database) is the highest seq known to
be in PostgreSQL for one target (node and database). It is written through the store's
own transactions (`Cursors`), briefly, and may lag behind PostgreSQL: an entry shipped
again is inserted once (docs/fleet.md, "Exactly once").
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from substrate.export.postgres import Row

__all__ = ["CURSOR_SCHEMA", "Cursors", "JournalSource"]

CURSOR_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS journal_export_cursor ("
    "target TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, updated REAL NOT NULL)"
)


class JournalSource:
    """Committed journal entries of one state database, read on a connection of its
    own. Blocking; one thread at a time."""

    def __init__(self, database: Path, node: str) -> None:
        self.node = node
        uri = database.absolute().as_uri() + "?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout=5000")
        self._lock = threading.Lock()  # `head` (any thread) and `batch` (the shipper's)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def head(self) -> int:
        """The highest committed seq (0: an empty journal)."""
        with self._lock:
            row = self._db.execute("SELECT MAX(seq) FROM journal").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def batch(self, after: int, max_entries: int, max_bytes: int = 4 << 20) -> list[Row]:
        """Entries with `seq > after`, in order: at most `max_entries`, and no more once
        their data passes `max_bytes` (at least one, whatever its size)."""
        rows: list[Row] = []
        size = 0
        with self._lock:
            cur = self._db.execute(
                "SELECT epoch, seq, ts, kind, workspace, actor, data, prev, hash FROM journal"
                " WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, max_entries),
            )
            try:
                for epoch, seq, ts, kind, workspace, actor, data, prev, digest in cur:
                    rows.append(
                        (self.node, epoch, seq, ts, kind, workspace, actor, data, prev, digest)
                    )
                    size += len(data)
                    if size >= max_bytes:
                        break
            finally:
                cur.close()
        return rows


class Cursors:
    """The `journal_export_cursor` table, written in transactions the caller gives
    (`Store.transaction`, or a connection of the command line's own)."""

    def __init__(self, transaction: Callable[[], AbstractContextManager[sqlite3.Connection]]):
        self._transaction = transaction
        with transaction() as db:
            db.execute(CURSOR_SCHEMA)

    def load(self, target: str) -> int:
        with self._transaction() as db:
            row = db.execute(
                "SELECT last_seq FROM journal_export_cursor WHERE target = ?", (target,)
            ).fetchone()
        return int(row[0]) if row else 0

    def save(self, target: str, last_seq: int, now: float) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO journal_export_cursor(target, last_seq, updated) VALUES (?, ?, ?)"
                " ON CONFLICT(target) DO UPDATE SET last_seq = excluded.last_seq,"
                " updated = excluded.updated",
                (target, last_seq, now),
            )
