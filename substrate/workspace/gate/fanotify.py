"""`FanotifyAttribution`: the kernel says which writer was the sandbox's.

One fanotify group per watch, `FAN_CLASS_NOTIF | FAN_REPORT_DFID_NAME | FAN_REPORT_FID`,
marking the whole file system of the workspace (`FAN_MARK_FILESYSTEM`: directory-entry
events cannot be had from a mount mark) for creations, deletions, moves, writes and
attribute changes, directories included. Its events are read by a relay process inside
the sandbox's pid namespace (`substrate/workspace/gate/relay.py` says why: the kernel
translates each writer's pid into the reader's namespace, so a writer outside the
sandbox reads as pid 0, even long after it exited), which relays each (directory
handle, name) key once, as the sandbox's or as someone else's.

Needs `CAP_SYS_ADMIN` (the daemon runs as root) and a file system that gives file
handles; otherwise `watch` raises `Unavailable` and the gate reverts nothing.

One relay per sandbox (its pid namespace) and file system, started with the first watch
(`python -I -S`, about 30 ms) and kept while the sandbox lives: its end kills the relay
with the rest of the namespace, and the relay exits when the daemon's end of its control
pipe closes (a daemon killed outright included). A watch is a *window* on it: the
group's file-system mark is added when the first window opens and flushed when the last
one closes, so an idle sandbox costs no event; opening a window asks the relay to
relay every key once again (`R`), closing one nothing. Events queued before a window
opened may be counted in it: a host's one only makes a change unattributed (never
reverted), a sandbox's one was the sandbox's. Costs per window: two round trips to the
relay (well under a millisecond) and, while any window is open, one pass over every
event of the file system (the whole machine's writes to it, not only the workspace's);
memory bounded by `relay.MAX_KEYS` per kind, per window.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from substrate.workspace.gate.attribution import Key, Touches, Unavailable, Watch
from substrate.workspace.gate.relay import MAX_KEYS

log = logging.getLogger("substrate.workspace.gate")

RELAY = Path(__file__).with_name("relay.py")
#: How long `touches` waits for the relay to confirm it relayed everything queued.
FLUSH_WAIT_S = 10.0

_FAN_CLOEXEC = 0x1
_FAN_NONBLOCK = 0x2
_FAN_REPORT_FID = 0x200
_FAN_REPORT_DIR_FID = 0x400
_FAN_REPORT_NAME = 0x800
_FAN_MARK_ADD = 0x1
_FAN_MARK_FLUSH = 0x80
_FAN_MARK_FILESYSTEM = 0x100
_EVENTS = (
    0x2  # FAN_MODIFY
    | 0x4  # FAN_ATTRIB
    | 0x8  # FAN_CLOSE_WRITE
    | 0x40  # FAN_MOVED_FROM
    | 0x80  # FAN_MOVED_TO
    | 0x100  # FAN_CREATE
    | 0x200  # FAN_DELETE
    | 0x40000000  # FAN_ONDIR
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_uint64,
    ctypes.c_int,
    ctypes.c_char_p,
]


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


class FanotifyAttribution:
    """`gate.attribution.Attribution` from fanotify (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (pid namespace st_dev, st_ino, workspace file system st_dev) → its relay. The
        #: relay holds the namespace's fd, so no other namespace can take its inode.
        self._relays: dict[tuple[int, int, int], _Relay] = {}

    def watch(self, root_fd: int, sandbox_pid: int | None) -> Watch:
        """Open a window on the relay of `sandbox_pid`'s pid namespace for the file system
        of `root_fd`, starting the relay first if there is none. Raises `Unavailable`
        when no sandbox is named, its namespace is the daemon's own (the sandbox could
        not be told from the host), fanotify refuses, or the relay cannot be started or
        does not answer. Blocking; costs a process start the first time."""
        if sandbox_pid is None:
            raise Unavailable("no sandbox process named")
        try:
            ns = os.open(f"/proc/{sandbox_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise Unavailable(
                f"the sandbox's pid namespace: {os.strerror(exc.errno or 0)}"
            ) from exc
        try:
            mine = os.stat("/proc/self/ns/pid")
            theirs = os.fstat(ns)
            if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
                raise Unavailable("the sandbox shares the daemon's pid namespace")
            where = (theirs.st_dev, theirs.st_ino, os.fstat(root_fd).st_dev)
            with self._lock:
                relay = self._relays.get(where)
                if relay is None or relay.ended:
                    relay = _Relay.start(ns, lambda: self._forget(where))
                    ns = -1  # the relay holds it now
                    self._relays[where] = relay
        finally:
            if ns >= 0:
                os.close(ns)
        return relay.open(root_fd)

    def _forget(self, where: tuple[int, int, int]) -> None:
        with self._lock:
            relay = self._relays.get(where)
            if relay is not None and relay.ended:
                del self._relays[where]


class _Relay:
    """One running relay, the thread that reads what it relays, and its open windows."""

    def __init__(
        self, proc: subprocess.Popen[bytes], fan: int, ns: int, ctl: int, out: int, gone: Any
    ) -> None:
        self._proc = proc
        self._fan = fan  # the group: the daemon adds and flushes its mark
        self._ns = ns
        self._ctl: int | None = ctl
        self._gone = gone
        self._cond = threading.Condition()
        self._requests = threading.Lock()  # one request to the relay at a time
        self._windows: set[FanotifyWatch] = set()
        self._marked = False
        self._flushed = 0
        self.ended = False
        self._reader = threading.Thread(
            target=self._read, args=(out,), name="gate-relay", daemon=True
        )
        self._reader.start()

    @classmethod
    def start(cls, ns: int, gone: Any) -> _Relay:
        """A relay in the pid namespace of `ns` (taken over: closed when the relay
        ends). Raises `Unavailable`."""
        fds = [ns]
        try:
            flags = (
                _FAN_CLOEXEC
                | _FAN_NONBLOCK
                | _FAN_REPORT_FID
                | _FAN_REPORT_DIR_FID
                | _FAN_REPORT_NAME
            )
            fan = _libc.fanotify_init(flags, os.O_RDONLY | os.O_CLOEXEC)
            if fan < 0:
                raise Unavailable(f"fanotify_init: {_errno_text()}")
            fds.append(fan)
            ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(RELAY), str(fan), str(ns), str(ctl_r)],
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(fan, ns, ctl_r),
                )
            except OSError as exc:
                for fd in (ctl_w, out_r):
                    os.close(fd)
                raise Unavailable(f"the relay: {os.strerror(exc.errno or 0)}") from exc
            finally:
                for fd in (ctl_r, out_w):
                    os.close(fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(proc, fan, ns, ctl_w, out_r, gone)

    def open(self, root_fd: int) -> FanotifyWatch:
        """A new window: marks the file system of `root_fd` if no window is open, and has
        the relay relay every key once again. Raises `Unavailable`."""
        window = FanotifyWatch(self)
        with self._requests:
            with self._cond:
                if self.ended:
                    raise Unavailable("the relay ended")
                self._windows.add(window)
            if not self._marked:
                # pathname NULL: the object of `root_fd` itself is marked, nothing resolved.
                flags = _FAN_MARK_ADD | _FAN_MARK_FILESYSTEM
                if _libc.fanotify_mark(self._fan, flags, _EVENTS, root_fd, None) != 0:
                    text = _errno_text()
                    self._drop(window)
                    raise Unavailable(f"fanotify_mark: {text}")
                self._marked = True
            if not self._request(b"R"):
                self._drop(window)
                raise Unavailable("the relay did not answer")
        return window

    def _drop(self, window: FanotifyWatch) -> None:
        """Close `window`; the caller holds `_requests`."""
        with self._cond:
            self._windows.discard(window)
            last = not self._windows
        if last and self._marked:
            # Unmarked, the group gets no events: an idle sandbox costs nothing. What is
            # queued stays and is read with the next window's first request.
            _libc.fanotify_mark(self._fan, _FAN_MARK_FLUSH | _FAN_MARK_FILESYSTEM, 0, -1, None)
            self._marked = False

    def seen(self, window: FanotifyWatch) -> Touches:
        """`window`'s keys, read under the lock the reader records them under."""
        with self._cond:
            return window.seen()

    def close_window(self, window: FanotifyWatch) -> None:
        with self._requests:
            self._drop(window)

    def flush(self) -> bool:
        """Have the relay relay every event queued now; False when it did not answer
        within `FLUSH_WAIT_S` or ended."""
        with self._requests:
            return self._request(b"F")

    def _request(self, byte: bytes) -> bool:
        """Send `byte` and wait for its `F`; the caller holds `_requests`."""
        with self._cond:
            target = self._flushed + 1
            if self.ended or self._ctl is None:
                return False
        try:
            os.write(self._ctl, byte)
        except OSError:
            return False  # the relay is gone: the reader records it
        with self._cond:
            return self._cond.wait_for(
                lambda: self._flushed >= target or self.ended, timeout=FLUSH_WAIT_S
            ) and (self._flushed >= target)

    def _read(self, out: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(out, 1 << 16)
                if not chunk:
                    break
                pending += chunk
                at = 0
                while at + 3 <= len(pending):
                    kind = pending[at : at + 1]
                    (size,) = struct.unpack_from("<H", pending, at + 1)
                    if at + 3 + size > len(pending):
                        break
                    self._record(kind, pending[at + 3 : at + 3 + size])
                    at += 3 + size
                pending = pending[at:]
        finally:
            os.close(out)
            with self._cond:
                self.ended = True
                for window in self._windows:
                    window.lose("the relay ended early")
                self._cond.notify_all()
            self._release()

    def _record(self, kind: bytes, key: Key) -> None:
        with self._cond:
            if kind == b"F":
                self._flushed += 1
                self._cond.notify_all()
                return
            for window in self._windows:
                if kind == b"S":
                    window.add(key, sandbox=True)
                elif kind == b"H":
                    window.add(key, sandbox=False)
                elif kind == b"O":
                    window.lose("events were lost")

    def _release(self) -> None:
        """After the relay's output ended: reap it and close what it used."""
        with self._requests:
            if self._ctl is not None:
                os.close(self._ctl)
                self._ctl = None
            try:
                self._proc.wait(timeout=FLUSH_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("the write gate's fanotify relay did not end: killed")
                self._proc.kill()
                self._proc.wait()
            for fd in (self._fan, self._ns):
                os.close(fd)
            self._fan = self._ns = -1
        self._gone()


class FanotifyWatch:
    """One window on a sandbox's relay (`gate.attribution.Watch`)."""

    def __init__(self, relay: _Relay) -> None:
        self._relay = relay
        self._sandbox: set[Key] = set()
        self._others: set[Key] = set()
        self._lost: str | None = None
        self._closed = False

    def add(self, key: Key, *, sandbox: bool) -> None:
        """A key the relay relayed while this window was open (under the relay's lock)."""
        seen = self._sandbox if sandbox else self._others
        if len(seen) >= MAX_KEYS:
            self.lose("too many changes to tell apart")
        else:
            seen.add(key)

    def lose(self, why: str) -> None:
        self._lost = self._lost or why

    def touches(self) -> Touches:
        """Ask the relay to relay everything queued now, wait for it (at most
        `FLUSH_WAIT_S`), and return what this window saw. Blocking."""
        if not self._relay.flush():
            self.lose("the relay did not answer")
        return self._relay.seen(self)

    def seen(self) -> Touches:
        """What was recorded so far; the caller holds the relay's lock (`_Relay.seen`)."""
        return Touches(frozenset(self._sandbox), frozenset(self._others), self._lost)

    def close(self) -> None:
        """Close the window (the relay keeps running for the sandbox). Idempotent."""
        if not self._closed:
            self._closed = True
            self._relay.close_window(self)
