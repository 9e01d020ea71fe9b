"""The MCP server's stdio transport: bounded lines in, one JSON-RPC message per line out.

Theory of operation: the SDK's own stdio transport hands a line it cannot parse to the
session as an exception, which drops it with no reply, and reads a line of any length.
This one reads the host's bytes itself and decides each line before the SDK sees it
(`decide`, pure): a valid JSON-RPC message goes on to the session; anything else is
answered here (docs/mcp.md "Malformed input"), and the server goes on serving:

- a line that is not JSON (cut short, invalid UTF-8), nests deeper than
  `substrate.protocol.rpc.MAX_DEPTH` (refused before any parser recurses), or is longer
  than `MAX_LINE_BYTES` (dropped to its newline, never buffered): -32700, `id: null`;
- JSON that is not a JSON-RPC message: -32600, with the `id` when one can be read.

While it serves, fd 0 reads the null device and fd 1 writes to stderr (the wire has
private duplicates), so a stray print never corrupts the wire; both are restored after.
Reads and writes of the pipes run in threads: the host's pipes are left blocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator, Iterator

import anyio
import mcp.types as types
import msgspec
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage

from substrate.protocol import rpc

#: The longest line read from the host, bytes (a tool call carries at most the daemon's
#: 1 MiB request, JSON-escaped); a longer one is answered -32700 and skipped.
MAX_LINE_BYTES = 4 << 20
#: Bytes per read of stdin.
READ_BYTES = 65536
#: On the way out, how long what the session wrote may take to reach the host, seconds.
FLUSH_S = 5.0

log = logging.getLogger("substrate.mcp")


def _error(request_id: int | str | None, code: int, message: str) -> types.JSONRPCError:
    return types.JSONRPCError(
        jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=message)
    )


def too_long() -> types.JSONRPCError:
    return _error(None, rpc.PARSE_ERROR, f"parse error: line exceeds {MAX_LINE_BYTES} bytes")


def decide(line: bytes) -> SessionMessage | types.JSONRPCError:
    """A line from the host → the message for the session, or the error reply to send.

    Costs two passes over the line before the SDK's parser sees it.
    """
    if rpc.nesting_exceeds(line, rpc.MAX_DEPTH):
        return _error(
            None, rpc.PARSE_ERROR, f"parse error: nests deeper than {rpc.MAX_DEPTH} levels"
        )
    try:
        message: types.JSONRPCMessage = types.jsonrpc_message_adapter.validate_json(
            line, by_name=False
        )
    except ValueError:  # pydantic's ValidationError: not JSON, or not a message
        pass
    else:
        return SessionMessage(message)
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return _error(None, rpc.PARSE_ERROR, "parse error: the line is not JSON")
    found = value.get("id") if isinstance(value, dict) else None
    request_id = found if isinstance(found, (int, str)) and not isinstance(found, bool) else None
    return _error(request_id, rpc.INVALID_REQUEST, "invalid request: not a JSON-RPC message")


class Lines:
    """Splits bytes into lines of at most `limit` bytes; the rest of a longer line is
    dropped up to its newline (`feed` reports it as None, once)."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes | None]:
        out: list[bytes | None] = []
        start = 0
        while start <= len(data):
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if not self._skipping:
                if len(self._buf) + len(piece) > self._limit:
                    self._buf.clear()
                    self._skipping = True
                    out.append(None)
                else:
                    self._buf += piece
            if end < 0:
                break
            if not self._skipping and self._buf.strip():
                out.append(bytes(self._buf).strip())
            self._buf.clear()
            self._skipping = False
            start = end + 1
        return out

    def finish(self) -> list[bytes]:
        """At end of input: the last line, if it lacked its newline."""
        line = b"" if self._skipping else bytes(self._buf).strip()
        self._buf.clear()
        return [line] if line else []


@contextlib.contextmanager
def claim_stdio() -> Iterator[tuple[int, int]]:
    """Private duplicates of fds 0 and 1 (the wire) while fd 0 reads the null device and
    fd 1 writes to stderr; both restored on the way out."""
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
    finally:
        os.close(null)
    try:
        yield wire_in, wire_out
    finally:
        os.dup2(wire_in, 0)
        os.dup2(wire_out, 1)
        os.close(wire_out)
        # `wire_in` stays open: an abandoned read may still block on it, and a closed
        # number could be reused under it.


SessionStreams = tuple[
    MemoryObjectReceiveStream[SessionMessage | Exception],
    MemoryObjectSendStream[SessionMessage],
]


@contextlib.asynccontextmanager
async def open_stdio() -> AsyncIterator[SessionStreams]:
    """Serve the wire on stdin/stdout: yields the session's (read, write) streams.

    The read stream ends when the host closes stdin; on the way out, what the session
    wrote is flushed (at most `FLUSH_S`), then the reader is abandoned if still blocked.
    """
    with claim_stdio() as (wire_in, wire_out):
        to_session, from_host = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        to_host, from_session = anyio.create_memory_object_stream[SessionMessage](0)
        written = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read, wire_in, to_session, to_host.clone())
            nursery.start_soon(_write, wire_out, from_session, written)
            try:
                yield from_host, to_host
            finally:
                to_host.close()
                with trio.move_on_after(FLUSH_S):
                    await written.wait()
                nursery.cancel_scope.cancel()


async def _read(
    fd: int,
    to_session: MemoryObjectSendStream[SessionMessage | Exception],
    to_host: MemoryObjectSendStream[SessionMessage],
) -> None:
    lines = Lines()
    with to_session, to_host:
        while True:
            data = await trio.to_thread.run_sync(os.read, fd, READ_BYTES, abandon_on_cancel=True)
            split: list[bytes | None] = [*lines.feed(data)] if data else [*lines.finish()]
            for line in split:
                decided = too_long() if line is None else decide(line)
                if isinstance(decided, SessionMessage):
                    await to_session.send(decided)
                else:
                    await to_host.send(SessionMessage(decided))
            if not data:
                return


async def _write(
    fd: int, from_session: MemoryObjectReceiveStream[SessionMessage], written: trio.Event
) -> None:
    try:
        with from_session:
            async for item in from_session:
                text = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                await trio.to_thread.run_sync(_write_all, fd, text.encode() + b"\n")
    except OSError:
        log.warning("stdout is gone: the MCP host stopped reading")
    finally:
        written.set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
