"""The artifact store (docs/protocol.md §6): content-addressed output files indexed in SQLite.

Theory of operation. Layout under `root` (`<state_dir>/artifacts`, 0700):

    spool/<id>          the output of a running stream (an `OutputSink`), growing
    spool/<id>.meta     {proc, stream, created} of that spool, so a restart can keep it
    ab/<sha256>         a finished artifact's bytes, named by their SHA-256 (read-only)
    index/<sha256>      lazily built line index of a large artifact (see `lines`)

An artifact is a row of the `artifacts` table (id, sha256, bytes, created, proc, stream,
path, state, truncated, lost). Rows are written only when an output is finished and
larger than its inline limit, so small outputs cost no database commit; a running
stream exists only as a spool plus its `OutputSink` registered here. Identical outputs
share one file (dedupe) but keep separate rows: a file is removed with its last row.

Collection (`collect`) removes rows older than `max_age_s`, then oldest first until the
bytes on disk (distinct files plus live spools) fit `quota_bytes`. Spools are never
collected: they are not rows. `repair` (run once at start, before any sink opens) makes
files and rows agree after a crash: a spool left by a dead daemon becomes an artifact
marked `lost` and `truncated` (nothing recorded is dropped; a spool without its meta
file cannot be attributed and is removed), rows whose file is missing or has the wrong
size are removed, files and indexes without a row are removed. Neither journals bytes;
both return counts for the caller to journal.

Files are not fsynced unless `durable=True` (then once per artifact, at close): a daemon
crash loses nothing (the page cache survives it); after a machine crash `repair` drops
artifacts whose size is wrong, but does not re-hash (it would read every byte).

Blocking throughout: async callers use `trio.to_thread.run_sync`.
"""

from __future__ import annotations

import array
import base64
import contextlib
import hashlib
import os
import re
import secrets
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec

from substrate.artifacts.lines import BLOCK, count_blocks, grep_fd, line_offset, read_lines
from substrate.artifacts.sink import OutputSink, pread_exact
from substrate.errors import ArtifactUnknown, InvalidParams, TooLarge
from substrate.fs import fsops
from substrate.matching.agent_regex import Matcher, matcher_for
from substrate.schema.artifact import GrepResult, LinesResult, ReadResult, StatResult
from substrate.store.db import Store

SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    id TEXT PRIMARY KEY,
    sha256 TEXT,
    bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    proc TEXT NOT NULL,
    stream TEXT NOT NULL,
    path TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('writing', 'done')),
    truncated INTEGER NOT NULL DEFAULT 0,
    lost INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS artifacts_sha256 ON artifacts(sha256);
CREATE INDEX IF NOT EXISTS artifacts_created ON artifacts(state, created);
CREATE INDEX IF NOT EXISTS artifacts_proc ON artifacts(proc);
"""

MAX_READ = 1 << 20  # artifact.read length
MAX_LINES = 10000  # artifact.lines count
MAX_MATCHES = 10000  # artifact.grep max_matches
INDEX_MIN = 4 * BLOCK  # smaller artifacts are counted on each call, not indexed

_HEX2 = re.compile(r"^[0-9a-f]{2}$")
_SHA = re.compile(r"^[0-9a-f]{64}$")
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class CollectReport(msgspec.Struct, frozen=True, kw_only=True):
    removed: int  # rows removed
    files_removed: int
    bytes_freed: int
    bytes_used: int  # after collection: distinct files + live spools
    over_quota: bool  # still over quota (live spools and newest artifacts are kept)


class RepairReport(msgspec.Struct, frozen=True, kw_only=True):
    spools_kept: int  # spools of a dead daemon kept as lost artifacts
    spools_discarded: int  # spools that could not be attributed
    orphans_removed: int  # content or index files without a row
    dangling_removed: int  # rows without their file (or with the wrong size)


class _Meta(msgspec.Struct, frozen=True):
    proc: str
    stream: str
    created: float


def compile_grep(pattern: str, *, fixed: bool, ignore_case: bool) -> re.Pattern[bytes]:
    """`artifact.grep`'s pattern over bytes (multi-line). Refuses `invalid_params`."""
    source = re.escape(pattern) if fixed else pattern
    flags = re.MULTILINE | (re.IGNORECASE if ignore_case else 0)
    try:
        return re.compile(source.encode("utf-8", "surrogateescape"), flags)
    except re.error as exc:
        raise InvalidParams(f"pattern: {exc}", path="$.pattern") from None
    except RecursionError:  # groups nested deeper than the parser's stack
        raise InvalidParams("pattern: nested too deeply", path="$.pattern") from None


