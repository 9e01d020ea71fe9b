"""The daemon's side of one running supervisor: held children, and the commands they become.

`Link` is a started, authenticated supervisor (its host pid, a pidfd on it, the control
connection it opened to the daemon). `Link.fork` asks it to fork a *held child* (a
`Spawned`: forked, not exec'd, waiting on its own channel); `Link.forked` receives the
child's pid and a pidfd on it; `Link.check` reads the child from the host (`checks`)
just before it is used. `Spawned.go` hands it argv and its stdio (descriptors) and lets
it exec; `Spawned.wait_exit` waits for the supervisor's report of its end. `Link.spawn`
is the three in a row (a held child on demand).

Each command gets its own channel: a socketpair whose other end travels with the fork
request, so replies never need demultiplexing and a command's end closes only its own
channel. Every wait is bounded by the caller; a supervisor that does not answer within
`REPLY_S` counts as lost. Sends are tried at once without yielding to the event loop
(the frames are small; only a full socket buffer waits), which keeps the hot path to
the few loop wake-ups it needs.

Costs per command: one socketpair, a fork request with one descriptor, `go` with three,
two small replies, the host reads of `checks` (about 0.1 ms).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from substrate.sandbox.facts import Fact, Mismatch
from substrate.sandbox.supervisor import agent, checks

log = logging.getLogger("substrate.sandbox.supervisor")

#: A supervisor answers a spawn (fork + pidfd) within this, or it counts as lost.
REPLY_S = 5.0


class LinkBroken(Exception):
    """The supervisor did not answer as the wire says (gone, silent, or garbled).
    `reason` is a stable word for the journal."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Spawned:
    """A command the supervisor forked and holds until `go` (or that it could not fork).

    `failed`: the supervisor's errno when it could not fork (nothing ran; no process).
    `mismatches`: per-command facts that did not meet the sandbox's (then nothing may
    run: the caller aborts it and treats the supervisor as tampered)."""

    chan: trio.socket.SocketType
    pid: int = 0  # inside the sandbox's pid namespace
    host_pid: int = 0
    pidfd: int = -1
    facts: list[Fact] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    failed: int | None = None
    generation: int = 0  # of the supervisor that forked it
    #: The command cgroup it was moved into ahead, while held (`supervisors.Reserve`):
    #: the command that takes it need not move it (docs/fast-exec.md "Held children").
    entered: Path | None = None
    decoder: agent.Decoder = field(default_factory=lambda: agent.Decoder(agent.MAX_REPORT))
    pending: list[dict[str, Any]] = field(default_factory=list)

    async def go(
        self, argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int]
    ) -> None:
        """Hand the held child `argv`, `env`, `cwd` and `stdio` (stdin, stdout, stderr;
        the caller keeps and closes its copies) and let it exec. Raises LinkBroken when
        the channel is gone (nothing ran)."""
        frame = agent.encode({"op": "go", "argv": argv, "env": env, "cwd": cwd}, 3)
        try:
            await send_frame(self.chan, frame, stdio)
        except OSError:
            raise LinkBroken("closed") from None

    async def abort(self) -> None:
        """The child exits without exec'ing (best effort; closing the channel does too)."""
        with contextlib.suppress(OSError):
            await send_frame(self.chan, agent.encode({"op": "abort"}))

    async def wait_exit(self) -> tuple[int | None, int | None]:
        """(exit code, exec errno) once the supervisor reaped the command; (None, None)
        when the channel closed first (the supervisor died: its code is lost). Unbounded:
        the caller bounds it (the command's deadline)."""
        try:
            message = await receive(self.chan, self.decoder, self.pending)
        except (OSError, LinkBroken, trio.ClosedResourceError):
            return None, None
        for fd in message.pop("_fds", []):
            os.close(fd)
        if message.get("op") != "exited":
            return None, None
        code, err = message.get("code"), message.get("errno")
        return (
            code if isinstance(code, int) else None,
            err if isinstance(err, int) and err > 0 else None,
        )

    def exited(self) -> bool:
        """Has the command's main process ended (its pidfd is readable)? Non-blocking.
        `poll`, not `select`: a daemon holding many sandboxes has descriptors past
        `FD_SETSIZE` (1,024), which `select` refuses."""
        if self.pidfd < 0:
            return True
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    async def wait_gone(self) -> None:
        """Return once the command's main process has ended (its pidfd; no polling)."""
        if self.pidfd >= 0:
            await trio.lowlevel.wait_readable(self.pidfd)

    def kill(self) -> None:
        """SIGKILL the command's main process (through its pidfd: never another process)."""
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        self.chan.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.decoder.close_pending()


