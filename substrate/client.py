"""Clients of the daemon's Unix sockets: an async (Trio) one and a thin synchronous one.

Both speak newline-delimited JSON-RPC 2.0 and raise `RpcError` for error replies, with
the named refusal in `.refusal`. Results come back as plain JSON values (dicts, lists).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio

AGENT_SOCKET = "substrate.sock"
OPERATOR_SOCKET = "operator.sock"


def state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`--state-dir`, else the daemon's default (`substrate.config.default_state_dir`)."""
    from substrate.config import default_state_dir

    return Path(explicit).absolute() if explicit else default_state_dir()


def socket_path(state: str | os.PathLike[str] | None = None, *, operator: bool = False) -> Path:
    return state_dir(state) / (OPERATOR_SOCKET if operator else AGENT_SOCKET)


class RpcError(Exception):
    """An error reply. `refusal` is the named refusal (SPEC §1), or None for plain codes."""

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


def _raise_or_result(reply: dict[str, Any]) -> Any:
    if "error" in reply:
        err = reply["error"]
        raise RpcError(err.get("code", 0), err.get("message", ""), err.get("data"))
    return reply.get("result")


class Client:
    """Synchronous client: one request at a time; notifications are kept in `notifications`."""

    def __init__(self, path: str | os.PathLike[str], timeout: float | None = 300.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(os.fspath(path))
        self._buf = b""
        self._ids = itertools.count(1)
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
        payload = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        self._sock.sendall(msgspec.json.encode(payload) + b"\n")
        while True:
            message = self.read_message()
            if "id" not in message:
                self.notifications.append(message)
                continue
            if message["id"] == request_id:
                return _raise_or_result(message)


class AsyncClient:
    """Trio client: many requests in flight; notifications arrive on `notifications`."""

    def __init__(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        self._stream = stream
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._send_lock = trio.Lock()
        self._closed = False
        send, self.notifications = trio.open_memory_channel[dict[str, Any]](10000)
        self._notify_send = send
        nursery.start_soon(self._reader)

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
                        # A client that never drains notifications loses the oldest overflow.
                        with contextlib.suppress(trio.WouldBlock):
                            self._notify_send.send_nowait(message)
                        continue
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
            self._notify_send.close()

    async def call(self, method: str, **params: Any) -> Any:
        if self._closed:
            raise ConnectionLost("connection closed by the daemon")
        request_id = next(self._ids)
        event = trio.Event()
        box: list[dict[str, Any]] = []
        self._waiting[request_id] = (event, box)
        payload = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        async with self._send_lock:
            await self._stream.send_all(msgspec.json.encode(payload) + b"\n")
        await event.wait()
        if not box:
            raise ConnectionLost("connection closed by the daemon")
        return _raise_or_result(box[0])

    async def aclose(self) -> None:
        await self._stream.aclose()


@asynccontextmanager
async def open_client(path: str | os.PathLike[str]) -> AsyncIterator[AsyncClient]:
    """Connect to a daemon socket for the duration of the block."""
    stream = await trio.open_unix_socket(os.fspath(path))
    async with trio.open_nursery() as nursery:
        client = AsyncClient(stream, nursery)
        try:
            yield client
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()
