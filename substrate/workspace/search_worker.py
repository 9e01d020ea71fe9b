"""The search worker: a process of its own that searches part of one `fs.search`'s files.

Started by `search_pool` as `python -m substrate.workspace.search_worker FD` (an argv
list, never a shell), FD one end of a Unix stream socket pair.
It writes `READY` once imported, then serves one search at a time: frames (`frame`:
an 8-byte length, then msgpack) each holding a `search_split.Batch`, sent with the
directory fds its files are beneath (SCM_RIGHTS; held and opened by the parent's walk),
the first with the search, the last answered by one frame holding a
`search_split.Reply`. Each file is opened beneath its directory's fd with O_NOFOLLOW
and read and matched as the serial search does (`search_split.SplitScan.take`). An
exception is answered by its class name (the parent then searches serially); end of
file on the socket (the parent closed it, or died) ends it, and so does a reply the
parent is no longer there to read. Not PR_SET_PDEATHSIG: it fires when the *thread*
that started the worker ends, and the daemon starts it from a pooled worker thread. It walks
nothing, writes nothing, runs nothing and logs nothing.
"""

from __future__ import annotations

import os
import socket
import struct
import sys

import msgspec

from substrate.workspace.policy import GlobSet
from substrate.workspace.search import Plan, _Truncated
from substrate.workspace.search_split import (
    BATCH_FDS,
    MAX_REQUEST_BYTES,
    Batch,
    Reply,
    Search,
    SplitScan,
    max_reply_bytes,
)

READY = b"R"
HEADER = struct.Struct(">Q")
_ENCODER = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(Batch)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes from `sock`, or None at end of file first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _frame_in(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next frame's payload and fds, or None at end of file. A frame over
    `MAX_REQUEST_BYTES` ends the worker (only the parent writes here)."""
    data, fds, _, _ = socket.recv_fds(sock, HEADER.size, BATCH_FDS)
    if not data:
        return None
    try:
        if len(data) < HEADER.size:
            rest = recv_exactly(sock, HEADER.size - len(data))
            if rest is None:
                raise SystemExit(0)
            data += rest
        (size,) = HEADER.unpack(data)
        if size > MAX_REQUEST_BYTES:
            raise SystemExit("search worker: a frame over its bound")
        payload = recv_exactly(sock, size)
        if payload is None:
            raise SystemExit(0)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return payload, fds


class _Search:
    """One search's half, fed batch by batch."""

    def __init__(self, search: Search) -> None:
        p = search.params()
        self.p = p
        self.scan = SplitScan(Plan.of(p), GlobSet.of([]), None)

    def take(self, batch: Batch, fds: list[int]) -> None:
        scan = self.scan
        if scan.truncated:
            return
        if len(batch.rels) != len(batch.idx) or len(batch.dirs) != len(batch.idx):
            raise ValueError("a batch's lists differ in length")
        try:
            for slot, rel, index in zip(batch.dirs, batch.rels, batch.idx, strict=True):
                scan.take(fds[slot], rel.decode("utf-8", "surrogateescape"), index)
        except _Truncated:
            scan.truncated = True


def serve(sock: socket.socket) -> bool:
    """One search: batches until the last, then the reply. False at end of file."""
    search: _Search | None = None
    error: str | None = None
    while True:
        got = _frame_in(sock)
        if got is None:
            return False
        payload, fds = got
        try:
            batch = _BATCH.decode(payload)
        except msgspec.DecodeError:
            for fd in fds:
                os.close(fd)
            raise SystemExit("search worker: a frame that does not decode") from None
        try:
            if error is None:
                if search is None:
                    if batch.search is None:
                        raise ValueError("the first batch carries no search")
                    search = _Search(batch.search)
                search.take(batch, fds)
        except Exception as exc:
            error = error or type(exc).__name__
        finally:
            for fd in fds:
                os.close(fd)
        if batch.last:
            break
    out = b""
    if error is None and search is not None:
        out = _ENCODER.encode(search.scan.reply())
        if len(out) > max_reply_bytes(search.p):
            error = "ReplyTooLarge"
    if error is not None or search is None:
        out = _ENCODER.encode(Reply(error=error or "NoSearch"))
    sock.sendall(frame(out))
    return True


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    sock.sendall(READY)
    while serve(sock):
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