@dataclass
class Link:
    """One started supervisor, authenticated by its host pid and the start's secret."""

    container: str
    generation: int
    pid: int  # host pid
    pidfd: int
    control: trio.socket.SocketType
    base: checks.Baseline
    uid: int
    started: float  # trio clock
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    broken: str | None = None  # why it is not to be used any more (journal word)

    def problem(self) -> str | None:
        """Why this supervisor cannot be used now, or None ("exited" or a word of
        `checks.supervisor_problem`). Blocking but tiny (a signal to its pidfd, one stat,
        one procfs read): called on the event loop. A zombie counts as exited."""
        if self.broken is not None:
            return self.broken
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
            status, owner = checks.read_status(self.pid)
        except ProcessLookupError:
            return "exited"
        return checks.supervisor_problem(status, owner, self.uid)

    async def spawn(self) -> Spawned:
        """A held child on demand: `fork`, `forked`, `check`. Raises LinkBroken."""
        spawned = await self.fork()
        try:
            await self.forked(spawned)
            if spawned.failed is None:
                self.check(spawned)
        except BaseException:
            spawned.kill()  # held, never ran (a stopped one would hold a task)
            spawned.close()
            raise
        return spawned

    async def fork(self) -> Spawned:
        """Ask for a held child; returns it before the supervisor answered (`forked`
        reads the answer). Raises LinkBroken when the request cannot be sent."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spawned = Spawned(chan=trio.socket.from_stdlib_socket(ours), generation=self.generation)
        frame = agent.encode({"op": "fork"}, 1)
        try:
            with trio.fail_after(REPLY_S):
                try:
                    self.send_lock.acquire_nowait()  # free, as a rule: no trip through the loop
                except trio.WouldBlock:
                    await self.send_lock.acquire()
                try:
                    await send_frame(self.control, frame, [theirs.fileno()])
                finally:
                    self.send_lock.release()
        except (OSError, trio.TooSlowError, trio.ClosedResourceError):
            spawned.close()
            raise LinkBroken("control") from None
        except BaseException:
            spawned.close()
            raise
        finally:
            theirs.close()
        return spawned

    async def forked(self, spawned: Spawned) -> None:
        """Receive the held child's `forked` (its pid, a pidfd on it; its host pid from
        the pidfd), or `failed` (`Spawned.failed`). Raises LinkBroken: "unresponsive",
        "closed", "protocol", "child-gone"."""
        try:
            with trio.fail_after(REPLY_S):
                message = await receive(spawned.chan, spawned.decoder, spawned.pending, fds=1)
        except trio.TooSlowError:
            raise LinkBroken("unresponsive") from None
        except (OSError, trio.ClosedResourceError):
            raise LinkBroken("closed") from None
        op = message.get("op")
        if op == "failed":
            err = message.get("errno")
            spawned.failed = err if isinstance(err, int) and err > 0 else 22
            return
        fds = message.pop("_fds", [])
        pid = message.get("pid")
        if op != "forked" or len(fds) != 1 or not isinstance(pid, int):
            for fd in fds:
                os.close(fd)
            raise LinkBroken("protocol")
        spawned.pid, spawned.pidfd = pid, fds[0]
        host_pid = checks.pidfd_pid(spawned.pidfd)
        if host_pid is None:
            raise LinkBroken("child-gone")
        spawned.host_pid = host_pid

    def check(
        self, spawned: Spawned, leaf: str | None = None, reading: checks.Reading | None = None
    ) -> None:
        """Check the held child from the host (`facts`, `mismatches`). Blocking but small
        (procfs, about 0.1 ms; with `reading`, one small read): called on the event loop.
        `leaf`: the name of the command cgroup the daemon moved it into ahead
        (`checks.same_cgroup`). `reading`: the child as read once it was moved there
        (`ahead.enter_soon`), taken while it lived; else it is read now. An earlier
        reading stands because nothing it holds can change while the child is held: it
        runs only the supervisor's code, waiting on its channel, without capabilities and
        non-dumpable (no process of its uid may ptrace it or take its descriptors), so
        its ids, capabilities, seccomp mode, no_new_privs and namespaces change only if
        it changed them itself; its cgroup only by root (the daemon moved it, then read
        it); its parent only if the supervisor died (`_ready` saw it serving). Only a
        signal from its sandbox can reach it: its state (stopped) is read now.
        Raises LinkBroken ("child-gone") when it is gone (a reading taken after that
        may not be its own) or stopped (it would never exec)."""
        try:
            if reading is None:
                reading = checks.read_process(spawned.host_pid)
                state = checks.status_state(reading.status)
            else:
                state = checks.read_state(spawned.host_pid)
        except ProcessLookupError:
            raise LinkBroken("child-gone") from None
        if spawned.exited():  # read after it was gone: the reading may not be its own
            raise LinkBroken("child-gone")
        if checks.held_state_problem(state):  # stopped (or dying) by its sandbox
            raise LinkBroken("child-gone")
        spawned.facts = checks.command_facts(
            reading, self.base, supervisor_pid=self.pid, reported_pid=spawned.pid, leaf=leaf
        )
        spawned.mismatches = checks.mismatches(spawned.facts, self.base)

    def kill(self) -> None:
        """SIGKILL the supervisor (through its pidfd: never another process)."""
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        """Close the connection and the pidfd (idempotent)."""
        self.control.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _view(sock: trio.socket.SocketType) -> socket.socket:
    """A stdlib view of `sock`'s descriptor (AF_UNIX stream, as every socket here), for
    calls that must not yield to the event loop when they can complete at once; the
    caller detaches it (never closes it). Raises ClosedResourceError once closed."""
    fd = sock.fileno()
    if fd < 0:
        raise trio.ClosedResourceError
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)


async def send_frame(sock: trio.socket.SocketType, frame: bytes, fds: Sequence[int] = ()) -> None:
    """Send one frame (its descriptors with its first byte). Tried at once, without a
    trip through the event loop; waits only while the socket's buffer is full. Raises
    OSError (ClosedResourceError once `sock` is closed). Callers sharing `sock` hold a
    lock across the call."""
    raw = _view(sock)
    try:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        view = memoryview(frame)
        while True:
            try:
                sent = raw.sendmsg([view], ancillary if fds else [], socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
        view = view[sent:]
        while view:
            try:
                view = view[raw.send(view, socket.MSG_DONTWAIT) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
    finally:
        raw.detach()


async def receive(
    chan: trio.socket.SocketType,
    decoder: agent.Decoder,
    pending: list[dict[str, Any]],
    *,
    fds: int = 0,
) -> dict[str, Any]:
    """The next message on a channel (its descriptors under "_fds"). Read at once when it
    is there (no trip through the event loop), else once the channel is readable.
    Raises OSError on end of stream (ClosedResourceError once `chan` is closed),
    LinkBroken on a garbled one."""
    space = socket.CMSG_SPACE(agent.MAX_FDS * 4) if fds else 0
    while not pending:
        raw = _view(chan)
        try:
            data, ancdata, flags, _ = raw.recvmsg(
                1 << 16, space, socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT
            )
        except BlockingIOError:
            await trio.lowlevel.wait_readable(chan)
            continue
        finally:
            raw.detach()
        got: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                got.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        try:
            if flags & socket.MSG_CTRUNC:
                raise agent.ProtocolError("descriptors cut off")
            frames = decoder.feed(data, got)
        except agent.ProtocolError:
            for fd in got:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise LinkBroken("protocol") from None
        for message, received in frames:
            message["_fds"] = received
            pending.append(message)
        if not data:
            raise OSError("end of stream")
    return pending.pop(0)
