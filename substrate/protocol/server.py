"""The Unix-socket JSON-RPC server: the I/O edge around `substrate.protocol.rpc` (docs/protocol.md §1).

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

The deadline, idle and cap rules live sans-IO in `substrate.protocol.connection`; this
module is the Trio loop that feeds them. The server knows nothing of handlers or the
daemon: it is given a `Backend` (the config, a dispatcher, the journal's append).

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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from substrate.errors import Internal, Refusal, StartupError
from substrate.protocol import rpc
from substrate.protocol.caller import Actor, Caller
from substrate.protocol.connection import Admission, ConnectionState, Limits, call_refusal
from substrate.schema.journal import argv_summary

log = logging.getLogger("substrate.protocol.server")

SEND_TIMEOUT_S = 30.0
#: After a half-close, how often to look whether the peer has gone entirely, seconds.
PEER_CHECK_S = 1.0
#: The most bytes one read takes from a socket.
RECEIVE_BYTES = 65536
_connection_ids = itertools.count(1)

#: Runs one validated call: (method name, caller, params Struct) → the result to send.
#: Raises a `Refusal` to answer with it; anything else is answered `internal`.
Dispatcher = Callable[[str, Caller, Any], Awaitable[Any]]


class Recorder(Protocol):
    """Appends one journal entry, durably; blocking (the server calls it in a thread)."""

    def __call__(
        self,
        kind: str,
        data: Mapping[str, Any],
        *,
        workspace: str | None = ...,
        actor: str = ...,
    ) -> object: ...


@dataclass(frozen=True)
class Backend:
    """What the server needs from the daemon behind it."""

    config: Limits
    dispatch: Dispatcher
    #: Journals refusals of mutating methods and internal errors (never their data).
    record: Recorder


def bind_unix(path: Path, mode: int) -> socket.socket:
    """Bind a listening Unix socket at `path`, never through a pre-planted symlink.

    A stale socket from a previous run is replaced; anything else at the path (a symlink,
    a file) is refused with `StartupError`.
    """
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


async def serve_socket(
    backend: Backend,
    path: Path,
    mode: int,
    actor: Actor,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one socket until cancelled; the socket file is removed on the way out."""
    raw = bind_unix(path, mode)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
    admission = Admission(backend.config)

    async def handle(stream: trio.SocketStream) -> None:
        conn = Connection(backend, stream, actor, admission)
        await conn.run()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handle, [listener])
            task_status.started()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Connection:
    """One client connection on one socket: the Trio loop around a `ConnectionState`."""

    def __init__(
        self, backend: Backend, stream: trio.SocketStream, actor: Actor, admission: Admission
    ) -> None:
        self.backend = backend
        self.stream = stream
        self.actor = actor
        self.admission = admission
        self.id = next(_connection_ids)
        self.uid: int | None = None
        self.state = ConnectionState(backend.config, trio.current_time())
        self._send_lock = trio.Lock()
        self._in_flight = trio.Semaphore(backend.config.max_in_flight)
        self._quiet = trio.Event()  # set when the last call in flight ends
        #: The read in progress, whose deadline moves when a call finishes.
        self._receive_scope: trio.CancelScope | None = None
        self._caller: Caller | None = None
        self._closed = False

    @property
    def actor_name(self) -> str:
        """The journal's `actor` string (the uid once known)."""
        return f"{self.actor}:{'?' if self.uid is None else self.uid}"

    def _held(self) -> bool:
        """Subscriptions hold the connection open (their cleanups are registered)."""
        return self._caller is not None and bool(self._caller.on_close)

    async def send(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            # Free in the common case: taken without a scheduling round (send_all has its own).
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            with trio.move_on_after(SEND_TIMEOUT_S) as scope:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._closed = True
            if scope.cancelled_caught:
                # The peer stopped reading: drop it rather than hold memory for it.
                self._closed = True
                await trio.aclose_forcefully(self.stream)
        finally:
            self._send_lock.release()

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
        uid = peer_uid(self.stream.socket)
        self.uid = uid
        refused = self.admission.admit(uid)
        if refused is not None:
            self._log_refusal("(connection)", refused.name)
            await self.send(rpc.refusal_error(None, refused))
            return
        caller = Caller(actor=self.actor, uid=uid, connection=self.id, notify=self.notify)
        self._caller = caller
        try:
            async with trio.open_nursery() as nursery:
                ended_by_peer = await self._read_loop(nursery, caller)
                if ended_by_peer:
                    await self._finish_after_eof()
                nursery.cancel_scope.cancel()
        finally:
            self.admission.release(uid)
            for cleanup in caller.on_close:
                cleanup()

    async def _read_loop(self, nursery: trio.Nursery, caller: Caller) -> bool:
        """Read and dispatch lines; True when the peer ended its input (EOF)."""
        state = self.state
        while not self._closed:
            deadline = state.deadline(trio.current_time(), held=self._held())
            with trio.CancelScope(deadline=deadline) as scope:
                self._receive_scope = scope
                try:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return False
                finally:
                    self._receive_scope = None
            if scope.cancelled_caught:
                if state.expired(trio.current_time(), held=self._held()):
                    return False  # a request that never ends, or an idle connection
                continue
            if not data:
                # A last line without its newline is still a line.
                for line in state.end_of_input():
                    await self._dispatch(nursery, caller, line)
                return True
            try:
                lines = state.received(data, trio.current_time())
            except Refusal as refusal:
                self._log_refusal("(line)", refusal.name)
                await self.send(rpc.refusal_error(None, refusal))
                return False
            for line in lines:
                await self._dispatch(nursery, caller, line)
        return False

    def _peer_gone(self) -> bool:
        """After EOF: has the peer closed entirely (POLLHUP), not just shut its writing side?"""
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN)
        return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))

    async def _finish_after_eof(self) -> None:
        """Half-closed: let calls in flight and subscriptions finish (their output is sent)."""
        while not self.state.drained(held=self._held()) and not self._closed:
            if self._peer_gone():
                return
            self._quiet = trio.Event()
            with trio.move_on_after(PEER_CHECK_S):
                await self._quiet.wait()

    async def _dispatch(self, nursery: trio.Nursery, caller: Caller, line: bytes) -> None:
        decoded = rpc.decode_call(line)
        if isinstance(decoded, rpc.Outcome):
            self._log_refusal(decoded.method or "(request)", decoded.refusal)
            if decoded.reply is not None:
                await self.send(decoded.reply)
            return
        refused = call_refusal(decoded.spec, self.actor)
        if refused is not None:
            self._log_refusal(decoded.spec.name, refused.name)
            if not decoded.is_notification:
                await self.send(rpc.refusal_error(decoded.id, refused))
            return
        try:
            self._in_flight.acquire_nowait()  # a scheduling round saved per request
        except trio.WouldBlock:
            await self._in_flight.acquire()  # the cap reached: the reader waits
        self.state.call_started()
        nursery.start_soon(self._run_call, caller, decoded)

    async def _run_call(self, caller: Caller, call: rpc.Call) -> None:
        try:
            # A shutdown lets a started change finish; shielded, its reply is sent too
            # (bounded by the send timeout), so a write that landed never looks lost.
            # (A scope costs microseconds: only a shielded call gets one.)
            if call.spec.shielded:
                with trio.CancelScope(shield=True):
                    await self._answer(caller, call)
            else:
                await self._answer(caller, call)
        finally:
            now = trio.current_time()
            self.state.call_finished(now)
            self._in_flight.release()
            if self._receive_scope is not None:
                self._receive_scope.deadline = self.state.deadline(now, held=self._held())
            if not self.state.in_flight:
                self._quiet.set()

    async def _answer(self, caller: Caller, call: rpc.Call) -> None:
        reply = await self._invoke(caller, call)
        if not call.is_notification:
            await self.send(reply)

    async def _invoke(self, caller: Caller, call: rpc.Call) -> bytes:
        try:
            result = await self.backend.dispatch(call.spec.name, caller, call.params)
            return rpc.reply_result(call.id, result)
        except Refusal as refusal:
            self._log_refusal(call.spec.name, refusal.name)
            if call.spec.mutating:
                await self._journal_refusal(caller, call, refusal)
            return rpc.refusal_error(call.id, refusal)
        except Exception as exc:
            log.exception("internal error in %s", call.spec.name)
            await self._journal_internal("call", call.spec.name, exc)
            return rpc.refusal_error(call.id, Internal(f"internal error in {call.spec.name}"))

    def _log_refusal(self, method: str, refusal: str) -> None:
        """One debug line per refusal: the method (or what was refused when no method
        was decoded), the refusal's name, socket and connection; never params or bytes."""
        log.debug("refused %s: %s (%s socket, connection %s)", method, refusal, self.actor, self.id)

    async def _journal_internal(self, where: str, method: str | None, exc: BaseException) -> None:
        """Journal an unexpected error: where, the method, exception type names; no data."""
        data: dict[str, Any] = {"where": where, "errors": _type_names(exc)}
        if method is not None:
            data["method"] = method
        try:
            await trio.to_thread.run_sync(
                lambda: self.backend.record("internal", data, actor=self.actor_name)
            )
        except Exception:
            log.exception("could not journal an internal error")

    async def _journal_refusal(self, caller: Caller, call: rpc.Call, refusal: Refusal) -> None:
        data, workspace = refusal_record(call, refusal)
        try:
            await trio.to_thread.run_sync(
                lambda: self.backend.record("refusal", data, workspace=workspace, actor=caller.name)
            )
        except Exception:
            log.exception("could not journal a refusal")


def refusal_record(call: rpc.Call, refusal: Refusal) -> tuple[dict[str, Any], str | None]:
    """The journal data of a refused mutating call, and its workspace: the method, the
    refusal's name, the path when sane, and an argv only as its summary (never file bytes
    or argv text)."""
    params = call.params
    data: dict[str, Any] = {"method": call.spec.name, "refusal": refusal.name}
    path = getattr(params, "path", None)
    if isinstance(path, str) and len(path) <= 4096 and "\x00" not in path:
        data["path"] = path
    argv = getattr(params, "argv", None)
    if isinstance(argv, list):
        data.update(argv_summary(argv))
    workspace = getattr(params, "workspace", None)
    return data, workspace if isinstance(workspace, str) else None


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
