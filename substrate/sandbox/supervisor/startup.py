"""Pieces of a supervisor's start-up that need no slot (docs/fast-exec.md "How a command
runs", step 2): the failure a start reports, reading the program's `ready` from the
engine's multiplexed stream, and the journal word of an exception. Used by
`supervisors.Supervisors._start`.
"""

from __future__ import annotations

import struct

import trio

from substrate.errors import Refusal
from substrate.sandbox.engine import ContainerGone


class StartFailed(Exception):
    """A start that did not complete; `reason` is its journal word."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def read_ready(sock: trio.socket.SocketType, initial: bytes) -> None:
    """Read the engine's multiplexed stream until the program wrote `ready` on stdout."""
    buf, out = bytearray(initial), bytearray()
    while b"\n" not in out:
        while len(buf) >= 8:
            kind, length = struct.unpack(">BxxxI", buf[:8])
            if len(buf) < 8 + length:
                break
            if kind == 1:
                out += buf[8 : 8 + length]
            del buf[: 8 + length]
        if b"\n" in out:
            break
        if len(out) > 256 or len(buf) > 1 << 16:
            raise StartFailed("protocol")
        chunk = await sock.recv(4096)
        if not chunk:
            raise StartFailed("exited")
        buf += chunk
    if out.split(b"\n", 1)[0] != b"ready":
        raise StartFailed("protocol")


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, trio.ClosedResourceError):
        return "closed"
    if isinstance(exc, ContainerGone):
        return "container_gone"
    if isinstance(exc, Refusal):
        return exc.name
    if isinstance(exc, OSError):
        return "os_error"
    return "engine_error"
