"""The fanotify relay: a tiny process that reads fanotify events from inside a sandbox's
pid namespace, so the kernel itself says which writer was the sandbox's.

Why a process of its own. fanotify reports each event's writer as a pid *translated into
the pid namespace of the process that reads the event* (`pid_vnr`), computed from the
event's reference to the writer, so it holds even when the writer has exited and been
reaped since (a `/proc/<pid>/cgroup` lookup could not: `sh -c 'echo > .env'` is gone
long before anyone reads its event). Read from inside the sandbox's pid namespace, every
process of the sandbox (and of namespaces nested in it) has a pid; every other writer —
the host, a person's editor, the daemon itself, another container — has pid 0. A
namespace can only be entered by a new process (`setns(CLONE_NEWPID)` applies to
children), hence this script: run by the daemon as `python -I -S relay.py FAN NS CTL`,
it enters the namespace `NS` (an fd of `/proc/<init>/ns/pid`), forks, and the child reads
the fanotify group `FAN` until told to stop on `CTL`.

It imports nothing of substrate (it runs without `site` and without the package on its
path). Output on stdout, records of `kind (1 byte) + length (2 bytes LE) + key`:
`S` a (directory handle, name) key the sandbox touched, `H` one something else touched
(each key once per kind; after `MAX_KEYS` distinct keys of one kind a single `O` is sent
instead: the set is no longer complete), `O` events were lost (the kernel queue
overflowed), `F` every event queued when the
flush byte (`F`, or `R`: then every key is forgotten as well, so each is relayed once
again from here on: a new watch window began) arrived on `CTL` has been relayed, `E` the
same for `CTL`'s end-of-file, then the relay exits. One relay serves a sandbox for as
long as it lives (`fanotify.FanotifyAttribution`); the sandbox's end kills it with the
rest of its pid namespace. A key is `handle_type (i32 LE) + handle bytes + NUL + name`, the fields
of the event's `FAN_EVENT_INFO_TYPE_DFID_NAME` record (the fsid is dropped: the group
marks one file system).

Costs: one read per 64 KiB of events, a set lookup per event; memory bounded by
`MAX_KEYS` per kind.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import struct
import sys
from collections.abc import Callable, Iterator

#: Distinct keys relayed per kind before the set is declared incomplete (`O`).
MAX_KEYS = 200_000
FAN_Q_OVERFLOW = 0x4000
_INFO_DFID_NAME = 2
_INFO_DFID = 3
_INFO_FID = 1
_CLONE_NEWPID = 0x20000000
_FIONREAD = 0x541B
_BUFFER = 1 << 16
_METADATA = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_INFO = struct.Struct("=BBH")  # info_type, pad, len
_HANDLE = struct.Struct("=Ii")  # handle_bytes, handle_type


def events(buf: bytes) -> Iterator[tuple[int, int, bytes | None]]:
    """(mask, pid, key or None) of every event in one read of a fanotify fd (pure).

    The key is that of the event's DFID_NAME record; None when it has none (the queue
    overflow event; an event on an inode without a name, e.g. a link count change).
    """
    off = 0
    while off + _METADATA.size <= len(buf):
        length, _, _, meta_len, mask, _, pid = _METADATA.unpack_from(buf, off)
        if length < _METADATA.size:
            return  # malformed: nothing after it can be trusted
        key: bytes | None = None
        at = off + meta_len
        while at + _INFO.size <= off + length:
            info_type, _, info_len = _INFO.unpack_from(buf, at)
            if info_len < _INFO.size:
                break
            if info_type == _INFO_DFID_NAME:
                key = key_of_record(buf[at + _INFO.size : at + info_len])
            at += info_len
        yield mask, pid, key
        off += length


def key_of_record(body: bytes) -> bytes | None:
    """The key of one DFID_NAME record's body (after its header): fsid (8 bytes), then a
    `struct file_handle`, then the NUL-terminated name. None when it is truncated."""
    if len(body) < 8 + _HANDLE.size:
        return None
    size, handle_type = _HANDLE.unpack_from(body, 8)
    start = 8 + _HANDLE.size
    if len(body) < start + size:
        return None
    name = body[start + size :].split(b"\0", 1)[0]
    return struct.pack("<i", handle_type) + body[start : start + size] + b"\0" + name


class Relay:
    """The de-duplicating writer of records (pure but for `write`)."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._seen: dict[bytes, set[bytes]] = {b"S": set(), b"H": set()}
        self._full: set[bytes] = set()

    def feed(self, buf: bytes) -> None:
        out: list[bytes] = []
        for mask, pid, key in events(buf):
            if mask & FAN_Q_OVERFLOW:
                out.append(b"O\0\0")
                continue
            if key is None:
                # An inode with no name: a link count change, a write to an unlinked
                # file. Whatever changed a name was reported on its directory as well.
                continue
            kind = b"S" if pid != 0 else b"H"
            seen = self._seen[kind]
            if key in seen or kind in self._full:
                continue
            if len(seen) >= MAX_KEYS:
                self._full.add(kind)
                out.append(b"O\0\0")
                continue
            seen.add(key)
            out.append(kind + struct.pack("<H", len(key)) + key)
        if out:
            self._write(b"".join(out))

    def reset(self) -> None:
        """Forget every key relayed: from now on each is relayed once again (a new
        watch window began), and the sets may fill up again."""
        self._seen = {b"S": set(), b"H": set()}
        self._full = set()

    def mark(self, kind: bytes) -> None:
        self._write(kind + b"\0\0")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _queued(fan: int) -> int:
    raw = fcntl.ioctl(fan, _FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("=i", raw)[0])


def _drain(fan: int, relay: Relay, want: int) -> None:
    """Relay at least `want` bytes of events (what was queued at a flush), or until the
    queue is empty."""
    done = 0
    while done < want:
        try:
            buf = os.read(fan, _BUFFER)
        except BlockingIOError:
            return
        if not buf:
            return
        done += len(buf)
        relay.feed(buf)


def serve(fan: int, ctl: int, out: int) -> None:
    """The child's loop: relay events; on a byte on `ctl` flush, on its EOF finish."""
    relay = Relay(lambda data: _write_all(out, data))
    poll = select.poll()
    poll.register(fan, select.POLLIN)
    poll.register(ctl, select.POLLIN | select.POLLHUP)
    while True:
        for fd, _ in poll.poll():
            if fd == ctl:
                request = os.read(ctl, 1)
                _drain(fan, relay, _queued(fan))
                if not request:
                    relay.mark(b"E")
                    return
                if request == b"R":
                    relay.reset()
                relay.mark(b"F")
            else:
                _drain(fan, relay, 1)


def main(argv: list[str]) -> int:
    """`relay.py FAN NS CTL`: enter NS's pid namespace, fork, serve in the child."""
    fan, ns, ctl = (int(a) for a in argv[1:4])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(ns, _CLONE_NEWPID) != 0:
        return 3
    os.close(ns)
    child = os.fork()
    if child == 0:
        try:
            serve(fan, ctl, 1)
        finally:
            os._exit(0)
    os.close(fan)
    os.close(ctl)
    os.close(1)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
