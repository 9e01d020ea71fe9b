"""Whole-file SHA-256 digests of workspace files, cached by file version.

`fs.stat` and `fs.read` give a file's digest so that a guarded write can bind to it.
A digest costs a pass over the file, so `Digests` keeps the ones it computed, keyed by
the file's version (device, inode, size, mtime, ctime), and lets concurrent askers of
one large version share one computation. Thread-safe; blocking (call from a thread).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

CHUNK = 1 << 20
#: Digests kept by `Digests` (about 200 bytes each).
DIGEST_CACHE_ENTRIES = 4096
#: A digest is cached only for a file whose ctime is this much older than the hash: a
#: change within one tick of the file system's clock would keep the same times.
RACY_NS = 2_000_000_000
#: Hashes of files over this size are shared by concurrent askers of the same version
#: (below it a second hash costs less than waiting for the first).
SHARED_HASH_BYTES = 1 << 20


def hash_fd(fd: int) -> str:
    """SHA-256 of a whole open file, from offset 0."""
    digest = hashlib.sha256()
    offset = 0
    while True:
        block = os.pread(fd, CHUNK, offset)
        if not block:
            return digest.hexdigest()
        digest.update(block)
        offset += len(block)


#: What names one version of one file: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns).
Version = tuple[int, int, int, int, int]


def version_of(st: os.stat_result) -> Version:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Digests:
    """Whole-file SHA-256s, cached by file version; one computation per version at a time.

    A version is `version_of(fstat)`: any change to a file's bytes through the file system
    sets its mtime and ctime, and ctime cannot be set back, so a digest stays valid while
    the version is the same. Within one tick of the file system's clock a change can keep
    the times (git's "racily clean" case), so a digest is kept only when the file's ctime
    is `racy_ns` older than the start of its hash. At most `entries` are kept, least
    recently used dropped first. Thread-safe; callers that ask for a version of more than
    `SHARED_HASH_BYTES` being hashed wait for that hash instead of starting another.
    """

    def __init__(self, entries: int = DIGEST_CACHE_ENTRIES, racy_ns: int = RACY_NS) -> None:
        self._entries = entries
        self._racy_ns = racy_ns
        self._lock = threading.Lock()
        self._known: OrderedDict[Version, str] = OrderedDict()
        self._running: dict[Version, Future[tuple[str, bool]]] = {}

    def known(self, st: os.stat_result) -> str | None:
        """The digest of this version if it is cached. Costs nothing."""
        key = version_of(st)
        with self._lock:
            found = self._known.get(key)
            if found is not None:
                self._known.move_to_end(key)
            return found

    def of(self, fd: int, up_to: int | None) -> tuple[os.stat_result, str | None]:
        """fstat and digest of the file open as `fd`, both of one version.

        The digest is the cached one, or computed when the file is at most `up_to` bytes
        (`None`: any size), else None. A file that changes while it is hashed is hashed
        again, at most three times (then the last digest is returned, not kept). Costs a
        pass over the file for each computation.
        """
        for _attempt in range(3):
            st = os.fstat(fd)
            found = self.known(st)
            if found is not None or (up_to is not None and st.st_size > up_to):
                return st, found
            digest, unchanged = self._compute(fd, st)
            if unchanged:
                break
        return st, digest

    def _compute(self, fd: int, st: os.stat_result) -> tuple[str, bool]:
        key = version_of(st)
        if st.st_size <= SHARED_HASH_BYTES:
            return self._hash(fd, st)
        mine: Future[tuple[str, bool]] = Future()
        with self._lock:
            running = self._running.setdefault(key, mine)
        if running is not mine:
            return running.result()
        try:
            outcome = self._hash(fd, st)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._running[key]
        mine.set_result(outcome)
        return outcome

    def _hash(self, fd: int, st: os.stat_result) -> tuple[str, bool]:
        """(digest, whether the file stayed at version `st`); kept when it did, unless racy."""
        started = time.time_ns()
        digest = hash_fd(fd)
        key = version_of(st)
        unchanged = version_of(os.fstat(fd)) == key
        if unchanged and st.st_ctime_ns < started - self._racy_ns:
            with self._lock:
                self._known[key] = digest
                while len(self._known) > self._entries:
                    self._known.popitem(last=False)
        return digest, unchanged
