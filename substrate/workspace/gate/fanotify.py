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

Costs per watch: a relay process (`python -I -S`, about 30 ms to start, overlapping the
snapshot walk), and for as long as it runs one pass over every event of the file system
(the whole machine's writes to it, not only the workspace's); memory bounded by the
relay's `MAX_KEYS` per kind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

from substrate.workspace.gate.attribution import Key, Touches, Unavailable, Watch

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

    def watch(self, root_fd: int, sandbox_pid: int | None) -> Watch:
        """Mark the file system of `root_fd` and start the relay in the pid namespace of
        `sandbox_pid`. Raises `Unavailable` when the namespace is the daemon's own (the
        sandbox could not be told from the host), fanotify refuses, or the relay cannot
        be started, or no sandbox is named. Blocking; costs a process start."""
        if sandbox_pid is None:
            raise Unavailable("no sandbox process named")
        try:
            ns = os.open(f"/proc/{sandbox_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise Unavailable(
                f"the sandbox's pid namespace: {os.strerror(exc.errno or 0)}"
            ) from exc
        fds = [ns]
        try:
            mine = os.stat("/proc/self/ns/pid")
            theirs = os.fstat(ns)
            if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
                raise Unavailable("the sandbox shares the daemon's pid namespace")
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
            # pathname NULL: the object of `root_fd` itself is marked, nothing is resolved.
            flags = _FAN_MARK_ADD | _FAN_MARK_FILESYSTEM
            if _libc.fanotify_mark(fan, flags, _EVENTS, root_fd, None) != 0:
                raise Unavailable(f"fanotify_mark: {_errno_text()}")
            ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
            fds.append(ctl_r)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            fds.append(out_w)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(RELAY), str(fan), str(ns), str(ctl_r)],
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(fan, ns, ctl_r),
                )
            except OSError as exc:
                os.close(ctl_w)
                os.close(out_r)
                raise Unavailable(f"the relay: {os.strerror(exc.errno or 0)}") from exc
            return FanotifyWatch(proc, ctl_w, out_r)
        finally:
            for fd in fds:
                os.close(fd)


class FanotifyWatch:
    """A running relay and the thread that collects what it relays."""

    def __init__(self, proc: subprocess.Popen[bytes], ctl: int, out: int) -> None:
        self._proc = proc
        self._ctl: int | None = ctl
        self._cond = threading.Condition()
        self._sandbox: set[Key] = set()
        self._others: set[Key] = set()
        self._lost: str | None = None
        self._flushed = 0
        self._ended = False
        self._reader = threading.Thread(
            target=self._read, args=(out,), name="gate-relay", daemon=True
        )
        self._reader.start()

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
                if self._lost is None and not self._ended:
                    self._lost = "the relay ended early"
                self._ended = True
                self._cond.notify_all()

    def _record(self, kind: bytes, key: Key) -> None:
        with self._cond:
            if kind == b"S":
                self._sandbox.add(key)
            elif kind == b"H":
                self._others.add(key)
            elif kind == b"O":
                self._lost = self._lost or "events were lost"
            elif kind == b"F":
                self._flushed += 1
                self._cond.notify_all()
            elif kind == b"E":
                self._ended = True
                self._cond.notify_all()

    def touches(self) -> Touches:
        """Ask the relay to relay everything queued now, wait for it (at most
        `FLUSH_WAIT_S`), and return what was seen. Blocking."""
        with self._cond:
            target = self._flushed + 1
            ended = self._ended
        if not ended and self._ctl is not None:
            with contextlib.suppress(OSError):  # the relay is gone: the reader records it
                os.write(self._ctl, b"F")
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._flushed >= target or self._ended, timeout=FLUSH_WAIT_S
            ):
                self._lost = self._lost or "the relay did not answer"
            if self._flushed < target and self._lost is None:
                self._lost = "the relay ended early"
            return Touches(frozenset(self._sandbox), frozenset(self._others), self._lost)

    def close(self) -> None:
        """Tell the relay to finish, reap it (killed after `FLUSH_WAIT_S`). Blocking."""
        if self._ctl is None:
            return
        os.close(self._ctl)
        self._ctl = None
        try:
            self._proc.wait(timeout=FLUSH_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the write gate's fanotify relay did not end: killed")
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=FLUSH_WAIT_S)
