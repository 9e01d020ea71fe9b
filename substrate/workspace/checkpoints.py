"""Checkpoints of a workspace and the pre-images a restore puts back (docs/protocol.md §11).

Theory of operation. `create` journals `workspace.checkpoint` under the workspace's
commit lock and records `(id, workspace, seq)`, seq being that entry's. While a
workspace has a live checkpoint, every guarded write in it (`fs.write`, `fs.patch`,
`fs.delete`, a change set's files, a restore's own files) hands this keeper what it is
about to replace, under the same commit lock and before its rename (`keep`): the bytes
go to `<state>/preimages/<2 hex>/<62 hex>` (content-addressed, 0600, fsynced, written
once), and a row `(workspace, seq, path, sha256, mode, size, new_sha256)` commits in the
transaction that journals the write (`record_in`). The journal holds digests, never
bytes. A checkpoint at seq S thus knows, for each path written after S, its state at S
(the first row after S: the bytes and mode replaced, or absent) and what substrate last
left there (the last row's `new_sha256`); `substrate.workspace.restore` uses both
(`changed_since`). Without a live checkpoint nothing is kept: a later checkpoint only
needs writes made after it.

Quota. `preimage_quota_bytes` bounds the stored bytes. When a write takes them over it
(`settle`), the oldest live checkpoint of any workspace expires (journaled
`workspace.checkpoint_expired`, reason `quota`), and the rows no live checkpoint can need
(seq at or below the oldest live checkpoint of their workspace) go, with every blob no
row names any more; again until the bytes fit or no checkpoint is live. A pre-image a
live checkpoint needs is never collected (its checkpoint goes first), and no write is
ever refused for the quota. A checkpoint being restored is `pinned`: neither the quota
nor the count expires it under its restore (the restore's own writes keep pre-images
too), so the bytes may stay over the quota until a write after the restore. A workspace keeps at most `MAX_LIVE` live checkpoints (a new
one expires the oldest, reason `count`) and remembers `MAX_EXPIRED` expired ones;
restoring an expired checkpoint refuses `checkpoint_unknown` with `expired: true`.

Crash and races. A blob is durable before the rename it protects; its row commits with
the journal entry, so a crash between leaves a blob that no row names, which `sweep`
removes at the next start. Collected blobs are unlinked inside the transaction that
drops their rows, and `record_in` writes its blob again if it is missing at its
transaction: both hold the store's lock, so a committed row never names a removed blob.

Blocking I/O throughout: call from worker threads.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sqlite3
import string
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from substrate.errors import CheckpointUnknown, NotFound, Refusal
from substrate.fs import fsops, paths
from substrate.fs.state import ENTRIES
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.adopted import Workspace

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    seq INTEGER NOT NULL,
    created REAL NOT NULL,
    expired REAL
);
CREATE INDEX IF NOT EXISTS checkpoints_workspace ON checkpoints(workspace, seq);
CREATE TABLE IF NOT EXISTS preimages (
    workspace TEXT NOT NULL,
    seq INTEGER NOT NULL,
    path BLOB NOT NULL,
    sha256 TEXT,
    mode INTEGER,
    size INTEGER NOT NULL,
    new_sha256 TEXT,
    PRIMARY KEY (workspace, seq)
);
CREATE INDEX IF NOT EXISTS preimages_path ON preimages(workspace, path, seq);
CREATE INDEX IF NOT EXISTS preimages_sha256 ON preimages(sha256);
CREATE TABLE IF NOT EXISTS preimage_blobs (sha256 TEXT PRIMARY KEY, size INTEGER NOT NULL);
"""

#: The blob directory beneath the state dir.
BLOB_DIR = ENTRIES.preimages.name
#: Live checkpoints per workspace; one more expires the oldest.
MAX_LIVE = 64
#: Expired checkpoints remembered per workspace (to answer `expired: true`).
MAX_EXPIRED = 256
#: Paths `changed_since` yields per query.
PAGE = 1000
_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True)
class Preimage:
    """What a guarded write is about to replace at `rel`: bytes, digest and mode, or
    nothing (`sha256` None: the write creates the file)."""

    workspace: str
    rel: str
    sha256: str | None
    data: bytes
    mode: int | None


@dataclass(frozen=True)
class History:
    """One path substrate wrote since a checkpoint: its state at the checkpoint
    (`sha256`/`mode`, None: absent) and what substrate last left there (`last_sha256`,
    None: deleted)."""

    rel: str
    sha256: str | None
    mode: int | None
    last_sha256: str | None


