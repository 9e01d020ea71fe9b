"""Who made a change: the sandbox, or someone else (docs/write-gate.md, "Attribution").

The rw gate reverts a denied change only when it can attribute it to the sandbox's
processes; anything else — the host, a person's editor, the daemon's own guarded writes,
another container — is never undone (docs/protocol.md §11). An `Attribution` source starts a `Watch`
for one workspace and one sandbox before a command; after it, `Watch.touches` says which
directory entries the sandbox touched and which something else touched meanwhile.

Entries are named by `Key`s: the directory's file handle (`name_to_handle_at`: the inode
and its generation, stable across renames, never reused for another directory while the
kernel can tell them apart) plus the entry's name — exactly what fanotify reports with
`FAN_REPORT_DFID_NAME`. An event on a directory itself is keyed by its own handle and
the name `.`. `keys_of` gives the keys a change at one path may have been reported under.

Implementations: `substrate.workspace.gate.fanotify.FanotifyAttribution` (the kernel),
`EVERY_CHANGE_IS_THE_SANDBOXS` (tests and benches that play the sandbox from the host).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

#: A directory entry as fanotify names it: handle type (i32 LE), handle, NUL, name.
Key = bytes
#: A directory's handle: type (i32 LE) + handle bytes (the prefix of its entries' keys).
Handle = bytes

Verdict = Literal["sandbox", "unattributed", "mixed"]

_MAX_HANDLE = 128
_AT_EMPTY_PATH = 0x1000
_libc = ctypes.CDLL(None, use_errno=True)


def handle_at(dir_fd: int, name: str = "") -> Handle | None:
    """The file handle of `name` in `dir_fd` (of `dir_fd` itself for ""), never following
    a symlink; None when it is gone or its file system gives no handles. One syscall."""
    buf = ctypes.create_string_buffer(8 + _MAX_HANDLE)
    struct.pack_into("=Ii", buf, 0, _MAX_HANDLE, 0)
    mount_id = ctypes.c_int()
    flags = _AT_EMPTY_PATH if name == "" else 0
    if _libc.name_to_handle_at(dir_fd, os.fsencode(name), buf, ctypes.byref(mount_id), flags) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOENT, errno.ENOTDIR, errno.EOPNOTSUPP, errno.EOVERFLOW):
            return None
        raise OSError(err, os.strerror(err))
    size, handle_type = struct.unpack_from("=Ii", buf, 0)
    return struct.pack("<i", handle_type) + buf.raw[8 : 8 + size]


def key(handle: Handle, name: str) -> Key:
    """The key of entry `name` in the directory of `handle` (`.`: the directory itself)."""
    return handle + b"\0" + os.fsencode(name)


@dataclass(frozen=True)
class Touches:
    """What a watch saw so far. `lost`: why events may be missing (then nothing is
    attributable: a missing host event could hide a person's edit)."""

    sandbox: frozenset[Key] = frozenset()
    others: frozenset[Key] = frozenset()
    lost: str | None = None
    everything_sandbox: bool = False  # EVERY_CHANGE_IS_THE_SANDBOXS

    def verdict(self, keys: Iterable[Key]) -> tuple[Verdict, str | None]:
        """Whose change is one reported under any of `keys`: `sandbox` (only the
        sandbox touched it: it may be reverted), `mixed` (something else touched it
        too), `unattributed` (the sandbox did not, or events were lost); with a reason."""
        if self.everything_sandbox:
            return "sandbox", None
        if self.lost is not None:
            return "unattributed", self.lost
        wanted = set(keys)
        if wanted & self.others:
            return ("mixed" if wanted & self.sandbox else "unattributed"), "changed outside"
        if wanted & self.sandbox:
            return "sandbox", None
        return "unattributed", "not seen from the sandbox"


class Watch(Protocol):
    """One running watch (blocking methods: call from a worker thread)."""

    def touches(self) -> Touches:
        """Everything seen up to now (every event queued before the call)."""
        ...

    def close(self) -> None:
        """Stop watching; idempotent."""
        ...


class Attribution(Protocol):
    """A source of attribution."""

    def watch(self, root_fd: int, sandbox_pid: int | None) -> Watch:
        """Start watching the file system of `root_fd` for the processes of the sandbox
        whose process `sandbox_pid` is (its init; None: no sandbox is known). Blocking.
        Raises `Unavailable`."""
        ...


class Unavailable(Exception):
    """No attribution for this command (the message says why): nothing will be
    reverted, every denied change is reported unattributed."""


@dataclass(frozen=True)
class Failed:
    """The `Watch` of a source that could not watch: every change is unattributed."""

    reason: str

    def touches(self) -> Touches:
        return Touches(lost=self.reason)

    def close(self) -> None:
        return None


class _Everything:
    def watch(self, root_fd: int, sandbox_pid: int | None) -> Watch:
        return _EverythingWatch()


class _EverythingWatch:
    def touches(self) -> Touches:
        return Touches(everything_sandbox=True)

    def close(self) -> None:
        return None


#: Every change counts as the sandbox's: for tests and benches in which the host plays
#: the sandbox (never the daemon's choice).
EVERY_CHANGE_IS_THE_SANDBOXS: Attribution = _Everything()
