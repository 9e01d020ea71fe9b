"""`LowerWatch`: has the checkout under a mounted generation changed since it was mounted?

The fresh view's signal (docs/working-layer.md, "The fresh view"): overlayfs leaves a
lower layer changed under a live mount undefined (a file replaced by rename keeps
showing its old bytes, a removed one stays, a name looked up while missing stays
missing), so a generation whose checkout changed is mounted again before a command
starts on it. This module says whether it changed, cheaply: an inotify watch on every
directory of the checkout, one instance per layer.

Theory of operation. `open` adds a watch to each directory beneath the held root fd —
a directory's watch before it is listed, so what appears in it after the listing
queues an event — except the profile's passthrough dirs (their binds show the checkout
itself, never a stale overlay) and other file systems mounted inside (the overlay does
not cross into them). Every event marks the checkout `changed`: a file written, its
mode or owner changed, a name made, removed or renamed, in `.git` too. `drain` reads
the queue (non-blocking, bounded by the kernel's `max_queued_events`) and watches what
a new directory brings before anything is mounted again; a directory renamed, or a
queue overflow, re-walks the whole checkout (the watched paths may be stale). `mounted`
says a generation was just mounted after a `drain`: the mark is cleared. A change made
before that drain is in the queue (inotify queues an event before the system call that
made the change returns), so the mount sees it; one made after it is in the next drain.

The names changed since the last mount (`host_names`) tell, for a command's create,
whether the host touched that very name while the generation was mounted: the
conflict rule of `layer.changes.host_edits` uses them instead of the directory's ctime
when they are known, and the ctime when not (an overflow, a directory moved).

When the watch cannot be kept — no inotify instance left, the per-user watch limit
(ENOSPC), more than `MAX_WATCHED_DIRS` directories or deeper than `MAX_WATCH_DEPTH` —
it is `degraded` for good: `changed` is always true, so every command gets a fresh
mount (correct, a few milliseconds dearer), and `daemon.status` says so.

Not seen: a write through a shared `mmap` (no event), a change made by another host to a
network file system. Blocks (walks, reads): callers use worker threads, except
`pending`, one `poll(2)`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from substrate.errors import Refusal
from substrate.fs.paths import open_dir

log = logging.getLogger("substrate.layer.mounts.lower_watch")

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
#: What each directory's watch asks for: every change of a name in it or of what it
#: names (contents, mode, owner, times, xattrs), and of itself.
WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
#: Past this many directories in a checkout the watch is degraded (fresh mount every
#: command): the per-user watch limit is shared by everything the daemon's user runs.
MAX_WATCHED_DIRS = 100_000
#: Past this depth the watch is degraded: a directory not watched could change unseen.
MAX_WATCH_DEPTH = 256
#: Past this many names changed since a mount, which names changed is forgotten (the
#: ctime rule decides alone: `host_names`).
MAX_TOUCHED_NAMES = 100_000
#: One `read(2)` of the queue: any number of whole events (each 16 bytes + its name).
_READ_BYTES = 256 * 1024
_EVENT = struct.Struct("iIII")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


@dataclass(frozen=True)
class Event:
    """One inotify event: the watch it came from, its mask, the name in that directory."""

    wd: int
    mask: int
    name: str


def parse_events(buf: bytes) -> list[Event]:
    """The events in one `read(2)` of an inotify fd (pure). Names are decoded with
    `surrogateescape` (any bytes a checkout holds)."""
    found: list[Event] = []
    offset = 0
    while offset + _EVENT.size <= len(buf):
        wd, mask, _cookie, length = _EVENT.unpack_from(buf, offset)
        start = offset + _EVENT.size
        raw = buf[start : start + length].split(b"\0", 1)[0]
        found.append(Event(wd, mask, os.fsdecode(raw)))
        offset = start + length
    return found


@dataclass(frozen=True)
class Reading:
    """What a batch of events means (`read_events`, pure): whether the checkout changed,
    the new directories to watch (paths relative to the root), whether the whole
    checkout must be walked again (a directory moved: watched paths may be stale; the
    queue overflowed: events were lost), the watches the kernel dropped, and the names
    changed, as (directory, name) — "" for the directory itself — or None when that is
    not known (an overflow, an unknown watch)."""

    changed: bool
    new_dirs: tuple[str, ...]
    rewalk: bool
    gone: tuple[int, ...]
    names: tuple[tuple[str, str], ...] | None = ()


def read_events(events: Iterable[Event], paths: dict[int, str]) -> Reading:
    """Decide what `events` mean given the watched directories `paths` (wd → relative
    path, "" for the root). Pure. Every event but a dropped watch's `IN_IGNORED` is a
    change (an ignored watch's directory was removed or unmounted, which its parent's
    event says). A new directory under a watch not in `paths` (stale) asks for a
    re-walk."""
    changed = rewalk = False
    new_dirs: list[str] = []
    gone: list[int] = []
    names: list[tuple[str, str]] | None = []
    for ev in events:
        if ev.mask & IN_Q_OVERFLOW:
            changed = rewalk = True
            names = None
            continue
        if ev.mask & IN_IGNORED:
            gone.append(ev.wd)
            continue
        changed = True
        where = paths.get(ev.wd)
        if where is None:
            names = None
        elif names is not None:
            names.append((where, ev.name))
        if ev.mask & IN_UNMOUNT:
            rewalk = True
        if ev.mask & IN_MOVE_SELF or (ev.mask & IN_ISDIR and ev.mask & IN_MOVED_FROM):
            rewalk = True
        if ev.mask & IN_ISDIR and ev.mask & (IN_CREATE | IN_MOVED_TO):
            parent = paths.get(ev.wd)
            if parent is None:
                rewalk = True
            else:
                new_dirs.append(f"{parent}/{ev.name}" if parent else ev.name)
    return Reading(
        changed, tuple(new_dirs), rewalk, tuple(gone), None if names is None else tuple(names)
    )


class WatchLost(Exception):
    """The watch cannot be kept (`reason`: "watch_limit", "too_many_dirs", "too_deep"):
    from now on every command gets a fresh mount."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LowerWatch:
    """The inotify watch of one layer's checkout (see the module doc). Not thread-safe:
    the layer's `mounting` lock serialises its callers."""

    def __init__(self, skip: Iterable[str] = ()) -> None:
        self._fd = -1
        self._skip = frozenset(skip)
        self._paths: dict[int, str] = {}
        #: Something changed since the last `mounted` (or the watch is degraded).
        self.changed = True
        #: Why the watch was given up (every command then gets a fresh mount), or None.
        self.degraded: str | None = None
        #: How many times the checkout was walked whole (the first walk included).
        self.walks = 0
        #: How many drains found a change, walks and degradations so far: the same count
        #: later, with nothing `pending`, means the checkout did not change in between.
        self.seen = 0
        #: directory → the names in it changed since the last `mounted` ("" for the
        #: directory itself), or None when that is not known (`host_names`).
        self._touched: dict[str, set[str]] | None = {}
        self._touched_count = 0

    @classmethod
    def open(cls, root_fd: int, skip: Iterable[str] = ()) -> LowerWatch:
        """Watch every directory beneath `root_fd` but the `skip` paths (relative, each
        not descended into). Never raises for a watch it cannot keep: the result is then
        `degraded`. Cost: an open, a watch and a listing per directory (25 to 130 ms per
        1,000 directories on the loaded 2-CPU development VM; bench/layer.py)."""
        watch = cls(skip)
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            watch._degrade(f"no_inotify ({os.strerror(ctypes.get_errno())})")
            return watch
        watch._fd = fd
        watch._guard(lambda: watch._walk_all(root_fd))
        return watch

    @property
    def dirs(self) -> int:
        """How many directories are watched now."""
        return len(self._paths)

    def pending(self) -> bool:
        """Is anything to be drained, or is the checkout already known changed? One
        `poll(2)` with no wait: cheap enough for the event loop."""
        if self.changed or self._fd < 0:
            return True
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    def drain(self, root_fd: int) -> bool:
        """Read every queued event and keep the watch whole (watch new directories, or
        walk again); return `changed`. Call it before mounting a generation, then
        `mounted`. Cost: one read per 256 KiB of events, a walk per new directory tree,
        a whole walk after a directory move or an overflow."""
        if self._fd < 0:
            return self.changed
        self._guard(lambda: self._drain(root_fd))
        return self.changed

    def mounted(self) -> None:
        """A generation was mounted after the last `drain`: it shows everything drained.
        A degraded watch stays changed. Which names changed is counted from here."""
        self.changed = self.degraded is not None
        self._touched = None if self._fd < 0 else {}
        self._touched_count = 0

    def host_names(self) -> dict[str, frozenset[str]] | None:
        """Every watched directory → the names in it changed since the last `mounted`
        (as drained so far; "" for the directory itself), or None when that is not known:
        events were lost or paths went stale since (an overflow, a directory moved, a
        watch unknown), more than `MAX_TOUCHED_NAMES` changed, `forget_names` was called,
        or the watch is degraded or closed. A directory not in the map is not watched."""
        if self._touched is None or self._fd < 0:
            return None
        touched = self._touched
        return {path: frozenset(touched.get(path, ())) for path in self._paths.values()}

    def forget_names(self) -> None:
        """Which names changed is not known until the next `mounted` (a generation
        mounted again while its since-time is kept: events before this mount count)."""
        self._touched = None

    def close(self) -> None:
        """Drop every watch (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._paths.clear()
        self._touched = None

    # -- internals ---------------------------------------------------------------------

    def _guard(self, step: Callable[[], None]) -> None:
        try:
            step()
        except WatchLost as exc:
            self._degrade(exc.reason)
        except OSError as exc:  # a directory that cannot be watched could change unseen
            self._degrade(f"walk_failed ({errno.errorcode.get(exc.errno or 0, exc.errno)})")

    def _degrade(self, reason: str) -> None:
        if self.degraded is None:
            log.warning("the checkout's watch is given up (%s): every command remounts", reason)
        self.degraded = reason
        self.changed = True
        self.seen += 1
        self.close()

    def _drain(self, root_fd: int) -> None:
        reading = read_events(self._read(), self._paths)
        for wd in reading.gone:
            self._paths.pop(wd, None)
        if reading.changed:
            self.changed = True
            self.seen += 1
        self._note(reading)
        if reading.rewalk:
            self._walk_all(root_fd)
            return
        for rel in reading.new_dirs:
            self._walk_new(root_fd, rel)

    def _note(self, reading: Reading) -> None:
        """Keep the names `reading` says changed (`host_names`)."""
        if self._touched is None:
            return
        if reading.names is None or reading.rewalk:
            self._touched = None
            return
        for where, name in reading.names:
            found = self._touched.setdefault(where, set())
            if name not in found:
                found.add(name)
                self._touched_count += 1
        if self._touched_count > MAX_TOUCHED_NAMES:
            self._touched = None

    def _read(self) -> Iterator[Event]:
        while True:
            try:
                buf = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return
            if not buf:
                return
            yield from parse_events(buf)

    def _walk_all(self, root_fd: int) -> None:
        """Walk the whole checkout: watch each directory (an existing watch keeps its wd),
        then drop the watches no directory answered to (moved out, or stale)."""
        before = self._paths
        self._paths = {}
        self.walks += 1
        self.seen += 1
        dev = os.fstat(root_fd).st_dev
        fd = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
        self._walk(fd, "", 0, dev)
        for wd in set(before) - set(self._paths):
            _libc.inotify_rm_watch(self._fd, wd)  # EINVAL: already gone

    def _walk_new(self, root_fd: int, rel: str) -> None:
        """Watch a new directory `rel` and everything beneath it. Gone already, or not a
        directory: nothing to watch (its removal or replacement is an event of its own);
        a symlink on the way: a directory was replaced, so walk everything again."""
        if rel in self._skip:
            return
        parts = rel.split("/")
        try:
            fd = open_dir(root_fd, parts, where=rel)
        except Refusal as exc:
            if exc.name in ("not_found", "not_a_directory"):
                return
            self._walk_all(root_fd)
            return
        self._walk(fd, rel, len(parts), os.fstat(root_fd).st_dev)

    def _walk(self, top: int, rel: str, depth: int, dev: int) -> None:
        """Watch `top` (an fd this takes over) and every directory beneath it on device
        `dev`, depth first, holding one fd per level."""
        try:
            names = self._watch(top, rel, depth, dev)
        except BaseException:
            os.close(top)
            raise
        stack: list[tuple[int, str, Iterator[str]]] = [(top, rel, iter(names))]
        try:
            while stack:
                parent, parent_path, todo = stack[-1]
                name = next(todo, None)
                if name is None:
                    os.close(parent)
                    stack.pop()
                    continue
                path = f"{parent_path}/{name}" if parent_path else name
                if path in self._skip:
                    continue
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # gone, or now a file or a link: its parent's event says so
                    raise
                try:
                    names = self._watch(fd, path, depth + len(stack), dev)
                except BaseException:
                    os.close(fd)
                    raise
                stack.append((fd, path, iter(names)))
        finally:
            for held, _, _ in stack:
                os.close(held)

    def _watch(self, fd: int, path: str, level: int, dev: int) -> list[str]:
        """Watch one directory, then list its subdirectories (in that order: a name made
        after the listing queues an event)."""
        st = os.fstat(fd)
        if st.st_dev != dev:
            return []  # another file system mounted here: the overlay shows none of it
        if level > MAX_WATCH_DEPTH:
            raise WatchLost("too_deep")
        if len(self._paths) >= MAX_WATCHED_DIRS:
            raise WatchLost("too_many_dirs")
        wd = _libc.inotify_add_watch(self._fd, f"/proc/self/fd/{fd}".encode(), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC:
                raise WatchLost("watch_limit")
            if err in (errno.ENOENT, errno.ENOTDIR):
                return []
            raise OSError(err, os.strerror(err), path or ".")
        self._paths[wd] = path
        subdirs: list[str] = []
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                except OSError:
                    continue
        return subdirs
