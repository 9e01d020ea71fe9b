"""The hash-chained journal (docs/protocol.md §8).

Theory of operation: every entry is `(seq, epoch, ts, kind, workspace, actor, data,
prev)`; its `hash = sha256(prev || canonical(entry))`, where `canonical` is JSON with
sorted keys and no whitespace, and `prev` is the previous entry's hash (64 zeros for the
first). Changing, inserting or removing any entry breaks every later hash, which
`verify` finds. `data` holds paths, digests, sizes, argv, outcomes and refusals, never
file contents, command output, tokens or secrets: callers pass only those.

Appends are blocking and durable (the store runs with `synchronous=FULL`).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from substrate.schema.journal import Entry
from substrate.store.db import Store

__all__ = ["GENESIS", "Draft", "Entry", "Journal", "JournalReader", "canonical", "entry_hash"]

GENESIS = "0" * 64

SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY,
    epoch INTEGER NOT NULL,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    workspace TEXT,
    actor TEXT NOT NULL,
    data TEXT NOT NULL,
    prev TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS journal_workspace ON journal(workspace, seq);
CREATE INDEX IF NOT EXISTS journal_kind ON journal(kind, seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


_canonical_encoder = msgspec.json.Encoder(order="sorted")


def canonical(value: Any) -> bytes:
    """The canonical encoding used for hashing: sorted keys, compact, UTF-8."""
    return _canonical_encoder.encode(value)


def entry_hash(
    *,
    seq: int,
    epoch: int,
    ts: float,
    kind: str,
    workspace: str | None,
    actor: str,
    data: Mapping[str, Any],
    prev: str,
) -> str:
    body = {
        "seq": seq,
        "epoch": epoch,
        "ts": ts,
        "kind": kind,
        "workspace": workspace,
        "actor": actor,
        "data": data,
        "prev": prev,
    }
    return hashlib.sha256(prev.encode() + canonical(body)).hexdigest()


class Draft(NamedTuple):
    """One entry to append (`Journal.append_many_in`): what `append_in` takes."""

    kind: str
    data: Mapping[str, Any]
    workspace: str | None = None
    actor: str = "daemon"


class Journal:
    """Append-only, hash-chained log in the state database."""

    def __init__(self, store: Store) -> None:
        self._store = store
        store.ensure_schema(SCHEMA)
        with store.transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
            self.epoch = (int(row[0]) if row else 0) + 1
            db.execute(
                "INSERT INTO meta(key, value) VALUES ('epoch', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (str(self.epoch),),
            )

    @property
    def store(self) -> Store:
        """The database this journal appends to: rows that must commit with its entries
        (temp-file records, approvals) live there too."""
        return self._store

    def append(
        self,
        kind: str,
        data: Mapping[str, Any],
        *,
        workspace: str | None = None,
        actor: str = "daemon",
    ) -> Entry:
        """Append one entry and commit it. Blocking: call from a worker thread."""
        with self._store.transaction() as db:
            return self.append_many_in(db, [Draft(kind, data, workspace, actor)])[0]

    def append_in(
        self,
        db: Any,
        kind: str,
        data: Mapping[str, Any],
        *,
        workspace: str | None = None,
        actor: str = "daemon",
    ) -> Entry:
        """Append inside a caller's `Store.transaction`, so the entry commits with its change."""
        return self.append_many_in(db, [Draft(kind, data, workspace, actor)])[0]

    def append_many_in(self, db: Any, drafts: Sequence[Draft]) -> list[Entry]:
        """Append `drafts` in order inside a caller's `Store.transaction`, each its own
        entry chained to the one before, exactly as that many `append_in` calls would;
        the entries, in order. Costs one query for the chain's head, a hash per entry
        and one multi-row insert."""
        if not drafts:
            return []
        row = db.execute("SELECT seq, hash FROM journal ORDER BY seq DESC LIMIT 1").fetchone()
        seq, prev = (row[0] + 1, row[1]) if row else (1, GENESIS)
        ts = round(time.time(), 6)
        entries: list[Entry] = []
        rows: list[tuple[object, ...]] = []
        for draft in drafts:
            data = msgspec.to_builtins(dict(draft.data))
            encoded = canonical(data)
            body: dict[str, Any] = {
                "seq": seq,
                "epoch": self.epoch,
                "ts": ts,
                "kind": draft.kind,
                "workspace": draft.workspace,
                "actor": draft.actor,
                # Already canonical: spliced in as is, the same bytes `entry_hash` makes.
                "data": msgspec.Raw(encoded),
                "prev": prev,
            }
            digest = hashlib.sha256(prev.encode() + canonical(body)).hexdigest()
            rows.append(
                (seq, self.epoch, ts, draft.kind, draft.workspace, draft.actor,
                 encoded.decode(), prev, digest)
            )  # fmt: skip
            entries.append(Entry(**{**body, "data": data}, hash=digest))
            seq, prev = seq + 1, digest
        db.executemany(
            "INSERT INTO journal(seq, epoch, ts, kind, workspace, actor, data, prev, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        return entries

    def read(
        self,
        since: int = 0,
        limit: int = 1000,
        workspace: str | None = None,
        kinds: Iterable[str] | None = None,
    ) -> list[Entry]:
        """Entries with `seq > since`, oldest first, at most `limit`."""
        sql = "SELECT * FROM journal WHERE seq > ?"
        args: list[object] = [since]
        if workspace is not None:
            sql += " AND workspace = ?"
            args.append(workspace)
        if kinds is not None:
            kind_list = list(kinds)
            sql += f" AND kind IN ({','.join('?' * len(kind_list))})"
            args.extend(kind_list)
        sql += " ORDER BY seq LIMIT ?"
        args.append(limit)
        return [_row_entry(r) for r in self._store.query(sql, tuple(args))]

    def count(self) -> int:
        """How many entries the journal holds."""
        return int(self._store.query("SELECT COUNT(*) AS n FROM journal")[0]["n"])

    def verify(self) -> int | None:
        """Walk the whole chain; return the first bad seq, or None when intact."""
        expected_prev = GENESIS
        expected_seq = 1
        last = 0
        while True:
            rows = self._store.query(
                "SELECT * FROM journal WHERE seq > ? ORDER BY seq LIMIT 5000", (last,)
            )
            if not rows:
                return None
            for row in rows:
                entry = _row_entry(row)
                body = msgspec.structs.asdict(entry)
                del body["hash"]
                if (
                    entry.seq != expected_seq
                    or entry.prev != expected_prev
                    or entry_hash(**body) != entry.hash
                ):
                    return entry.seq
                expected_prev = entry.hash
                expected_seq += 1
                last = entry.seq


#: One stored entry as `JournalReader.rows` gives it: epoch, seq, ts, kind, workspace,
#: actor, data (its canonical JSON text), prev, hash.
StoredRow = tuple[int, int, float, str, str | None, str, str, str, str]


class JournalReader:
    """Committed entries of a state database, read on a read-only connection of its
    own, never the store's: in WAL mode a reader takes no lock a writer waits for, so
    however slow its reader, it never delays an append (the journal export,
    docs/fleet.md). Blocking; safe from any thread (one lock around its connection)."""

    def __init__(self, database: Path) -> None:
        uri = database.absolute().as_uri() + "?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout=5000")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def head(self) -> int:
        """The highest committed seq (0: an empty journal)."""
        with self._lock:
            row = self._db.execute("SELECT MAX(seq) FROM journal").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def rows(self, after: int, limit: int, max_bytes: int) -> list[StoredRow]:
        """Entries with `seq > after`, in order: at most `limit`, and no more once their
        data passes `max_bytes` (at least one, whatever its size)."""
        out: list[StoredRow] = []
        size = 0
        with self._lock:
            cur = self._db.execute(
                "SELECT epoch, seq, ts, kind, workspace, actor, data, prev, hash FROM journal"
                " WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            )
            try:
                for row in cur:
                    out.append(row)
                    size += len(row[6])
                    if size >= max_bytes:
                        break
            finally:
                cur.close()
        return out


def _row_entry(row: sqlite3.Row) -> Entry:
    return Entry(**{**dict(row), "data": msgspec.json.decode(row["data"])})
