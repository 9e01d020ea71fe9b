"""Shared directory fsyncs: concurrent renames in one directory made durable by one flush.

Theory of operation. A guarded write renames its temp file over the target under the
workspace's commit lock, then makes the rename durable with an fsync of the directory
before its journal entry commits (docs/protocol.md §4). The fsync runs after the lock is
released, through `DirSyncs.sync`: an fsync of a directory makes durable every entry
change made in it before the fsync began, so a caller whose rename is done waits for
the first fsync of that directory (by device and inode) that *starts* after it asked,
and starts one itself when none is running. N writers renaming in one directory at once
pay one or two fsyncs instead of N, and hold the commit lock for the rename only; a lone
writer pays exactly one fsync, as before.

Which fd is fsynced does not matter: any fd of the directory flushes the same inode;
the one that starts a flush uses its own. An fsync that fails fails every caller that
was waiting for it (each raises the OSError), as its own fsync would have.

Blocking: call from worker threads. Costs a lock, a wake-up per waiter (only those a
flush covers, and the one to start the next), and a small record per directory (dropped
when no one waits on it).
"""

from __future__ import annotations

import os
import threading

__all__ = ["DirSyncs"]


class _Dir:
    """One directory's flushes: `started` counts those begun, `done` those finished."""

    __slots__ = ("done", "error", "failed", "running", "sleepers", "started", "users")

    def __init__(self) -> None:
        self.started = 0
        self.done = 0
        self.running = False
        self.users = 0
        #: The last failed flush's number and error.
        self.failed = 0
        self.error: OSError | None = None
        #: Callers waiting for a flush, in order: the number they need and the lock
        #: (held) each sleeps on; whoever releases one has removed it from here.
        self.sleepers: list[tuple[int, threading.Lock]] = []

    def finished(self, mine: int) -> None:
        """Flush `mine` is done: wake those it covers, and the next caller to start
        the following flush when someone still waits (call holding the lock)."""
        left: list[tuple[int, threading.Lock]] = []
        for need, lock in self.sleepers:
            if need <= mine:
                lock.release()
            else:
                left.append((need, lock))
        if left:
            left.pop(0)[1].release()
        self.sleepers = left


class DirSyncs:
    """Coalesced directory fsyncs, keyed by (st_dev, st_ino)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[tuple[int, int], _Dir] = {}

    def sync(self, dir_fd: int) -> None:
        """Return once an fsync of `dir_fd`'s directory that began after this call is
        done (every entry change made in it before the call is durable); raises the
        OSError of that fsync."""
        st = os.fstat(dir_fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            d = self._dirs.get(key)
            if d is None:
                d = self._dirs[key] = _Dir()
            d.users += 1
            # The first flush that starts from now on covers this caller's changes.
            need = d.started + 1
            try:
                while d.done < need:
                    if d.running:
                        self._sleep(d, need)
                        continue
                    d.running = True
                    d.started += 1
                    mine = d.started
                    self._lock.release()
                    error: OSError | None = None
                    try:
                        os.fsync(dir_fd)
                    except OSError as exc:
                        error = exc
                    finally:
                        self._lock.acquire()
                        d.running = False
                        d.done = mine
                        if error is not None:
                            d.failed, d.error = mine, error
                        d.finished(mine)
                if d.error is not None and d.failed >= need:
                    raise d.error
            finally:
                d.users -= 1
                if d.users == 0:
                    del self._dirs[key]

    def _sleep(self, d: _Dir, need: int) -> None:
        """Wait (the lock released meanwhile) until a flush ends that covers `need`, or
        this caller is to start the next one."""
        lock = threading.Lock()
        lock.acquire()
        d.sleepers.append((need, lock))
        self._lock.release()
        woken = False
        try:
            woken = lock.acquire()
        finally:
            self._lock.acquire()
            if not woken:  # interrupted: never leave a sleeper that cannot wake
                if (need, lock) in d.sleepers:
                    d.sleepers.remove((need, lock))
                elif not d.running and d.sleepers:
                    d.sleepers.pop(0)[1].release()  # pass on the turn it was given