def _path_key(rel: str) -> bytes:
    # A BLOB: a name may hold lone surrogates, which SQLite text cannot.
    return rel.encode("utf-8", "surrogatepass")


def _blob_name(sha256: str) -> tuple[str, str]:
    return sha256[:2], sha256[2:]


class Checkpoints:
    """The checkpoints and pre-images of every workspace; the `Writer`'s pre-image keeper.

    Holds an fd of the blob directory until `close`.
    """

    def __init__(self, store: Store, journal: Journal, state_dir: Path, quota_bytes: int) -> None:
        self._store = store
        self._journal = journal
        self._quota = quota_bytes
        #: Checkpoints being restored now: the quota never expires one under its restore
        #: (whose own writes keep pre-images too).
        self._pinned: Counter[str] = Counter()
        self._pin_lock = threading.Lock()
        store.ensure_schema(SCHEMA)
        #: Workspaces with a live checkpoint, so `keep` (under a write's commit lock, every
        #: guarded write) asks no query (which would wait for a commit being flushed).
        #: Added to by `create` inside its transaction (under the commit lock, before any
        #: write that must keep a pre-image); recomputed after a commit that expired one.
        self._live: set[str] = set()
        self._refresh_live()
        state_fd = os.open(state_dir, fsops.DIR_FLAGS)
        try:
            self._dir_fd = fsops.make_dirs(state_fd, (BLOB_DIR,), BLOB_DIR, lambda _: (0o700, None))
        finally:
            os.close(state_fd)

    def close(self) -> None:
        os.close(self._dir_fd)

    # -- the Writer's hooks ---------------------------------------------------------------

    def keep(self, pre: Preimage) -> bool:
        """Store `pre`'s bytes durably when a live checkpoint of its workspace may need
        them; True when the write must `record_in` it. Called under the workspace's
        commit lock, before the write's rename. Costs a set lookup (no query), and for
        new bytes a file write and two fsyncs."""
        if pre.workspace not in self._live:
            return False
        if pre.sha256 is not None:
            self._store_blob(pre.sha256, pre.data)
        return True

    def has_live(self, workspace: str) -> bool:
        """Whether `workspace` has a live checkpoint (so a write there keeps a pre-image).
        Costs a query."""
        return bool(
            self._store.query(
                "SELECT 1 FROM checkpoints WHERE workspace = ? AND expired IS NULL LIMIT 1",
                (workspace,),
            )
        )

    def record_in(
        self, db: sqlite3.Connection, pre: Preimage, seq: int, new_sha256: str | None
    ) -> None:
        """Record `pre` as replaced by the write journaled at `seq`, inside that
        transaction (its blob written again if a collection removed it meanwhile)."""
        if pre.sha256 is not None:
            if not self._has_blob(pre.sha256):
                self._store_blob(pre.sha256, pre.data)
            db.execute(
                "INSERT OR IGNORE INTO preimage_blobs(sha256, size) VALUES (?, ?)",
                (pre.sha256, len(pre.data)),
            )
        db.execute(
            "INSERT INTO preimages(workspace, seq, path, sha256, mode, size, new_sha256)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                pre.workspace,
                seq,
                _path_key(pre.rel),
                pre.sha256,
                pre.mode,
                len(pre.data),
                new_sha256,
            ),
        )

    def settle(self) -> None:
        """Bring the stored bytes under the quota, expiring the oldest live checkpoints
        as needed (see the module doc). Costs a sum over the blobs; more when over."""
        if self.stored_bytes() <= self._quota:
            return
        try:
            self._settle()
        finally:
            self._refresh_live()

    def _settle(self) -> None:
        with self._store.transaction() as db:
            while self._total(db) > self._quota:
                with self._pin_lock:
                    pinned = [k for k, n in self._pinned.items() if n > 0]
                row = db.execute(
                    "SELECT id, workspace, seq FROM checkpoints WHERE expired IS NULL"
                    f" AND id NOT IN ({','.join('?' * len(pinned))}) ORDER BY seq LIMIT 1",
                    pinned,
                ).fetchone()
                if row is None:
                    break  # over until a later write, once the restores are done
                self._expire_in(db, row["id"], row["workspace"], row["seq"], "quota")

    # -- checkpoints ----------------------------------------------------------------------

    def create(self, ws: Workspace, actor: str) -> tuple[str, int]:
        """A new checkpoint of `ws`: (id, seq). Journaled `workspace.checkpoint` under the
        commit lock, so every later guarded write has a later seq and keeps its pre-image.
        Expires the oldest live one past `MAX_LIVE`. Costs one transaction."""
        checkpoint = "ckp_" + secrets.token_hex(8)
        with ws.commit_lock, self._store.transaction() as db:
            entry = self._journal.append_in(
                db, "workspace.checkpoint", {"checkpoint": checkpoint}, workspace=ws.id, actor=actor
            )
            db.execute(
                "INSERT INTO checkpoints(id, workspace, seq, created) VALUES (?, ?, ?, ?)",
                (checkpoint, ws.id, entry.seq, time.time()),
            )
            self._live.add(ws.id)
            live = db.execute(
                "SELECT id, seq FROM checkpoints WHERE workspace = ? AND expired IS NULL"
                " ORDER BY seq",
                (ws.id,),
            ).fetchall()
            with self._pin_lock:
                live = [row for row in live if self._pinned[row["id"]] <= 0]
            expired = live[: max(0, len(live) - MAX_LIVE)]
            for old in expired:
                self._expire_in(db, old["id"], ws.id, old["seq"], "count")
        if expired:
            self._refresh_live()
        return checkpoint, entry.seq

    def seq_of(self, ws: Workspace, checkpoint: str) -> int:
        """The journal seq of `ws`'s live checkpoint `checkpoint`. Refuses
        `checkpoint_unknown` (with `expired: true` when the quota or the count let it go)."""
        rows = self._store.query(
            "SELECT seq, expired FROM checkpoints WHERE id = ? AND workspace = ?",
            (checkpoint, ws.id),
        )
        if not rows:
            raise CheckpointUnknown(f"{checkpoint}: no checkpoint of this workspace has this id")
        if rows[0]["expired"] is not None:
            raise CheckpointUnknown(
                f"{checkpoint}: expired (its pre-images were collected)", expired=True
            )
        return int(rows[0]["seq"])

    @contextmanager
    def pinned(self, checkpoint: str) -> Iterator[None]:
        """Keep the quota from expiring `checkpoint` for the block (a restore of it)."""
        with self._pin_lock:
            self._pinned[checkpoint] += 1
        try:
            yield
        finally:
            with self._pin_lock:
                self._pinned[checkpoint] -= 1
                if self._pinned[checkpoint] <= 0:
                    del self._pinned[checkpoint]

    def changed_since(self, ws: Workspace, seq: int, *, created: bool) -> Iterator[History]:
        """Each path substrate wrote in `ws` after `seq`, in path order, a page at a time:
        those absent at `seq` (`created`) or those present. Costs a grouped query over
        the rows after `seq` per page of `PAGE` paths."""
        after = b""
        absent = "IS NULL" if created else "IS NOT NULL"
        while True:
            rows = self._store.query(
                "SELECT g.path, f.sha256, f.mode, l.new_sha256 FROM"
                " (SELECT path, MIN(seq) AS a, MAX(seq) AS b FROM preimages"
                "  WHERE workspace = ? AND seq > ? GROUP BY path) g"
                " JOIN preimages f ON f.workspace = ? AND f.seq = g.a"
                " JOIN preimages l ON l.workspace = ? AND l.seq = g.b"
                f" WHERE g.path > ? AND f.sha256 {absent} ORDER BY g.path LIMIT ?",
                (ws.id, seq, ws.id, ws.id, after, PAGE),
            )
            for row in rows:
                rel = bytes(row["path"]).decode("utf-8", "surrogatepass")
                yield History(rel, row["sha256"], row["mode"], row["new_sha256"])
            if len(rows) < PAGE:
                return
            after = bytes(rows[-1]["path"])

    def read_blob(self, sha256: str, cap: int) -> bytes | None:
        """The pre-image with this digest; None when it is missing, over `cap` bytes or
        not those bytes. Costs a read and a hash of it."""
        sub, name = _blob_name(sha256)
        try:
            with paths.opened_dir(self._dir_fd, (sub,), BLOB_DIR) as fd:
                _, data = fsops.read_regular(fd, name, cap, BLOB_DIR)
        except (Refusal, OSError):
            return None
        return data if hashlib.sha256(data).hexdigest() == sha256 else None

    def stored_bytes(self) -> int:
        """The size of every stored pre-image, as the quota counts it."""
        rows = self._store.query("SELECT COALESCE(SUM(size), 0) AS n FROM preimage_blobs")
        return int(rows[0]["n"])

    def sweep(self) -> int:
        """Remove every file of the blob directory that no row names (left by a crash
        between a blob and its row, or a temp file); how many. Run at start, before any
        write. Costs a listing of the blob directory and a lookup per file."""
        removed = 0
        with os.scandir(self._dir_fd) as it:
            subs = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        for sub in subs:
            with paths.opened_dir(self._dir_fd, (sub,), BLOB_DIR) as fd:
                with os.scandir(fd) as it:
                    names = [e.name for e in it]
                for name in names:
                    sha = sub + name
                    known = len(sha) == 64 and set(sha) <= _HEX and self._known(sha)
                    if not known:
                        fsops.unlink_quietly(fd, name)
                        removed += 1
        return removed

    # -- inside -----------------------------------------------------------------------------

    def _known(self, sha256: str) -> bool:
        return bool(self._store.query("SELECT 1 FROM preimage_blobs WHERE sha256 = ?", (sha256,)))

    @staticmethod
    def _total(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT COALESCE(SUM(size), 0) FROM preimage_blobs").fetchone()[0])

    def _has_blob(self, sha256: str) -> bool:
        sub, name = _blob_name(sha256)
        try:
            with paths.opened_dir(self._dir_fd, (sub,), BLOB_DIR) as fd:
                return paths.lstat_at(fd, name) is not None
        except NotFound:
            return False

    def _store_blob(self, sha256: str, data: bytes) -> None:
        sub, name = _blob_name(sha256)
        made = paths.lstat_at(self._dir_fd, sub) is None
        fd = fsops.make_dirs(self._dir_fd, (sub,), BLOB_DIR, lambda _: (0o700, None))
        try:
            if made:
                os.fsync(self._dir_fd)
            if paths.lstat_at(fd, name) is None:
                fsops.atomic_write(fd, name, data, mode=0o600)
        finally:
            os.close(fd)

    def _refresh_live(self) -> None:
        """Recompute `_live` from the rows (at start, and after a transaction that may have
        expired checkpoints: a rolled-back expiry never drops a workspace). Inside a
        transaction, so no `create` runs between the query and the assignment."""
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT DISTINCT workspace FROM checkpoints WHERE expired IS NULL"
            ).fetchall()
            self._live = {str(r[0]) for r in rows}

    def _expire_in(
        self, db: sqlite3.Connection, checkpoint: str, workspace: str, seq: int, reason: str
    ) -> None:
        """Expire one checkpoint, drop the rows and blobs no live checkpoint needs, and
        forget expired checkpoints of the workspace past `MAX_EXPIRED`."""
        db.execute("UPDATE checkpoints SET expired = ? WHERE id = ?", (time.time(), checkpoint))
        self._journal.append_in(
            db,
            "workspace.checkpoint_expired",
            {"checkpoint": checkpoint, "seq": seq, "reason": reason},
            workspace=workspace,
        )
        floor = db.execute(
            "SELECT MIN(seq) FROM checkpoints WHERE workspace = ? AND expired IS NULL",
            (workspace,),
        ).fetchone()[0]
        if floor is None:
            db.execute("DELETE FROM preimages WHERE workspace = ?", (workspace,))
        else:
            db.execute("DELETE FROM preimages WHERE workspace = ? AND seq <= ?", (workspace, floor))
        gone = [
            r[0]
            for r in db.execute(
                "SELECT sha256 FROM preimage_blobs b WHERE NOT EXISTS"
                " (SELECT 1 FROM preimages p WHERE p.sha256 = b.sha256)"
            )
        ]
        for sha in gone:
            db.execute("DELETE FROM preimage_blobs WHERE sha256 = ?", (sha,))
            sub, name = _blob_name(sha)
            try:
                with paths.opened_dir(self._dir_fd, (sub,), BLOB_DIR) as fd:
                    fsops.unlink_quietly(fd, name)
            except NotFound:
                pass
        db.execute(
            "DELETE FROM checkpoints WHERE workspace = ? AND expired IS NOT NULL AND id NOT IN"
            " (SELECT id FROM checkpoints WHERE workspace = ? AND expired IS NOT NULL"
            "  ORDER BY seq DESC LIMIT ?)",
            (workspace, workspace, MAX_EXPIRED),
        )
