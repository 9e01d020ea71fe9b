"""The Unix-socket JSON-RPC server: the I/O edge around `substrate.protocol.rpc` (SPEC §1).

One task reads a connection, splitting lines and starting one task per request (at most
`max_in_flight` at a time: past that the reader waits, which is the backpressure). All
replies and notifications go through one send lock. Deadlines: a started line must end
within `line_timeout_s`; a connection with nothing in flight closes after
`idle_timeout_s`; a send that cannot progress for `send_timeout_s` closes the connection.
Caps: `max_connections` per socket, `max_connections_per_uid` per peer uid and socket;
past either, one `limit_exceeded` error and the connection closes.

End of input: a peer that only shut its writing side (`shutdown(SHUT_WR)`) still gets
every reply (and subscription) it asked for, then the connection closes; a peer that
closed entirely has its calls cancelled (shielded writes still finish).

The connection task is where anything unexpected stops: it is logged, journaled as
`internal` (exception type names only, never data), answered with one `internal` error
when the connection can still take it, and the connection closes. Nothing a client sends
can end the daemon.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from substrate.api import HANDLERS
from substrate.api.base import Actor, Caller
from substrate.config import Config
from substrate.errors import Internal, LimitExceeded, Refusal, Unauthorized
from substrate.protocol import rpc

if TYPE_CHECKING:
    from substrate.daemon import Daemon

log = logging.getLogger("substrate.protocol.server")

SEND_TIMEOUT_S = 30.0
#: After a half-close, how often to look whether the peer has gone entirely, seconds.
PEER_CHECK_S = 1.0
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
    """The live connections of one socket, in total and per peer uid."""

    def __init__(self) -> None:
        self.count = 0
        self.by_uid: dict[int, int] = {}

    def admit(self, uid: int, config: Config) -> LimitExceeded | None:
        """Count a new connection of `uid`, or say which cap it would pass."""
        if self.count >= config.max_connections:
            return LimitExceeded(
                "too many connections", limit=config.max_connections, scope="socket"
            )
        held = self.by_uid.get(uid, 0)
        if held >= config.max_connections_per_uid:
            return LimitExceeded(
                f"too many connections from uid {uid}",
                limit=config.max_connections_per_uid,
                scope="uid",
            )
        self.count += 1
        self.by_uid[uid] = held + 1
        return None

    def release(self, uid: int) -> None:
        self.count -= 1
        left = self.by_uid[uid] - 1
        if left:
            self.by_uid[uid] = left
        else:
            del self.by_uid[uid]


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
        self.uid: int | None = None
        self._send_lock = trio.Lock()
        self._in_flight = trio.Semaphore(daemon.config.max_in_flight)
        self._busy = 0
        self._quiet = trio.Event()  # set when the last call in flight ends
        self._closed = False

    @property
    def actor_name(self) -> str:
        """The journal's `actor` string (the uid once known)."""
        return f"{self.actor}:{'?' if self.uid is None else self.uid}"

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
        """Serve the connection until it ends; never raises anything but cancellation."""
        try:
            await self._serve()
        except* Exception as group:
            log.error("connection %s failed", self.id, exc_info=group)
            await self._journal_internal("connection", None, group)
            await self.send(rpc.refusal_error(None, Internal("internal error; closing")))
        finally:
            self._closed = True
            await trio.aclose_forcefully(self.stream)

    async def _serve(self) -> None:
        config = self.daemon.config
        uid = peer_uid(self.stream.socket)
        self.uid = uid
        if uid not in config.effective_uids():
            await self.send(rpc.refusal_error(None, Unauthorized("peer uid is not allowed")))
            return
        refused = self.live.admit(uid, config)
        if refused is not None:
            await self.send(rpc.refusal_error(None, refused))
            return
        caller = Caller(actor=self.actor, uid=uid, connection=self.id, notify=self.notify)
        try:
            async with trio.open_nursery() as nursery:
                ended_by_peer = await self._read_loop(nursery, caller)
                if ended_by_peer:
                    await self._finish_after_eof(caller)
                nursery.cancel_scope.cancel()
        finally:
            self.live.release(uid)
            for cleanup in caller.on_close:
                cleanup()

    async def _read_loop(self, nursery: trio.Nursery, caller: Caller) -> bool:
        """Read and dispatch lines; True when the peer ended its input (EOF)."""
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
                    return False
            if scope.cancelled_caught:
                if line_started is not None or (self._busy == 0 and not caller.on_close):
                    return False  # a request that never ends, or an idle connection
                continue
            if not data:
                # A last line without its newline is still a line.
                for line in splitter.finish():
                    await self._dispatch(nursery, caller, line)
                return True
            idle_since = trio.current_time()
            try:
                lines = splitter.feed(data)
            except Refusal as refusal:
                await self.send(rpc.refusal_error(None, refusal))
                return False
            line_started = (line_started or idle_since) if splitter.pending else None
            for line in lines:
                await self._dispatch(nursery, caller, line)
        return False

    def _peer_gone(self) -> bool:
        """After EOF: has the peer closed entirely (POLLHUP), not just shut its writing side?"""
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN)
        return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))

    async def _finish_after_eof(self, caller: Caller) -> None:
        """Half-closed: let calls in flight and subscriptions finish (their output is sent)."""
        while (self._busy or caller.on_close) and not self._closed:
            if self._peer_gone():
                return
            self._quiet = trio.Event()
            with trio.move_on_after(PEER_CHECK_S):
                await self._quiet.wait()

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
            if self._busy == 0:
                self._quiet.set()

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
        except Exception as exc:
            log.exception("internal error in %s", call.spec.name)
            await self._journal_internal("call", call.spec.name, exc)
            return rpc.refusal_error(call.id, Internal(f"internal error in {call.spec.name}"))

    async def _journal_internal(self, where: str, method: str | None, exc: BaseException) -> None:
        """Journal an unexpected error: where, the method, exception type names; no data."""
        data: dict[str, Any] = {"where": where, "errors": _type_names(exc)}
        if method is not None:
            data["method"] = method
        try:
            await trio.to_thread.run_sync(
                lambda: self.daemon.journal.append("internal", data, actor=self.actor_name)
            )
        except Exception:
            log.exception("could not journal an internal error")

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


def _type_names(exc: BaseException, limit: int = 8) -> list[str]:
    """The type names of the leaf exceptions of `exc` (a group is flattened), at most `limit`."""
    names: list[str] = []
    stack = [exc]
    while stack and len(names) < limit:
        item = stack.pop()
        if isinstance(item, BaseExceptionGroup):
            stack.extend(reversed(item.exceptions))
        else:
            names.append(type(item).__name__)
    return names
