"""The Unix-socket JSON-RPC server: the I/O edge around `substrate.rpc` (SPEC §1).

One task reads a connection, splitting lines and starting one task per request (at most
`max_in_flight` at a time: past that the reader waits, which is the backpressure). All
replies and notifications go through one send lock. Deadlines: a started line must end
within `line_timeout_s`; a connection with nothing in flight closes after
`idle_timeout_s`; a send that cannot progress for `send_timeout_s` closes the connection.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from substrate import rpc
from substrate.api import HANDLERS
from substrate.api.base import Actor, Caller
from substrate.errors import Internal, LimitExceeded, Refusal, Unauthorized

if TYPE_CHECKING:
    from substrate.daemon import Daemon

log = logging.getLogger("substrate.server")

SEND_TIMEOUT_S = 30.0
_connection_ids = itertools.count(1)

#: Methods whose refusals are journaled (they would have changed state).
MUTATING = frozenset({"fs.write", "fs.patch", "fs.delete", "proc.run", "proc.start"})
#: Methods that run to completion (reply included) even when the daemon is stopping.
WRITES = frozenset({"fs.write", "fs.patch", "fs.delete"})


def bind_unix(path: Path, mode: int) -> socket.socket:
    """Bind a listening Unix socket at `path`, never through a pre-planted symlink.

    A stale socket from a previous run is replaced; anything else at the path (a symlink,
    a file) is refused with `StartupError`.
    """
    from substrate.daemon import StartupError

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(
                f"{path} exists and is not a socket (refusing to follow or replace it)"
            )
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        # The state dir is 0700 and ours, so nobody can swap the path between bind and chmod.
        os.chmod(path, mode)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(sock: trio.socket.SocketType) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class _Connections:
    def __init__(self) -> None:
        self.count = 0


async def serve_socket(
    daemon: Daemon,
    path: Path,
    mode: int,
    actor: Actor,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one socket until cancelled."""
    raw = bind_unix(path, mode)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
    live = _Connections()

    async def handle(stream: trio.SocketStream) -> None:
        conn = Connection(daemon, stream, actor, live)
        await conn.run()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handle, [listener])
            task_status.started()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Connection:
    """One client connection on one socket."""

    def __init__(
        self, daemon: Daemon, stream: trio.SocketStream, actor: Actor, live: _Connections
    ) -> None:
        self.daemon = daemon
        self.stream = stream
        self.actor = actor
        self.live = live
        self.id = next(_connection_ids)
        self._send_lock = trio.Lock()
        self._in_flight = trio.Semaphore(daemon.config.max_in_flight)
        self._busy = 0
        self._closed = False

    async def send(self, data: bytes) -> None:
        if self._closed:
            return
        async with self._send_lock:
            with trio.move_on_after(SEND_TIMEOUT_S) as scope:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._closed = True
            if scope.cancelled_caught:
                # The peer stopped reading: drop it rather than hold memory for it.
                self._closed = True
                await trio.aclose_forcefully(self.stream)

    async def notify(self, method: str, params: Any) -> None:
        await self.send(rpc.notification(method, params))

    async def run(self) -> None:
        config = self.daemon.config
        try:
            uid = peer_uid(self.stream.socket)
            if uid not in config.effective_uids():
                await self.send(rpc.refusal_error(None, Unauthorized("peer uid is not allowed")))
                return
            if self.live.count >= config.max_connections:
                await self.send(rpc.refusal_error(None, LimitExceeded("too many connections")))
                return
            self.live.count += 1
            caller = Caller(actor=self.actor, uid=uid, connection=self.id, notify=self.notify)
            try:
                async with trio.open_nursery() as nursery:
                    await self._read_loop(nursery, caller)
                    nursery.cancel_scope.cancel()
            finally:
                self.live.count -= 1
                for cleanup in caller.on_close:
                    cleanup()
        finally:
            self._closed = True
            await trio.aclose_forcefully(self.stream)

    async def _read_loop(self, nursery: trio.Nursery, caller: Caller) -> None:
        config = self.daemon.config
        splitter = rpc.LineSplitter(config.max_request_bytes)
        line_started: float | None = None
        idle_since = trio.current_time()
        while not self._closed:
            now = trio.current_time()
            if line_started is not None:
                deadline = line_started + config.line_timeout_s
            elif self._busy == 0 and not caller.on_close:
                deadline = idle_since + config.idle_timeout_s
            else:
                deadline = now + config.idle_timeout_s
            with trio.move_on_at(deadline) as scope:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
            if scope.cancelled_caught:
                if line_started is not None or (self._busy == 0 and not caller.on_close):
                    return  # a request that never ends, or an idle connection
                continue
            if not data:
                return
            idle_since = trio.current_time()
            try:
                lines = splitter.feed(data)
            except Refusal as refusal:
                await self.send(rpc.refusal_error(None, refusal))
                return
            line_started = (line_started or idle_since) if splitter.pending else None
            for line in lines:
                await self._dispatch(nursery, caller, line)

    async def _dispatch(self, nursery: trio.Nursery, caller: Caller, line: bytes) -> None:
        decoded = rpc.decode_call(line)
        if isinstance(decoded, rpc.Outcome):
            if decoded.reply is not None:
                await self.send(decoded.reply)
            return
        if decoded.spec.operator_only and self.actor != "operator":
            if not decoded.is_notification:
                await self.send(
                    rpc.refusal_error(
                        decoded.id,
                        Unauthorized(f"{decoded.spec.name} is an operator method"),
                    )
                )
            return
        await self._in_flight.acquire()
        self._busy += 1
        nursery.start_soon(self._run_call, caller, decoded)

    async def _run_call(self, caller: Caller, call: rpc.Call) -> None:
        try:
            # A shutdown lets a started write finish; shielded, its reply is sent too
            # (bounded by the send timeout), so a write that landed never looks lost.
            with trio.CancelScope(shield=call.spec.name in WRITES):
                reply = await self._invoke(caller, call)
                if not call.is_notification:
                    await self.send(reply)
        finally:
            self._busy -= 1
            self._in_flight.release()

    async def _invoke(self, caller: Caller, call: rpc.Call) -> bytes:
        handler = HANDLERS.get(call.spec.name)
        try:
            if handler is None:
                raise Internal(f"{call.spec.name} has no handler")
            result = await handler(self.daemon, caller, call.params)
            return rpc.reply_result(call.id, result)
        except Refusal as refusal:
            if call.spec.name in MUTATING:
                await self._journal_refusal(caller, call, refusal)
            return rpc.refusal_error(call.id, refusal)
        except Exception:
            log.exception("internal error in %s", call.spec.name)
            return rpc.refusal_error(call.id, Internal(f"internal error in {call.spec.name}"))

    async def _journal_refusal(self, caller: Caller, call: rpc.Call, refusal: Refusal) -> None:
        params = call.params
        data: dict[str, Any] = {"method": call.spec.name, "refusal": refusal.name}
        path = getattr(params, "path", None)
        if isinstance(path, str) and len(path) <= 4096 and "\x00" not in path:
            data["path"] = path
        argv = getattr(params, "argv", None)
        if isinstance(argv, list):
            data["argv"] = argv[:64]
        workspace = getattr(params, "workspace", None)
        try:
            await trio.to_thread.run_sync(
                lambda: self.daemon.journal.append(
                    "refusal",
                    data,
                    workspace=workspace if isinstance(workspace, str) else None,
                    actor=caller.name,
                )
            )
        except Exception:
            log.exception("could not journal a refusal")
