"""The Unix-socket JSON-RPC server: the I/O edge around `substrate.protocol.rpc` (docs/protocol.md §1).

One task reads a connection, splitting lines and starting one task per request or
notification (at most `max_in_flight` at a time: past that the reader waits, which is the
backpressure), and handling at most `LINES_PER_TURN` lines before it lets other tasks
run. All replies and notifications go through one send lock, and are counted from when
they are made until they are sent: while a connection's unsent bytes are over
`max_unsent_bytes` (or its uid's, on this socket, over `max_unsent_bytes_per_uid`) the
reader stops and the next reply waits before it is even encoded, so a client that does
not read holds at most a budget and one reply of the daemon's memory. Time the reader
spends stopped by these choices is not held against the client's deadlines.
Deadlines: a started line must end within `line_timeout_s`; a connection with nothing
in flight closes after `idle_timeout_s`; a send that cannot progress for
`SEND_TIMEOUT_S` closes the connection. Caps: `max_connections` per socket,
`max_connections_per_uid` per peer uid and socket; past either, one `limit_exceeded`
error and the connection closes.

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
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from substrate.errors import Internal, Refusal, StartupError
from substrate.metrics import METRICS
from substrate.protocol import rpc
from substrate.protocol.caller import Actor, Caller
from substrate.protocol.connection import (
    Admission,
    ConnectionState,
    Limits,
    UnsentBytes,
    call_refusal,
)
from substrate.schema.journal import argv_summary

log = logging.getLogger("substrate.protocol.server")

SEND_TIMEOUT_S = 30.0
#: After a half-close, how often to look whether the peer has gone entirely, seconds.
PEER_CHECK_S = 1.0
#: The most bytes one read takes from a socket.
RECEIVE_BYTES = 65536
#: The most lines a reader handles before other tasks get a turn: one connection's share
#: of the event loop is bounded whatever its lines are (calls, refusals, notifications).
LINES_PER_TURN = 16
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


class Outbox:
    """One socket's unsent reply bytes per peer uid (`UnsentBytes`), and the wake-up of
    the readers and replies of that uid waiting for them to go down."""

    def __init__(self, config: Limits) -> None:
        self.unsent = UnsentBytes(config)
        self._changed: dict[int, trio.Event] = {}

    def add(self, uid: int, n: int) -> None:
        self.unsent.add(uid, n)

    def remove(self, uid: int, n: int) -> None:
        self.unsent.remove(uid, n)
        self.wake(uid)

    def wake(self, uid: int) -> None:
        """Let every waiter of `uid` look again."""
        event = self._changed.pop(uid, None)
        if event is not None:
            event.set()

    async def changed(self, uid: int) -> None:
        """Wait until bytes of `uid` are sent or one of its connections closes."""
        event = self._changed.get(uid)
        if event is None:
            event = self._changed[uid] = trio.Event()
        await event.wait()


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
    outbox = Outbox(backend.config)

    async def handle(stream: trio.SocketStream) -> None:
        conn = Connection(backend, stream, actor, admission, outbox)
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
        self,
        backend: Backend,
        stream: trio.SocketStream,
        actor: Actor,
        admission: Admission,
        outbox: Outbox,
    ) -> None:
        self.backend = backend
        self.stream = stream
        self.actor = actor
        self.admission = admission
        self.outbox = outbox
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
        """Send one message whole; its bytes count as unsent until it went (or the
        connection closed). Callers making a reply wait for `_room` first."""
        if self._closed:
            return
        uid, n = self.uid, len(data)
        self.state.queued(n)
        if uid is not None:
            self.outbox.add(uid, n)
        try:
            await self._send_locked(data)
        finally:
            self.state.dequeued(n)
            if uid is not None:
                self.outbox.remove(uid, n)

    async def _send_locked(self, data: bytes) -> None:
        try:
            # Free in the common case: taken without a scheduling round (send_all has its own).
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            if self._closed:
                return
            sent = self._send_now(data)
            if sent is None or sent == len(data):
                return
            with trio.move_on_after(SEND_TIMEOUT_S) as scope:
                try:
                    await self.stream.send_all(memoryview(data)[sent:])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._close()
            if scope.cancelled_caught:
                # The peer stopped reading: drop it rather than hold memory for it.
                self._close()
                await trio.aclose_forcefully(self.stream)
        finally:
            self._send_lock.release()

    def _send_now(self, data: bytes) -> int | None:
        """What of `data` the socket takes at once (non-blocking), None when the peer is
        gone (then the connection closes). A reply that fits the socket's buffer, the
        common case, goes without `send_all`'s scheduling round (tens of microseconds
        of a small call's round trip); the rest is left to it. Holding the send lock."""
        try:
            return os.write(self.stream.socket.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError:
            self._close()
            return None

    def _close(self) -> None:
        """No more sends: replies waiting for room (on any connection of the uid) look again."""
        self._closed = True
        if self.uid is not None:
            self.outbox.wake(self.uid)

    def _over_budget(self) -> bool:
        uid = self.uid
        return (
            not self._closed
            and uid is not None
            and self.outbox.unsent.over(uid, self.state.unsent_bytes)
        )

    async def _room(self) -> None:
        """Wait while this connection's unsent bytes, or its uid's on this socket, are
        over budget (until bytes are sent or the connection closes)."""
        while self._over_budget():
            assert self.uid is not None
            await self.outbox.changed(self.uid)

    async def _not_reading(self, wait: Coroutine[Any, Any, None]) -> None:
        """Await `wait`, the reader stopped by the daemon's choice: the client's
        deadlines do not run meanwhile."""
        self.state.pause(trio.current_time())
        try:
            await wait
        finally:
            self.state.resume(trio.current_time())

    async def notify(self, method: str, params: Any) -> None:
        await self._room()
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
            self._close()
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
                await self._dispatch_all(nursery, caller, state.end_of_input())
                return True
            try:
                lines = state.received(data, trio.current_time())
            except Refusal as refusal:
                self._log_refusal("(line)", refusal.name)
                await self.send(rpc.refusal_error(None, refusal))
                return False
            await self._dispatch_all(nursery, caller, lines)
        return False

    async def _dispatch_all(
        self, nursery: trio.Nursery, caller: Caller, lines: list[bytes]
    ) -> None:
        """Dispatch `lines` in order, letting other tasks run every `LINES_PER_TURN`."""
        for n, line in enumerate(lines, 1):
            await self._dispatch(nursery, caller, line)
            if n % LINES_PER_TURN == 0:
                await trio.lowlevel.checkpoint()

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
        if self._over_budget():
            await self._not_reading(self._room())
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
            # The cap reached: the reader waits.
            await self._not_reading(self._in_flight.acquire())
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
            await self._room()  # before encoding: a reply waiting holds no bytes of its own
            await self.send(reply())

    async def _invoke(self, caller: Caller, call: rpc.Call) -> Callable[[], bytes]:
        """Run the call; what encodes its reply."""
        try:
            result = await self.backend.dispatch(call.spec.name, caller, call.params)
            return lambda: rpc.reply_result(call.id, result)
        except Refusal as refusal:
            self._log_refusal(call.spec.name, refusal.name)
            if call.spec.mutating:
                await self._journal_refusal(caller, call, refusal)
            refused = refusal  # `refusal` is unbound once the except block ends
            return lambda: rpc.refusal_error(call.id, refused)
        except Exception as exc:
            log.exception("internal error in %s", call.spec.name)
            await self._journal_internal("call", call.spec.name, exc)
            internal = Internal(f"internal error in {call.spec.name}")
            return lambda: rpc.refusal_error(call.id, internal)

    def _log_refusal(self, method: str, refusal: str) -> None:
        """One debug line per refusal: the method (or what was refused when no method
        was decoded), the refusal's name, socket and connection; never params or bytes."""
        log.debug("refused %s: %s (%s socket, connection %s)", method, refusal, self.actor, self.id)
        METRICS.refused(refusal)

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