class ArtifactStore:
    """Sinks for running output, and the finished artifacts they become."""

    def __init__(
        self,
        store: Store,
        root: Path,
        *,
        quota_bytes: int,
        max_age_s: float,
        durable: bool = False,
    ) -> None:
        self.root = root
        self.quota_bytes = quota_bytes
        self.max_age_s = max_age_s
        self._store = store
        self._durable = durable
        # Guards `_live` and keeps files and rows in step (finish, collect, repair).
        self._lock = threading.Lock()
        self._live: dict[str, OutputSink] = {}
        for d in (root, root / "spool", root / "index"):
            d.mkdir(mode=0o700, parents=d is root, exist_ok=True)
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                raise RuntimeError(f"{d} is not a plain directory")
            os.chmod(d, 0o700)
        store.ensure_schema(SCHEMA)

    # --- sinks ------------------------------------------------------------------------

    def open_sink(self, proc: str, stream: str, inline_limit: int, max_bytes: int) -> OutputSink:
        """A new stream of `proc`. No I/O: its spool (two file creations, no commit) is
        made by its first non-empty write (`OutputSink`)."""
        if inline_limit < 0 or max_bytes < 0:
            raise ValueError("inline_limit and max_bytes must be non-negative")
        artifact = "art_" + secrets.token_hex(16)
        created = time.time()

        def make_spool() -> int:
            meta = msgspec.json.encode(_Meta(proc, stream, created))
            with _opened_dir(self.root / "spool") as spool:
                fsops.write_new(spool, f"{artifact}.meta", meta, mode=0o600, fsync=False)
                return fsops.create_exclusive(spool, artifact, read=True)

        sink = OutputSink(
            self,
            artifact,
            proc,
            stream,
            -1,
            inline_limit=inline_limit,
            max_bytes=max_bytes,
            created=created,
            durable=self._durable,
            opener=make_spool,
        )
        with self._lock:
            self._live[artifact] = sink
        return sink

    def finish_sink(self, sink: OutputSink, sha256: str | None) -> str | None:
        """Called by `OutputSink.close`: drop an inline spool, or store and index it."""
        spool = self.root / "spool"
        with self._lock:
            try:
                if sha256 is None:
                    if not sink.spooled:
                        return None  # never written: no file was made
                    _unlink(spool / sink.id)
                    _unlink(spool / f"{sink.id}.meta")
                    return None
                self._store_file(spool / sink.id, sha256, sink.written)
                with self._store.transaction() as db:
                    db.execute(
                        "INSERT INTO artifacts(id, sha256, bytes, created, proc, stream, path,"
                        " state, truncated, lost) VALUES (?, ?, ?, ?, ?, ?, ?, 'done', ?, 0)",
                        (
                            sink.id,
                            sha256,
                            sink.written,
                            sink.created,
                            sink.proc,
                            sink.stream,
                            _rel(sha256),
                            int(sink.truncated),
                        ),
                    )
                # Only now: had anything failed, the meta lets `repair` keep the spool.
                _unlink(spool / f"{sink.id}.meta")
                return sink.id
            finally:
                self._live.pop(sink.id, None)

    def _store_file(self, src: Path, sha256: str, size: int) -> None:
        """Move `src` to its content address; an identical file already there is kept."""
        dst = self.root / _rel(sha256)
        dst.parent.mkdir(mode=0o700, exist_ok=True)
        try:
            if os.lstat(dst).st_size == size:
                _unlink(src)
                return
        except FileNotFoundError:
            pass
        os.chmod(src, 0o400)
        os.replace(src, dst)

    # --- reads ------------------------------------------------------------------------

    def _row(self, artifact: str) -> _Row:
        rows = self._store.query(
            f"SELECT {_COLUMNS} FROM artifacts WHERE id = ? AND state = 'done'", (artifact,)
        )
        if not rows:
            raise ArtifactUnknown(f"no artifact {artifact}", artifact=artifact)
        return _Row(*rows[0])

    def _open(self, artifact: str) -> tuple[int, _Row]:
        row = self._row(artifact)
        try:
            fd = os.open(self.root / row.path, _OPEN_READ)
        except FileNotFoundError:
            raise ArtifactUnknown(f"no artifact {artifact}", artifact=artifact) from None
        return fd, row

    def stat(self, artifact: str) -> StatResult:
        """`artifact.stat`. Refuses `artifact_unknown`. Costs one indexed query."""
        return self._row(artifact).stat()

    def by_proc(self, proc: str) -> list[StatResult]:
        """Every stored artifact of `proc` (e.g. to answer for a process marked lost)."""
        rows = self._store.query(
            f"SELECT {_COLUMNS} FROM artifacts WHERE proc = ? AND state = 'done'"
            " ORDER BY created, id",
            (proc,),
        )
        return [_Row(*r).stat() for r in rows]

    def read_artifact(self, artifact: str, offset: int, length: int) -> bytes:
        """Raw bytes of an artifact (for `OutputSink.read_at` after close)."""
        fd, _row = self._open(artifact)
        try:
            return pread_exact(fd, length, offset)
        finally:
            os.close(fd)

    def read(self, artifact: str, offset: int = 0, length: int = 65536) -> ReadResult:
        """`artifact.read`: `length` ≤ 1 MiB else `too_large`; `artifact_unknown`.

        The slice is UTF-8 text when it is valid UTF-8 as cut, else base64.
        """
        if length > MAX_READ:
            raise TooLarge(f"length {length} exceeds {MAX_READ}", limit=MAX_READ)
        fd, row = self._open(artifact)
        try:
            data = pread_exact(fd, length, offset)
        finally:
            os.close(fd)
        eof = offset + len(data) >= row.bytes
        try:
            return ReadResult(offset=offset, eof=eof, encoding="utf-8", data=data.decode("utf-8"))
        except UnicodeDecodeError:
            text = base64.b64encode(data).decode("ascii")
            return ReadResult(offset=offset, eof=eof, encoding="base64", data=text)

    def lines(self, artifact: str, start: int = 1, count: int = 100) -> LinesResult:
        """`artifact.lines`: lines `start`.. (1-based), `count` ≤ 10000 else `too_large`.

        Lines end at `\\n` (not included); a last line without one counts. Each line is cut
        at 64 KiB; the reply stops adding lines past 1 MiB. Cost: finding line `start`
        reads one 1 MiB block, using a line index (one `uint64` per MiB, in `index/`) built
        on first use by one pass over the artifact; artifacts under 4 MiB are counted on
        each call instead. Then it reads about what it returns (plus the skipped rest of
        over-long lines).
        """
        if count > MAX_LINES:
            raise TooLarge(f"count {count} exceeds {MAX_LINES}", limit=MAX_LINES)
        fd, row = self._open(artifact)
        try:
            size = os.fstat(fd).st_size
            counts = self._line_counts(fd, row.sha256, size)
            offset = line_offset(fd, counts, size, start)
            if offset is None:
                return LinesResult(start=start, lines=[], eof=True)
            return read_lines(fd, offset, size, start, count)
        finally:
            os.close(fd)

    def _line_counts(self, fd: int, sha256: str, size: int) -> array.array[int]:
        if size <= INDEX_MIN:
            return count_blocks(fd, size)
        want = (size + BLOCK - 1) // BLOCK + 1
        path = self.root / "index" / sha256
        counts: array.array[int] = array.array("Q")
        try:
            ifd = os.open(path, _OPEN_READ)
        except FileNotFoundError:
            pass
        else:
            try:
                counts.frombytes(pread_exact(ifd, want * counts.itemsize, 0))
            finally:
                os.close(ifd)
            if len(counts) == want:
                return counts
        counts = count_blocks(fd, size)
        with _opened_dir(self.root / "index") as index:
            # A cache: rebuilt when lost, so never fsynced.
            fsops.atomic_write(index, sha256, counts.tobytes(), mode=0o600, fsync=False)
        return counts

    def grep(
        self,
        artifact: str,
        pattern: str,
        *,
        max_matches: int = 100,
        fixed: bool = False,
        ignore_case: bool = False,
    ) -> GrepResult:
        """`artifact.grep`: lines matching a Python `re` pattern applied to the bytes.

        `max_matches` ≤ 10000 else `too_large`; a bad pattern is `invalid_params`. One
        match per line; only the first 1 MiB of a longer line is searched; `text` is cut
        at 4 KiB. Costs one pass over the artifact (stops at `max_matches`), in linear
        time unless the pattern needs backtracking (`matching.agent_regex`: then at most
        its budget, else `limit_exceeded`).
        """
        if max_matches > MAX_MATCHES:
            raise TooLarge(f"max_matches {max_matches} exceeds {MAX_MATCHES}", limit=MAX_MATCHES)
        regex = compile_grep(pattern, fixed=fixed, ignore_case=ignore_case)
        return self.grep_with(artifact, matcher_for(regex), max_matches)

    def grep_with(self, artifact: str, matcher: Matcher, max_matches: int) -> GrepResult:
        """`grep` with the pattern already compiled into its bounded matcher (the caller
        picked its thread by the matcher's kind)."""
        if max_matches > MAX_MATCHES:
            raise TooLarge(f"max_matches {max_matches} exceeds {MAX_MATCHES}", limit=MAX_MATCHES)
        fd, _row = self._open(artifact)
        try:
            return grep_fd(fd, matcher, max_matches)
        finally:
            os.close(fd)

    # --- quota, age, repair -------------------------------------------------------------

    def usage(self) -> int:
        """Bytes on disk: distinct artifact files plus live spools."""
        with self._lock:
            return self._used_locked()

    def _used_locked(self) -> int:
        rows = self._store.query(
            "SELECT SUM(bytes) FROM (SELECT MAX(bytes) AS bytes FROM artifacts"
            " WHERE state = 'done' GROUP BY sha256)"
        )
        stored = int(rows[0][0] or 0)
        return stored + sum(s.written for s in self._live.values())

    def collect(self, now: float | None = None) -> CollectReport:
        """Remove artifacts older than `max_age_s`, then the oldest until under quota.

        Never touches a spool (an open sink). Costs one query over the rows, one commit,
        and one unlink per freed file.
        """
        now = time.time() if now is None else now
        with self._lock:
            rows = self._store.query(
                "SELECT id, sha256, bytes, created FROM artifacts WHERE state = 'done'"
                " ORDER BY created, id"
            )
            refs = Counter(str(r["sha256"]) for r in rows)
            sizes = {str(r["sha256"]): int(r["bytes"]) for r in rows}
            used = sum(sizes.values()) + sum(s.written for s in self._live.values())
            doomed: list[str] = []
            freed: list[str] = []
            for r in rows:
                if now - float(r["created"]) <= self.max_age_s and used <= self.quota_bytes:
                    break
                doomed.append(str(r["id"]))
                sha = str(r["sha256"])
                refs[sha] -= 1
                if refs[sha] == 0:
                    freed.append(sha)
                    used -= sizes[sha]
            if doomed:
                with self._store.transaction() as db:
                    db.executemany("DELETE FROM artifacts WHERE id = ?", [(i,) for i in doomed])
                for sha in freed:
                    self._remove_content(sha)
        return CollectReport(
            removed=len(doomed),
            files_removed=len(freed),
            bytes_freed=sum(sizes[s] for s in freed),
            bytes_used=used,
            over_quota=used > self.quota_bytes,
        )

    def _remove_content(self, sha256: str) -> None:
        _unlink(self.root / _rel(sha256))
        _unlink(self.root / "index" / sha256)

    def repair(self) -> RepairReport:
        """Make files and rows agree after a crash; run at start, before sinks open.

        Costs one pass over every leftover spool (to hash it), one stat per row and one
        listing of the store.
        """
        with self._lock:
            kept, discarded = self._repair_spools()
            dangling = self._repair_rows()
            orphans = self._repair_files()
        return RepairReport(
            spools_kept=kept,
            spools_discarded=discarded,
            orphans_removed=orphans,
            dangling_removed=dangling,
        )

    def _repair_spools(self) -> tuple[int, int]:
        spool = self.root / "spool"
        names = set(os.listdir(spool))
        kept = discarded = 0
        for name in sorted(names):
            ident = name.removesuffix(".meta")
            if ident in self._live:
                continue
            if name.endswith(".meta"):
                if ident not in names:
                    _unlink(spool / name)
                continue
            meta = _read_meta(spool / f"{ident}.meta") if ident.startswith("art_") else None
            if meta is None:
                _unlink(spool / name)
                discarded += 1
                continue
            sha256, size = _hash_file(spool / name)
            self._store_file(spool / name, sha256, size)
            with self._store.transaction() as db:
                db.execute(
                    "INSERT OR REPLACE INTO artifacts(id, sha256, bytes, created, proc, stream,"
                    " path, state, truncated, lost) VALUES (?, ?, ?, ?, ?, ?, ?, 'done', 1, 1)",
                    (ident, sha256, size, meta.created, meta.proc, meta.stream, _rel(sha256)),
                )
            _unlink(spool / f"{ident}.meta")
            kept += 1
        return kept, discarded

    def _repair_rows(self) -> int:
        bad: list[str] = []
        for r in self._store.query("SELECT id, path, bytes, state FROM artifacts"):
            if r["state"] != "done":
                if r["id"] not in self._live:
                    bad.append(str(r["id"]))
                continue
            try:
                st = os.lstat(self.root / str(r["path"]))
            except FileNotFoundError:
                bad.append(str(r["id"]))
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != int(r["bytes"]):
                bad.append(str(r["id"]))
        if bad:
            with self._store.transaction() as db:
                db.executemany("DELETE FROM artifacts WHERE id = ?", [(i,) for i in bad])
        return len(bad)

    def _repair_files(self) -> int:
        known = {
            str(r[0])
            for r in self._store.query("SELECT DISTINCT sha256 FROM artifacts WHERE state = 'done'")
        }
        removed = 0
        for top in os.listdir(self.root):
            if not _HEX2.match(top) or not (self.root / top).is_dir():
                continue
            for name in os.listdir(self.root / top):
                if not (_SHA.match(name) and name.startswith(top) and name in known):
                    _unlink(self.root / top / name)
                    removed += 1
            # Shards that emptied out would otherwise accumulate forever.
            if not os.listdir(self.root / top):
                os.rmdir(self.root / top)
        for name in os.listdir(self.root / "index"):
            if name not in known:
                _unlink(self.root / "index" / name)
                removed += 1
        return removed


