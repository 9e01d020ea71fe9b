"""Clients of the daemon's Unix sockets: an async (Trio) one and a thin synchronous one.

Both speak newline-delimited JSON-RPC 2.0 and raise `RpcError` for error replies, with
the named refusal in `.refusal`. Results come back as plain JSON values (dicts, lists).

A request longer than the daemon's line limit is `RpcError` `request_too_large`, never a
broken pipe: refused before sending when longer than the client's `max_request_bytes`
(by default the daemon's default limit, 1 MiB), else read from the daemon's error reply
(sent before it closes). An error the daemon sends with id null (`unauthorized`,
`limit_exceeded` at connect, `request_too_large`) answers the call that was waiting.

A file too big for one request line goes by chunks: `upload_file` (both clients) hashes
it, then sends it with `fs.upload.begin`/`chunk`/`commit` (docs/protocol.md §14), holding
one chunk in memory at a time.

`AsyncClient` queues notifications (bounded). When the queue is full it drops
`proc.output` pieces, never anything else (`proc.exit` always arrives), counts them in
`dropped_output`, and reports the hole where the server itself reports one: the next
piece of that stream delivered carries `skipped_from` (bytes [skipped_from, offset) were
not delivered; resubscribe with `since`, or read the artifact), and an empty piece with
`skipped_from` precedes the `proc.exit` of a stream whose last pieces were dropped.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import itertools
import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import trio

from substrate.fs.state import StatePaths
from substrate.schema.upload import chunk_bytes


def default_state_dir() -> Path:
    """`$SUBSTRATE_STATE_DIR`, else `$XDG_STATE_HOME/substrate`, else `~/.local/state/substrate`.

    Never inside the checkout: a workspace must not contain the daemon's state.
    """
    explicit = os.environ.get("SUBSTRATE_STATE_DIR")
    if explicit:
        return Path(explicit).absolute()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(base).absolute() / "substrate"


def state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`--state-dir`, else the daemon's default (`default_state_dir`)."""
    return Path(explicit).absolute() if explicit else default_state_dir()


def socket_path(state: str | os.PathLike[str] | None = None, *, operator: bool = False) -> Path:
    paths = StatePaths(state_dir(state))
    return paths.operator_socket if operator else paths.agent_socket


class RpcError(Exception):
    """An error reply. `refusal` is the named refusal (docs/protocol.md §1), or None for plain codes."""

    def __init__(self, code: int, message: str, data: dict[str, Any] | None) -> None:
        super().__init__(f"{message} ({(data or {}).get('refusal', code)})")
        self.code = code
        self.message = message
        self.data = data or {}

    @property
    def refusal(self) -> str | None:
        value = self.data.get("refusal")
        return value if isinstance(value, str) else None


class ConnectionLost(Exception):
    """The daemon closed the connection before answering."""


#: The JSON-RPC code of every named refusal (`substrate.errors.REFUSAL_CODE`).
REFUSAL_CODE = -32001
#: The daemon's default `max_request_bytes`: what a client checks a request against
#: unless told the daemon's own limit (None: no check, the daemon's reply tells).
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
#: How long `AsyncClient.upload_file` waits for the abort of a failed upload, seconds.
ABORT_TIMEOUT_S = 10.0
#: What `upload_file` reads from: a file's path or a binary file open for reading.
Source = str | os.PathLike[str] | BinaryIO


def _error_of(reply: dict[str, Any]) -> RpcError:
    err = reply["error"]
    return RpcError(err.get("code", 0), err.get("message", ""), err.get("data"))


def _raise_or_result(reply: dict[str, Any]) -> Any:
    if "error" in reply:
        raise _error_of(reply)
    return reply.get("result")


