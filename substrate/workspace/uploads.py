"""Chunked uploads in progress: the bytes of a file on their way in (docs/protocol.md §14).

Theory of operation. `fs.upload.begin` makes an `Upload`: what the file will be (target,
base, size, SHA-256) and a spool file `<state>/uploads/upl_<32 hex>` (0600, created
`O_EXCL | O_NOFOLLOW` through the spool directory's fd). Chunks arrive in order: a
chunk at `offset == received` is written there and fed to a running SHA-256, so the
digest is known the moment the last byte lands; a chunk wholly or partly inside
`[0, received)` is a retry, accepted only when those bytes equal the spooled ones.
Nothing reaches a workspace before the commit (`substrate.workspace.writes.upload`),
which streams the spool into a same-directory temp file and renames it.

An upload belongs to its caller (socket and uid, `Caller.name`): another caller's id is
`upload_unknown`, like an id that never was. It outlives the connection that began it (a
dropped client resumes at `received`), not the daemon: uploads live in memory, and the
spool directory is emptied of every `upl_*` file when the daemon stops and when it
starts (after a crash). An upload with
no call for `idle_s` expires (`expire`, which the daemon runs periodically), its spool
removed; one that a call is using is never expired under it.

Caps: `max_bytes` per upload (declared at begin: `too_large`), `max_open` per caller
(`limit_exceeded`, `data.scope = "uploads"`); a chunk's size is bounded by the request
line it came in. Memory per upload is its record and a SHA-256 state; a chunk is held
only while it is written.

Blocking I/O throughout (a write, a pread to compare a retry): call from worker threads.
Thread-safe: the registry under one lock, each upload's bytes under its own.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from substrate.errors import (
    LimitExceeded,
    TooLarge,
    UploadConflict,
    UploadIncomplete,
    UploadMismatch,
    UploadUnknown,
)
from substrate.fs import fsops
from substrate.fs.state import ENTRIES

#: The spool directory beneath the state dir.
SPOOL_DIR = ENTRIES.uploads.name
#: Names of spool files: the upload id.
UPLOAD_ID = re.compile(r"upl_[0-9a-f]{32}")


@dataclass(eq=False)
class Upload:
    """One upload in progress. `received` bytes (from 0) are spooled; `hasher` has seen
    exactly them. Mutable fields change only under `lock`."""

    id: str
    #: The caller that began it (`Caller.name`); no other caller can name it.
    owner: str
    workspace: str
    path: str
    base_sha256: str | None
    size: int
    sha256: str
    mode: int | None
    create_parents: bool
    touched: float
    received: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)
    #: Calls using it now: an upload in use is never expired.
    busy: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received_sha256(self) -> str:
        return str(self.hasher.hexdigest())


class Uploads:
    """The uploads in progress of one daemon run, and their spool directory.

    Holds an fd of the spool directory until `close`. `clock` is monotonic seconds.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        max_bytes: int,
        max_open: int,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_open = max_open
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, Upload] = {}
        state_fd = os.open(state_dir, fsops.DIR_FLAGS)
        try:
            self._dir_fd = fsops.make_dirs(
                state_fd, (SPOOL_DIR,), SPOOL_DIR, lambda _: (0o700, None)
            )
        finally:
            os.close(state_fd)
        self.removed_at_start = self._remove_all_spools()

    def close(self) -> None:
        """At the daemon's exit: every upload ends with it, so every spool file goes."""
        with self._lock:
            self._open.clear()
        self._remove_all_spools()
        os.close(self._dir_fd)

    # -- the wire operations -------------------------------------------------------------

    def begin(
        self,
        owner: str,
        *,
        workspace: str,
        path: str,
        base_sha256: str | None,
        size: int,
        sha256: str,
        mode: int | None,
        create_parents: bool,
    ) -> Upload:
        """A new upload of `owner`, with an empty spool file. The target is the caller's
        to check first (`writes.UploadWriter.check`).

        Refuses `too_large` (size over `max_bytes`) and `limit_exceeded` (`owner` has
        `max_open` uploads open, after idle ones expired). Costs a file creation.
        """
        self.check_size(size)
        self.expire()
        upload_id = "upl_" + secrets.token_hex(16)
        with self._lock:
            mine = sum(1 for up in self._open.values() if up.owner == owner)
            if mine >= self.max_open:
                raise LimitExceeded(
                    f"{mine} uploads are open; commit or abort one first",
                    limit=self.max_open,
                    scope="uploads",
                )
            up = Upload(
                id=upload_id,
                owner=owner,
                workspace=workspace,
                path=path,
                base_sha256=base_sha256,
                size=size,
                sha256=sha256,
                mode=mode,
                create_parents=create_parents,
                touched=self._clock(),
            )
            fd = fsops.create_exclusive(self._dir_fd, upload_id)
            os.close(fd)
            self._open[upload_id] = up
        return up

    def check_size(self, size: int) -> None:
        """Refuse `too_large` for an upload of more than `max_bytes`."""
        if size > self.max_bytes:
            raise TooLarge(
                f"an upload of {size} bytes is over the {self.max_bytes} byte bound",
                limit=self.max_bytes,
            )

    def chunk(self, owner: str, upload_id: str, offset: int, data: bytes) -> Upload:
        """Spool `data` at `offset` of `owner`'s upload; returns it (`received` moved on).

        Refuses `upload_unknown`; `upload_conflict` when `offset` is past `received`
        (a gap), the chunk runs past `size`, or a re-sent range differs from the spooled
        bytes; `limit_exceeded` (`scope: "disk"`) when the file system is full. Costs a
        write of the new bytes and their hash, plus a read of any re-sent range.
        """
        with self.using(owner, upload_id) as up:
            end = offset + len(data)
            if end > up.size:
                raise UploadConflict(
                    f"{upload_id}: bytes [{offset}, {end}) run past the declared size {up.size}",
                    size=up.size,
                    received=up.received,
                )
            if offset > up.received:
                raise UploadConflict(
                    f"{upload_id}: offset {offset} leaves a gap; {up.received} bytes received",
                    received=up.received,
                )
            fd = self._open_spool(up.id, os.O_RDWR)
            try:
                if offset < up.received:
                    self._check_resent(fd, up, offset, data)
                fresh = data[max(0, up.received - offset) :]
                if fresh:
                    _pwrite_all(fd, fresh, up.received)
                    up.hasher.update(fresh)
                    up.received += len(fresh)
            finally:
                os.close(fd)
            return up

    def abort(self, owner: str, upload_id: str) -> int:
        """Drop `owner`'s upload and its spool; how many bytes it had. Waits for a call
        using it (a commit) to end first. Refuses `upload_unknown`."""
        with self.using(owner, upload_id) as up:
            self.finish(up)
            return up.received

    @contextlib.contextmanager
    def using(self, owner: str, upload_id: str) -> Iterator[Upload]:
        """`owner`'s upload, held for the block: its lock taken (calls on one upload run
        one at a time), never expired meanwhile, its idle time restarted at both ends.
        Refuses `upload_unknown` (also for an upload finished while this waited)."""
        with self._lock:
            up = self._open.get(upload_id)
            if up is None or up.owner != owner:
                raise UploadUnknown(f"{upload_id}: no open upload has this id")
            up.busy += 1
        try:
            with up.lock:
                with self._lock:
                    if self._open.get(upload_id) is not up:
                        raise UploadUnknown(f"{upload_id}: no open upload has this id")
                up.touched = self._clock()
                yield up
        finally:
            with self._lock:
                up.busy -= 1
                up.touched = self._clock()

    @staticmethod
    def check_complete(up: Upload) -> None:
        """Refuse `upload_incomplete` before every declared byte arrived, and
        `upload_mismatch` when the bytes' SHA-256 is not the declared one. Costs nothing
        (the digest ran as the bytes arrived)."""
        if up.received != up.size:
            raise UploadIncomplete(
                f"{up.id}: {up.received} of {up.size} bytes received",
                received=up.received,
                size=up.size,
            )
        got = up.received_sha256()
        if got != up.sha256:
            raise UploadMismatch(
                f"{up.id}: the bytes received do not have the declared sha256",
                sha256=up.sha256,
                received_sha256=got,
            )

    def open_spool(self, up: Upload) -> int:
        """An fd to read `up`'s spooled bytes (the caller closes it)."""
        return self._open_spool(up.id, os.O_RDONLY)

    def finish(self, up: Upload) -> None:
        """Forget `up` and remove its spool (committed or aborted)."""
        with self._lock:
            if self._open.get(up.id) is up:
                del self._open[up.id]
        fsops.unlink_quietly(self._dir_fd, up.id)

    def expire(self) -> list[str]:
        """Forget every upload idle for `idle_s` or more and remove its spool; their ids.
        An upload a call is using is kept. Costs a pass over the open uploads."""
        now = self._clock()
        with self._lock:
            stale = [
                up for up in self._open.values() if up.busy == 0 and now - up.touched >= self.idle_s
            ]
            for up in stale:
                del self._open[up.id]
        for up in stale:
            fsops.unlink_quietly(self._dir_fd, up.id)
        return [up.id for up in stale]

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    # -- inside ---------------------------------------------------------------------------

    def _open_spool(self, upload_id: str, flags: int) -> int:
        return os.open(upload_id, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)

    @staticmethod
    def _check_resent(fd: int, up: Upload, offset: int, data: bytes) -> None:
        overlap = min(offset + len(data), up.received) - offset
        spooled = os.pread(fd, overlap, offset)
        if spooled != data[:overlap]:
            raise UploadConflict(
                f"{up.id}: bytes re-sent at {offset} differ from those received",
                received=up.received,
            )

    def _remove_all_spools(self) -> int:
        """Remove every spool file (at start: an earlier run's; uploads never outlive
        one); how many. Only names substrate gives spool files are touched."""
        removed = 0
        with os.scandir(self._dir_fd) as it:
            names = [e.name for e in it if UPLOAD_ID.fullmatch(e.name)]
        for name in names:
            fsops.unlink_quietly(self._dir_fd, name)
            removed += 1
        return removed


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of `data` at `offset`. A full file system is `limit_exceeded`."""
    try:
        with memoryview(data) as view:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LimitExceeded("no space left for the upload's spool", scope="disk") from None
        raise
