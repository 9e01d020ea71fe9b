"""The search worker: a process of its own that searches half of one `fs.search`'s files.

Started by `search_pool` as `python -m substrate.workspace.search_worker FD` (an argv
list, never a shell), FD one end of a Unix stream socket pair. It writes `READY` once
imported, then serves one request at a time: a frame (`frame`: an 8-byte length, then
msgpack) holding a `search_split.Request`, sent with two fds by SCM_RIGHTS (the
workspace root and the walk's start, both opened by the parent beneath its held fds),
answered by one frame holding a `search_split.Reply`. It walks the tree as the parent
does (`search_split.SplitScan`, side 1) and reads and matches the files that are its
share. An exception is answered by its class name (the parent then searches serially);
end of file on the socket, or the parent's death (PR_SET_PDEATHSIG), ends it. It never
writes, never runs anything, and logs nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import sys

import msgspec

from substrate.workspace.ignore import Pruner
from substrate.workspace.policy import GlobSet
from substrate.workspace.search import Plan
from substrate.workspace.search_split import (
    MAX_REQUEST_BYTES,
    Reply,
    Request,
    SplitScan,
    max_reply_bytes,
)

READY = b"R"
HEADER = struct.Struct(">Q")
_PR_SET_PDEATHSIG = 1
_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(Request)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def recv_exactly(sock: socket.socket, n: int, into: bytearray | None = None) -> bytes | None:
    """`n` bytes from `sock`, or None at end of file first."""
    buf = into if into is not None else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _request(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next request's payload and fds, or None at end of file. A frame over
    `MAX_REQUEST_BYTES` ends the worker (only the parent writes here)."""
    data, fds, _, _ = socket.recv_fds(sock, HEADER.size, 2)
    if not data:
        return None
    if len(data) < HEADER.size:
        rest = recv_exactly(sock, HEADER.size - len(data))
        if rest is None:
            return None
        data += rest
    (size,) = HEADER.unpack(data)
    if size > MAX_REQUEST_BYTES:
        raise SystemExit("search worker: a request over its bound")
    payload = recv_exactly(sock, size)
    if payload is None:
        return None
    return payload, fds


def serve(req: Request, root: int, top: int) -> Reply:
    """One request's half; takes ownership of `top` (closed by the walk), not `root`."""
    p = req.search.params()
    walking = False
    try:
        plan = Plan.of(p)
        read_deny = GlobSet.of(req.read_deny)

        def may_read(rel: str) -> bool:
            return not read_deny.matches(rel)

        def where(rel: str) -> str:
            return f"{req.root_id}:{rel}"

        prune = Pruner.of(p.exclude, p.gitignore, may_read=may_read, where=where)
        if prune is not None and not prune.start(root, plan.parts):
            return Reply(error="StartLeftOut")  # it changed since the parent looked
        scan = SplitScan(plan, read_deny, prune, side=1, hand_off=req.hand_off)
        walking = True
        scan.run(top, plan.base)
    finally:
        if not walking:
            os.close(top)
    return scan.reply()


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call
        raise SystemExit(0)


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    _die_with_parent(int(argv[2]))
    sock.sendall(READY)
    while True:
        got = _request(sock)
        if got is None:
            return 0
        payload, fds = got
        try:
            if len(fds) != 2:
                raise ValueError("two fds expected")
            root, top = fds
            req = _REQUEST.decode(payload)
            fds = [root]
            out = _ENCODER.encode(serve(req, root, top))
            if len(out) > max_reply_bytes(req.search.params()):
                out = _ENCODER.encode(Reply(error="ReplyTooLarge"))
        except Exception as exc:
            out = _ENCODER.encode(Reply(error=type(exc).__name__))
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(frame(out))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
