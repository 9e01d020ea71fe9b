"""A settled generation's layer removed off the conclusion's path.

Removing an upper dir costs an unlink per file, and the unlink of a file just written
frees its blocks through the file system's journal: measured at about 1 ms a file on a
busy disk, 5 s for a 5,000-file set, longer than its whole scan and apply. So a settled
layer is not removed where it is settled: `Reclaimer.remove` renames its upper and work
dirs aside at once (one `rename(2)` each, within their own parent: the generation's
path is gone before the call returns, atomically) to a name starting `RECLAIM_PREFIX`,
and one background thread removes them (`fsops.remove_tree`: never following a
symlink). A crash leaves renamed dirs behind; `sweep` removes them at the next start
(`layer.recovery.drop_unconcluded`), and nothing else reads them: a generation's name
is its number, so a renamed one is never taken for one. Blocking I/O; thread-safe.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import threading

from substrate.fs import fsops

#: The name a layer dir has between its rename aside and its removal.
RECLAIM_PREFIX = ".reclaim-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _remove(parent: str, name: str) -> None:
    try:
        parent_fd = os.open(parent, _DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            fsops.remove_tree(parent_fd, name)
    finally:
        os.close(parent_fd)


class Reclaimer:
    """Renames layer dirs aside and removes them in one background thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)
        self._waiting = 0

    def remove(self, *dirs: str) -> None:
        """Make each of `dirs` (absent ones are fine) gone now, by a rename within its
        parent, and removed soon. Costs a rename each; the removal is the thread's."""
        for path in dirs:
            parent, name = os.path.split(path)
            aside = f"{RECLAIM_PREFIX}{name}-{secrets.token_hex(6)}"
            try:
                os.rename(path, os.path.join(parent, aside))
            except FileNotFoundError:
                continue
            self._submit(parent, aside)

    def _submit(self, parent: str, name: str) -> None:
        with self._lock:
            self._waiting += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="substrate-reclaim", daemon=True
                )
                self._thread.start()
        self._queue.put((parent, name))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is not None:
                with contextlib.suppress(OSError):  # else left for the next start's sweep
                    _remove(*item)
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every dir handed over is removed; False on timeout (tests, shutdown)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._waiting == 0, timeout)


def sweep(parent: str) -> int:
    """Remove every dir a `Reclaimer` renamed aside in `parent` and did not remove (a
    crash came first); how many. Absent `parent` is fine."""
    try:
        with os.scandir(parent) as it:
            names = [e.name for e in it if e.name.startswith(RECLAIM_PREFIX)]
    except FileNotFoundError:
        return 0
    for name in names:
        _remove(parent, name)
    return len(names)


#: The process's one reclaimer.
RECLAIMER = Reclaimer()