@contextlib.contextmanager
def _opened_dir(path: Path) -> Iterator[int]:
    """A directory of the store (under the state dir: trusted) as an fd, for `fsops`."""
    fd = os.open(path, fsops.DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def _rel(sha256: str) -> str:
    return f"{sha256[:2]}/{sha256}"


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Row(NamedTuple):
    """One finished artifact as stored (columns in `_COLUMNS` order)."""

    id: str
    sha256: str
    bytes: int
    created: float
    proc: str
    stream: str
    path: str
    truncated: int
    lost: int

    def stat(self) -> StatResult:
        return StatResult(
            artifact=self.id,
            bytes=self.bytes,
            sha256=self.sha256,
            created=self.created,
            proc=self.proc,
            stream=self.stream,
            truncated=bool(self.truncated),
            lost=bool(self.lost),
        )


_COLUMNS = ", ".join(_Row._fields)


def _read_meta(path: Path) -> _Meta | None:
    try:
        fd = os.open(path, _OPEN_READ)
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(pread_exact(fd, 65536, 0), type=_Meta)
    except msgspec.DecodeError:
        return None
    finally:
        os.close(fd)


def _hash_file(path: Path) -> tuple[str, int]:
    fd = os.open(path, _OPEN_READ)
    try:
        digest = hashlib.sha256()
        size = 0
        while block := os.pread(fd, BLOCK, size):
            digest.update(block)
            size += len(block)
        return digest.hexdigest(), size
    finally:
        os.close(fd)
