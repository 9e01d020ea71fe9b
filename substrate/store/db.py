"""The daemon's SQLite database (WAL): one file, one connection, one lock.

Every module that keeps durable state (journal, workspaces, approvals, processes,
artifacts, grants) declares its tables with `Store.ensure_schema` and reads and writes
through `Store.transaction`. Calls are blocking: async code reaches them through
`trio.to_thread.run_sync`. The lock makes the single connection safe across worker
threads and makes each transaction atomic with respect to the others.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from substrate.store.group import GroupCommit


class Store:
    """The state database. Opened once per daemon; `close` at shutdown."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a transaction is
        # exactly the `with transaction()` block.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed journal entry survives a crash of the machine, not only of us.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        path.chmod(0o600)
        #: Units of work committed together (`substrate.store.group`): guarded writes'
        #: journal entries. `transaction` flushes it first, so order is kept.
        self.group = GroupCommit(self._plain_transaction)

    def ensure_schema(self, ddl: str) -> None:
        """Run idempotent DDL (`CREATE TABLE IF NOT EXISTS ...`)."""
        with self._lock:
            self._db.executescript(ddl)

    def ensure_columns(self, table: str, columns: Mapping[str, str]) -> None:
        """Add each missing column (`name` → its SQL type) to `table`: a database made by
        an older release gains what `CREATE TABLE IF NOT EXISTS` would not add."""
        with self._lock:
            have = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock for one atomic transaction; rolls back if the block raises.

        Whatever `group` holds queued is committed first (its own commit), so this
        transaction comes after every unit submitted before it began."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            # (Nested in this thread's own transaction it fails anyway; never wait on a
            # leader that needs the lock this thread holds.)
            self.group.flush()
        with self._plain_transaction() as db:
            yield db

    @contextmanager
    def _plain_transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, args: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        """A read outside any transaction."""
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def query_now(self, sql: str, args: tuple[object, ...] = ()) -> list[sqlite3.Row] | None:
        """`query`, if no other thread holds the connection at this moment; else None
        (without waiting: the event loop's caller then asks from a worker thread)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._db.execute(sql, args).fetchall()
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._db.close()