def _encode_request(
    request_id: int, method: str, params: dict[str, Any], max_request_bytes: int | None
) -> bytes:
    """The request line; `request_too_large` (not sent) when it passes a known limit."""
    line = msgspec.json.encode(
        {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    )
    if max_request_bytes is not None and len(line) > max_request_bytes:
        raise RpcError(
            REFUSAL_CODE,
            f"request line of {len(line)} bytes exceeds the {max_request_bytes} byte limit"
            " (not sent; a file this big goes by upload_file)",
            {"refusal": "request_too_large", "limit": max_request_bytes},
        )
    return line + b"\n"


def _is_connection_error(message: dict[str, Any]) -> bool:
    """An error the daemon sent with id null: about the connection (or an unparsed line)."""
    return message.get("id", 0) is None and "error" in message


class Client:
    """Synchronous client: one request at a time; notifications are kept in `notifications`.

    `max_request_bytes`: the daemon's line limit (default: its default, 1 MiB); a longer
    request is refused here (`request_too_large`) without being sent. None sends any.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        timeout: float | None = 300.0,
        *,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(os.fspath(path))
        except BaseException:
            self._sock.close()
            raise
        self._buf = b""
        self._ids = itertools.count(1)
        self.max_request_bytes = max_request_bytes
        self.notifications: list[dict[str, Any]] = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def send_raw(self, data: bytes) -> None:
        self._sock.sendall(data)

    def read_message(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            chunk = self._sock.recv(1 << 20)
            if not chunk:
                raise ConnectionLost("connection closed by the daemon")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        message: dict[str, Any] = msgspec.json.decode(line)
        return message

    def call(self, method: str, **params: Any) -> Any:
        request_id = next(self._ids)
        line = _encode_request(request_id, method, params, self.max_request_bytes)
        try:
            self._sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            # The daemon refused the line and closed: its reason is waiting to be read.
            self._raise_connection_error()
            raise
        while True:
            message = self.read_message()
            if "id" not in message:
                self.notifications.append(message)
                continue
            if message["id"] == request_id:
                return _raise_or_result(message)
            if _is_connection_error(message):
                raise _error_of(message)

    def upload_file(
        self,
        workspace: str,
        path: str,
        source: Source,
        *,
        base_sha256: str | None,
        mode: int | None = None,
        create_parents: bool = False,
        dry_run: bool = False,
        plan_digest: str | None = None,
    ) -> Any:
        """Write `source` to `path` through a chunked upload; the commit's plan.

        Bound to `base_sha256` like `fs.write` (None: create). Refuses (`RpcError`) as
        `fs.upload.*` do; on any failure, and after a dry run, the upload is aborted.
        Reads `source` twice (a hash, then the chunks), holding one chunk at a time.
        """
        with _opened(source) as f:
            size, sha256 = _digest(f)
            begun = self.call(
                "fs.upload.begin",
                workspace=workspace,
                path=path,
                base_sha256=base_sha256,
                size=size,
                sha256=sha256,
                mode=mode,
                create_parents=create_parents,
            )
            upload, step = begun["upload"], _step(begun, self.max_request_bytes)
            done = False
            try:
                offset = 0
                while block := f.read(step):
                    data_b64 = base64.b64encode(block).decode("ascii")
                    self.call("fs.upload.chunk", upload=upload, offset=offset, data_b64=data_b64)
                    offset += len(block)
                plan = self.call(
                    "fs.upload.commit", upload=upload, dry_run=dry_run, plan_digest=plan_digest
                )
                done = bool(plan.get("applied"))
                return plan
            finally:
                if not done:
                    with contextlib.suppress(RpcError, ConnectionLost, OSError):
                        self.call("fs.upload.abort", upload=upload)

    def _raise_connection_error(self) -> None:
        """Raise the daemon's id-null error if one is waiting; return if there is none."""
        while True:
            try:
                message = self.read_message()
            except (ConnectionLost, OSError):
                return
            if _is_connection_error(message):
                raise _error_of(message)


class AsyncClient:
    """Trio client: many requests in flight; notifications arrive on `notifications`.

    `notification_buffer` bounds the notifications queue (see the module docstring for
    what happens when it is full); `max_request_bytes` as for `Client`.
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        nursery: trio.Nursery,
        *,
        notification_buffer: int = 10000,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self._stream = stream
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._send_lock = trio.Lock()
        self._closed = False
        self._ended = trio.Event()  # the reader has stopped
        self._connection_error: dict[str, Any] | None = None
        self.max_request_bytes = max_request_bytes
        send, self.notifications = trio.open_memory_channel[dict[str, Any]](notification_buffer)
        self._notify_send = send
        #: `proc.output` pieces dropped because the queue was full (0: none lost).
        self.dropped_output = 0
        # (proc, stream) → [first, end) of the bytes dropped since the last delivered piece.
        self._holes: dict[tuple[str, str], tuple[int, int]] = {}
        # Notifications that must arrive, waiting (in order) for room in the queue.
        self._held: collections.deque[dict[str, Any]] = collections.deque()
        self._held_changed = trio.Event()
        nursery.start_soon(self._reader)
        nursery.start_soon(self._feed_held)

    async def _reader(self) -> None:
        buf = b""
        try:
            while True:
                chunk = await self._stream.receive_some(1 << 20)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    message = msgspec.json.decode(line)
                    if "id" not in message:
                        self._deliver(message)
                        continue
                    if _is_connection_error(message):
                        self._connection_error = message
                    waiter = self._waiting.pop(message["id"], None)
                    if waiter is not None:
                        waiter[1].append(message)
                        waiter[0].set()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._closed = True
            for event, _ in self._waiting.values():
                event.set()
            self._ended.set()
            self._held_changed.set()

    # -- notifications ------------------------------------------------------------------

    def _deliver(self, message: dict[str, Any]) -> None:
        """Queue a notification; when full, drop `proc.output` only (never `proc.exit`)."""
        output = _output_key(message)
        if output is None:
            if message.get("method") == "proc.exit":
                self._close_holes(message.get("params", {}).get("proc"))
            self._put_or_hold(message)
            return
        if not self._held and self._try_put(self._with_hole(output, message)):
            self._holes.pop(output, None)
            return
        self._record_hole(output, message)

    def _try_put(self, message: dict[str, Any]) -> bool:
        try:
            self._notify_send.send_nowait(message)
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True  # nobody reads notifications any more
        return True

    def _put_or_hold(self, message: dict[str, Any]) -> None:
        if self._held or not self._try_put(message):
            self._held.append(message)
            self._held_changed.set()

    def _with_hole(self, key: tuple[str, str], message: dict[str, Any]) -> dict[str, Any]:
        """`message`, with `skipped_from` set if pieces of its stream were dropped before it."""
        hole = self._holes.get(key)
        if hole is None:
            return message
        params = dict(message.get("params", {}))
        skipped = params.get("skipped_from")
        params["skipped_from"] = hole[0] if skipped is None else min(skipped, hole[0])
        return {**message, "params": params}

    def _record_hole(self, key: tuple[str, str], message: dict[str, Any]) -> None:
        self.dropped_output += 1
        params = message.get("params", {})
        offset = int(params.get("offset", 0))
        end = offset + _piece_length(params)
        first = params.get("skipped_from")
        hole = self._holes.get(key)
        start = offset if first is None else int(first)
        if hole is not None:
            start = min(start, hole[0])
        self._holes[key] = (start, max(end, hole[1] if hole else end))

    def _close_holes(self, proc: Any) -> None:
        """Before `proc.exit`: an empty piece with `skipped_from` for every open hole."""
        for key in [k for k in self._holes if k[0] == str(proc)]:
            start, end = self._holes.pop(key)
            piece = {"proc": key[0], "stream": key[1], "offset": end, "data": ""}
            piece["skipped_from"] = start
            self._put_or_hold({"jsonrpc": "2.0", "method": "proc.output", "params": piece})

    async def _feed_held(self) -> None:
        """Move held notifications into the queue, in order, as room appears."""
        while True:
            while self._held:
                try:
                    await self._notify_send.send(self._held[0])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._held.clear()
                    return
                self._held.popleft()
            if self._ended.is_set():
                self._notify_send.close()
                return
            self._held_changed = trio.Event()
            await self._held_changed.wait()

    # -- calls -------------------------------------------------------------------------

    async def call(self, method: str, **params: Any) -> Any:
        if self._closed:
            raise self._lost()
        request_id = next(self._ids)
        line = _encode_request(request_id, method, params, self.max_request_bytes)
        event = trio.Event()
        box: list[dict[str, Any]] = []
        self._waiting[request_id] = (event, box)
        try:
            async with self._send_lock:
                await self._stream.send_all(line)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # Refused and closed by the daemon (too large?): its reason arrives on the reader.
            self._waiting.pop(request_id, None)
            await self._ended.wait()
            raise self._lost() from None
        await event.wait()
        if not box:
            raise self._lost()
        return _raise_or_result(box[0])

    async def upload_file(
        self,
        workspace: str,
        path: str,
        source: Source,
        *,
        base_sha256: str | None,
        mode: int | None = None,
        create_parents: bool = False,
        dry_run: bool = False,
        plan_digest: str | None = None,
    ) -> Any:
        """`Client.upload_file`, with the file read in worker threads."""
        with _opened(source) as f:
            size, sha256 = await trio.to_thread.run_sync(_digest, f)
            begun = await self.call(
                "fs.upload.begin",
                workspace=workspace,
                path=path,
                base_sha256=base_sha256,
                size=size,
                sha256=sha256,
                mode=mode,
                create_parents=create_parents,
            )
            upload, step = begun["upload"], _step(begun, self.max_request_bytes)
            done = False
            try:
                offset = 0
                while block := await trio.to_thread.run_sync(f.read, step):
                    data_b64 = base64.b64encode(block).decode("ascii")
                    await self.call(
                        "fs.upload.chunk", upload=upload, offset=offset, data_b64=data_b64
                    )
                    offset += len(block)
                plan = await self.call(
                    "fs.upload.commit", upload=upload, dry_run=dry_run, plan_digest=plan_digest
                )
                done = bool(plan.get("applied"))
                return plan
            finally:
                if not done:
                    # Shielded (the upload is ours to drop, even when cancelled) but bounded.
                    with (
                        trio.move_on_after(ABORT_TIMEOUT_S, shield=True),
                        contextlib.suppress(
                            RpcError, ConnectionLost, OSError, trio.BrokenResourceError
                        ),
                    ):
                        await self.call("fs.upload.abort", upload=upload)

    def _lost(self) -> Exception:
        """The daemon's id-null error if it sent one before closing, else `ConnectionLost`."""
        if self._connection_error is not None:
            return _error_of(self._connection_error)
        return ConnectionLost("connection closed by the daemon")

    async def aclose(self) -> None:
        await self._stream.aclose()


@contextlib.contextmanager
def _opened(source: Source) -> Iterator[BinaryIO]:
    """`source` as a binary file at offset 0 (opened and closed here when a path)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            yield f
    else:
        source.seek(0)
        yield source


def _digest(f: BinaryIO) -> tuple[int, str]:
    """(size, SHA-256) of `f` from its offset to the end; `f` is left at offset 0."""
    h = hashlib.sha256()
    size = 0
    while block := f.read(1 << 20):
        h.update(block)
        size += len(block)
    f.seek(0)
    return size, h.hexdigest()


def _step(begun: dict[str, Any], max_request_bytes: int | None) -> int:
    """The chunk size: the daemon's advice, no more than our own known limit allows."""
    step = int(begun["chunk_bytes"])
    return step if max_request_bytes is None else min(step, chunk_bytes(max_request_bytes))


def _output_key(message: dict[str, Any]) -> tuple[str, str] | None:
    """(proc, stream) of a `proc.output` notification, else None."""
    if message.get("method") != "proc.output":
        return None
    params = message.get("params")
    if not isinstance(params, dict):
        return None
    return str(params.get("proc")), str(params.get("stream"))


def _piece_length(params: dict[str, Any]) -> int:
    """Bytes of a `proc.output` piece (text is UTF-8, `data_b64` base64)."""
    data = params.get("data")
    if isinstance(data, str):
        return len(data.encode("utf-8", "surrogatepass"))
    b64 = params.get("data_b64")
    if isinstance(b64, str):
        return len(base64.b64decode(b64))
    return 0


@asynccontextmanager
async def open_client(
    path: str | os.PathLike[str],
    *,
    notification_buffer: int = 10000,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
) -> AsyncIterator[AsyncClient]:
    """Connect to a daemon socket for the duration of the block."""
    stream = await trio.open_unix_socket(os.fspath(path))
    async with trio.open_nursery() as nursery:
        client = AsyncClient(
            stream,
            nursery,
            notification_buffer=notification_buffer,
            max_request_bytes=max_request_bytes,
        )
        try:
            yield client
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()
