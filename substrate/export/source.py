"""The SQLite side of the journal export: committed entries in batches, and the cursor.

Theory of operation. `JournalSource` reads the state database's journal on a read-only
connection of its own (`substrate.store.journal.JournalReader`), never the daemon's: in
WAL mode a reader takes no lock a writer waits for, so reading, however slow, never
delays a request. It reads
only committed entries, in seq order, at most `max_entries` or about `max_bytes` of
data per batch, so memory stays bounded whatever the journal's length.

The cursor (`journal_export_cursor`, in the same database) is the highest seq known to
be in PostgreSQL for one target (node and database). It is written through the store's
own transactions (`Cursors`), briefly, and may lag behind PostgreSQL: an entry shipped
again is inserted once (docs/fleet.md, "Exactly once").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from substrate.export.postgres import Row
from substrate.store.journal import JournalReader

__all__ = ["CURSOR_SCHEMA", "Cursors", "JournalSource"]

CURSOR_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS journal_export_cursor ("
    "target TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, updated REAL NOT NULL)"
)


class JournalSource:
    """Committed journal entries of one state database as rows of `node`, read on a
    connection of their own (`JournalReader`). Blocking; safe from any thread."""

    def __init__(self, database: Path, node: str) -> None:
        self.node = node
        self._reader = JournalReader(database)

    def close(self) -> None:
        self._reader.close()

    def head(self) -> int:
        """The highest committed seq (0: an empty journal)."""
        return self._reader.head()

    def batch(self, after: int, max_entries: int, max_bytes: int = 4 << 20) -> list[Row]:
        """Entries with `seq > after`, in order: at most `max_entries`, and no more once
        their data passes `max_bytes` (at least one, whatever its size)."""
        return [(self.node, *row) for row in self._reader.rows(after, max_entries, max_bytes)]


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
