"""Starting a command: through the sandbox's supervisor when it can, else the engine's exec.

`Launcher.create` prepares one command and `Launcher.start` starts it, returning the
`ExecChannel` the driver drives (`substrate.process.channels`). The runner calls
`create` while it commits the command's record, so the two overlap.

Fast path (docs/fast-exec.md), for a sandbox whose processes are host processes (runc)
and whose supervisor is up: `create` takes a held child (forked ahead by the sandbox's
supervisor, or now), checked from the host just now (`substrate.sandbox.supervisor`),
moves it into the command's own cgroup (`substrate.sandbox.cmd_cgroups`: everything it
will fork is born there, whatever it sets in its environment), makes the command's
three pipes; `start` hands the child argv and the sandbox's pipe
ends, lets it exec, and asks the supervisor for the next held child (its answer is
settled by `FastChannel.quiesce`, before the run looks for its processes).
The `FastChannel` reads stdout and stderr from the pipes straight into the command's
sinks (on the event loop while small), writes stdin to its pipe, knows the main process
by its pidfd from the start, and takes the exit code from the supervisor's report.

Fallback: whenever the supervisor cannot be used for this command (no python3 in the
image, `fast_exec = false`, a supervisor that was lost, is being replaced, or whose
restarts are exhausted), the same command goes through the engine (`EngineChannel`);
nothing ran before. A confinement mismatch is not a fallback: it is `confinement_unmet`.

This module is the process layer's use of fast exec; the supervisor itself (its
directory, start, checks, held children, the program in the container) is
`substrate.sandbox.supervisor`, whose docstring is the map of both. It lives here, not
there, because it is built on process-layer types: `FastChannel` and `EngineChannel` are
`process.channels.ExecChannel`s, stdin goes through `process.stdin_stream`, and a failed
exec gets the shell's code from `process.argv`; the sandbox layer imports none of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import select
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from substrate.artifacts.sink import OutputSink
from substrate.process.argv import start_failure
from substrate.process.channels import EngineChannel, ExecChannel, Via
from substrate.process.stdin_stream import PipeStdin, StdinPipe, write_until_woken
from substrate.process.stream_exec import StreamChannel
from substrate.sandbox import cmd_cgroups
from substrate.sandbox.containers import Sandbox
from substrate.sandbox.engine import Engine
from substrate.sandbox.facts import Fact
from substrate.sandbox.supervisor.link import LinkBroken, Spawned
from substrate.sandbox.supervisor.stream_link import LinkBroken as StreamBroken
from substrate.sandbox.supervisor.stream_link import StreamLink
from substrate.sandbox.supervisor.supervisors import Pending, Supervisors

log = logging.getLogger("substrate.process.fastexec")

#: Bytes read from a pipe at a time.
RECV_BYTES = 1 << 18
#: A stream is read on the event loop up to this many bytes, then in a worker thread.
LOOP_PUMP_BYTES = 1 << 20
#: A stream supervisor answers a `run` within this (`started`), or is dropped.
STREAM_REPLY_S = 10.0
#: The command ended and its supervisor has not reported within this: is it still
#: serving? (Checked again every period while it is.)
REPORT_GRACE_S = 2.0


@dataclass(frozen=True)
class ExecSpec:
    """One command as the engine's exec would be asked for it."""

    container: str
    argv: tuple[str, ...]
    user: str
    workdir: str
    environment: dict[str, str]
    stdin: bool


@dataclass
class EnginePrepared:
    spec: ExecSpec
    exec_id: str


@dataclass
class FastPrepared:
    spec: ExecSpec
    sandbox: Sandbox
    spawned: Spawned
    stdin_w: int | None
    out_r: int
    err_r: int
    theirs: tuple[int, int, int]  # the command's stdin, stdout, stderr: sent with `go`

    def close(self) -> None:
        """Nothing will run: the held child exits when its channel closes."""
        self.spawned.close()
        self.close_theirs()
        _close([self.stdin_w, self.out_r, self.err_r])

    def close_theirs(self) -> None:
        _close(self.theirs)
        self.theirs = (-1, -1, -1)


@dataclass
class StreamPrepared:
    """A gVisor sandbox's command, to be asked of its stream supervisor at `start`."""

    spec: ExecSpec
    link: StreamLink


Prepared = EnginePrepared | FastPrepared | StreamPrepared


class Launcher:
    """Chooses the path of each command and starts it (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        supervisors: Supervisors | None = None,
        *,
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._engine = engine
        self._supervisors = supervisors
        self._fs_limiter = fs_limiter

    async def create(
        self,
        sandbox: Sandbox,
        argv: Sequence[str],
        *,
        user: str,
        workdir: str,
        environment: dict[str, str],
        stdin: bool,
        cgroup: cmd_cgroups.CommandCgroup | None = None,
    ) -> Prepared:
        """Prepare `argv` in `sandbox`: held by its supervisor (and moved into `cgroup`,
        the command's own, before it may exec), or an engine exec created (the driver
        moves that one in once it runs: `ExecDriver.drive`).

        Refuses `confinement_unmet` (the held child's facts), and what the engine's
        `exec_create` raises (`ContainerGone`, `runtime_unavailable`)."""
        spec = ExecSpec(sandbox.id, tuple(argv), user, workdir, environment, stdin)
        if self._supervisors is not None and sandbox.host_visible:
            fast = await self._spawn(sandbox, spec, cgroup)
            if fast is not None:
                return fast
        elif self._supervisors is not None:
            link = await self._supervisors.streams.ready(sandbox)
            if link is not None:
                return StreamPrepared(spec, link)
        return await self._engine_create(spec)

    def claim(self, sandbox: Sandbox) -> cmd_cgroups.CommandCgroup | None:
        """The cgroup (made, named for the next command's id: its `owner`) of the next
        command in `sandbox` when its supervisor's spare was moved ahead into it
        (docs/fast-exec.md "Held children"); None: the caller picks an id
        (`new_proc_id`) and makes its cgroup."""
        if self._supervisors is None or not sandbox.host_visible:
            return None
        return self._supervisors.claim(sandbox.id)

    async def start(self, prepared: Prepared) -> ExecChannel:
        """Start a prepared command; its channel. Raises what `exec_start` raises."""
        if isinstance(prepared, StreamPrepared):
            channel = await self._stream_start(prepared)
            if channel is not None:
                return channel
            prepared = await self._engine_create(prepared.spec)
        if isinstance(prepared, FastPrepared):
            spec = prepared.spec
            try:
                await prepared.spawned.go(
                    list(spec.argv), spec.environment, spec.workdir, prepared.theirs
                )
            except LinkBroken:
                # Gone between the check and the go: nothing ran; the engine runs it.
                prepared.close()
                await self._lost(prepared.sandbox, prepared.spawned)
                prepared = await self._engine_create(prepared.spec)
            else:
                prepared.close_theirs()  # the command has its own copies now
                assert self._supervisors is not None
                # The next command's held child is forked while this one runs
                # (docs/fast-exec.md "Held children"); settled by the channel's
                # `quiesce`. Shielded: the command runs, its channel must be returned.
                with trio.CancelScope(shield=True):
                    spare = await self._supervisors.prefork(
                        prepared.sandbox, functools.partial(_reserve, prepared.sandbox)
                    )
                return FastChannel(
                    prepared.spawned,
                    prepared.stdin_w,
                    prepared.out_r,
                    prepared.err_r,
                    fs_limiter=self._fs_limiter,
                    on_lost=functools.partial(self._lost, prepared.sandbox, prepared.spawned),
                    spare=spare,
                )
        stream = await self._engine.exec_start(prepared.exec_id)
        return EngineChannel(self._engine, prepared.exec_id, stream, fs_limiter=self._fs_limiter)

    async def _stream_start(self, prepared: StreamPrepared) -> StreamChannel | None:
        """Ask the stream supervisor to run the command; its channel once the supervisor
        answered (`started`, or `exited` when exec failed). None: the stream broke before
        the supervisor answered — nothing is known to have run; the engine runs it."""
        spec, link = prepared.spec, prepared.link
        ident = secrets.token_hex(8)
        try:
            command = await link.run(
                ident, list(spec.argv), spec.environment, spec.workdir, spec.stdin
            )
        except StreamBroken:
            return None
        channel = StreamChannel(link, command, spec.stdin)
        with trio.CancelScope(shield=True):  # the command may run: its channel is returned
            with trio.move_on_after(STREAM_REPLY_S):
                await command.started.wait()
            if not command.started.is_set():
                link.close("unresponsive")  # stopped, or stuck: its next start replaces it
        if command.ran or command.code is not None:
            assert self._supervisors is not None
            self._supervisors.streams.started += 1
            return channel
        channel.release()
        return None

    def discard(self, prepared: Sequence[Prepared]) -> None:
        """Prepared commands that will not start (the record failed): let go of them."""
        for p in prepared:
            if isinstance(p, FastPrepared):
                p.close()

    async def _engine_create(self, spec: ExecSpec) -> EnginePrepared:
        exec_id = await self._engine.exec_create(
            spec.container,
            spec.argv,
            user=spec.user,
            workdir=spec.workdir,
            environment=spec.environment,
            stdin=spec.stdin,
        )
        return EnginePrepared(spec, exec_id)

    async def _spawn(
        self, sandbox: Sandbox, spec: ExecSpec, cgroup: cmd_cgroups.CommandCgroup | None
    ) -> FastPrepared | None:
        assert self._supervisors is not None
        spawned = await self._supervisors.spawn(
            sandbox, cgroup.owner if cgroup is not None else None
        )
        if spawned is None:
            return None
        if cgroup is not None and spawned.entered != cgroup.path and not _enter(cgroup, spawned):
            spawned.kill()  # held, never ran: killed by its pidfd
            spawned.close()
            return None  # gone, or not where it was checked: the engine runs the command
        made: list[int] = []
        try:
            for _ in range(3):
                made.extend(os.pipe())
        except OSError:
            _close(made)
            spawned.close()  # nothing ran: the held child exits
            raise
        stdin_r, stdin_w, out_r, out_w, err_r, err_w = made
        theirs = (stdin_r, out_w, err_w)
        if not spec.stdin:
            os.close(stdin_w)  # the command reads EOF at once
            return FastPrepared(spec, sandbox, spawned, None, out_r, err_r, theirs)
        return FastPrepared(spec, sandbox, spawned, stdin_w, out_r, err_r, theirs)

    async def _lost(self, sandbox: Sandbox, spawned: Spawned, *, closed: bool = False) -> bool:
        """Is the supervisor that forked `spawned` still serving? (Journals it if not.)
        `closed`: the command's channel closed without a report (`Supervisors.serving`)."""
        if self._supervisors is None:
            return False
        return await self._supervisors.serving(sandbox.id, spawned.generation, closed=closed)


def new_proc_id() -> str:
    """A fresh command id (`p_` and 16 hex digits)."""
    return "p_" + secrets.token_hex(8)


def _reserve(sandbox: Sandbox) -> cmd_cgroups.CommandCgroup | None:
    """The command cgroup of a command id chosen now, for the spare to be moved into while
    it is held (a `mkdir` on cgroupfs); None when the host makes none."""
    if not sandbox.host_visible:
        return None
    return cmd_cgroups.make(sandbox.cgroups, new_proc_id())


def _enter(cgroup: cmd_cgroups.CommandCgroup, spawned: Spawned) -> bool:
    """Move the held child into the command's cgroup (a write to cgroupfs, on the event
    loop: microseconds). True once it is there; False when it died meanwhile (its pidfd
    says so: then the pid written may not have been its own) or the move failed."""
    moved = cmd_cgroups.enter(cgroup, spawned.host_pid)
    if spawned.exited():
        return False
    if not moved:
        log.error("a held child could not be moved into its command's cgroup")
    return moved


def _read_into(
    fd: int, streams: dict[int, OutputSink | None], forget: Callable[[int], None]
) -> int:
    """One read of a ready pipe into its sink; at its end (or a read error) the pipe
    leaves `streams` and `forget` unregisters it. Returns the bytes moved."""
    try:
        data = os.read(fd, RECV_BYTES)
    except BlockingIOError:
        return 0
    except OSError:
        data = b""
    if not data:
        forget(fd)
        del streams[fd]
        return 0
    sink = streams[fd]
    if sink is not None:
        sink.write(data)  # a spool append: microseconds at this size
    return len(data)


def _close(fds: Sequence[int | None]) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class FastChannel:
    """A command started by the sandbox's supervisor (see the module doc)."""

    via: Via = "supervisor"

    def __init__(
        self,
        spawned: Spawned,
        stdin_w: int | None,
        out_r: int,
        err_r: int,
        *,
        fs_limiter: trio.CapacityLimiter | None,
        on_lost: Callable[..., Awaitable[bool]],
        spare: Pending | None = None,
    ) -> None:
        self._spawned = spawned
        self._spare = spare  # the next held child, asked for as this one started
        self._stdin_w = stdin_w
        self._out_r, self._err_r = out_r, err_r
        self._fs_limiter = fs_limiter
        self._on_lost = on_lost
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._code: int | None = None
        self._errno: int | None = None
        self._reported = False
        self.facts: list[Fact] = spawned.facts

    # -- streams (worker threads) ------------------------------------------------------

    async def pump(self, sinks: Mapping[int, OutputSink], limiter: trio.CapacityLimiter) -> None:
        """Both pipes into their sinks, until both end or `shutdown`. Read on the event
        loop (no thread hop for the usual small output) by this one task, which waits on
        an epoll set of both pipes and the wake pipe, until the output passed
        `LOOP_PUMP_BYTES`; the rest is read in a worker thread under `limiter`.
        Shielded: a cancelled run still gets every byte the command wrote until it is
        woken by `shutdown`."""
        streams: dict[int, OutputSink | None] = {
            self._out_r: sinks.get(1),
            self._err_r: sinks.get(2),
        }
        with trio.CancelScope(shield=True):
            ready = select.epoll(3)
            try:
                for fd in streams:
                    os.set_blocking(fd, False)
                    ready.register(fd, select.EPOLLIN)
                ready.register(self._wake_r, select.EPOLLIN)
                moved = 0
                while streams and moved <= LOOP_PUMP_BYTES:
                    await trio.lowlevel.wait_readable(ready.fileno())
                    for fd, _ in ready.poll(0):
                        if fd == self._wake_r:
                            return  # the run gave up on the streams
                        if fd in streams:
                            moved += _read_into(fd, streams, ready.unregister)
            finally:
                ready.close()
            if streams:
                # Large output: a thread of the pump limiter, as for an engine exec. It
                # stops at both EOFs or on the wake pipe (cancelling does not stop it).
                await trio.to_thread.run_sync(self._drain_blocking, streams, limiter=limiter)

    def _drain_blocking(self, streams: dict[int, OutputSink | None]) -> None:
        poller = select.poll()
        for fd in streams:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while streams:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return
                if fd in streams:
                    _read_into(fd, streams, poller.unregister)

    def feed(self, data: bytes) -> None:
        fd = self._stdin_w
        if fd is None:
            return
        try:
            write_until_woken(fd, data, self._wake_r, RECV_BYTES)
        finally:
            self._stdin_w = None
            with contextlib.suppress(OSError):
                os.close(fd)

    def stdin_pipe(self) -> StdinPipe | None:
        return None if self._stdin_w is None else PipeStdin(self._stdin_w, self._close_stdin)

    def _close_stdin(self) -> None:
        fd, self._stdin_w = self._stdin_w, None
        _close([fd])

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        _close([self._stdin_w, self._out_r, self._err_r, self._wake_r, self._wake_w])
        self._stdin_w = None
        self._out_r = self._err_r = self._wake_r = self._wake_w = -1

    def release(self) -> None:
        self.close()
        self._spawned.close()  # its channel: a command still running is the daemon's
        spare, self._spare = self._spare, None
        if spare is not None:  # never settled (the run ended early): let it go
            spare.abandon()

    async def quiesce(self) -> None:
        """Settle the spare asked for as this command started (docs/fast-exec.md "Held
        children"): kept, its pid protected, before the run scans the sandbox."""
        spare, self._spare = self._spare, None
        if spare is not None:
            await spare.settle()

    # -- the main process --------------------------------------------------------------

    async def main_pid(self, *, first_sleep: float) -> int | None:
        return self._spawned.host_pid if not self._spawned.exited() else None

    async def wait_exit(self, *, host_visible: bool) -> int | None:
        """The supervisor's report of the exit. Without one — its channel closed (it was
        killed or dropped), or the command ended and no report came within
        `REPORT_GRACE_S` from a supervisor that no longer serves (stopped, gone) — the
        code is lost (None), the loss is journalled, and the command itself is waited
        for by its pidfd. One task: the report is waited for in rounds of
        `REPORT_GRACE_S`, and between rounds a command that ended is asked about."""
        if self._reported:
            return self._code
        found: tuple[int | None, int | None] | None = None
        while found is None:
            with trio.move_on_after(REPORT_GRACE_S):
                found = await self._spawned.wait_exit()
            if found is None and self._spawned.exited() and not await self._on_lost():
                break  # ended, and no longer served: the report is lost
        code, err = found if found is not None else (None, None)
        if code is None:
            await self._on_lost(closed=found is not None)
            await self._spawned.wait_gone()
        self._code, self._errno, self._reported = code, err, True
        return code

    async def running(self) -> bool:
        return not self._spawned.exited()

    async def signal_group(self, signum: int) -> bool | None:
        return None  # host processes: the driver signals them from the host

    async def start_failed(self, sinks: Mapping[int, OutputSink], argv0: str, code: int) -> int:
        """The exec in the held child failed (it exited 127 with the errno): the shell's
        code and message, as on the engine path."""
        if self._errno is None:
            return code
        new_code, message = start_failure(argv0, os.strerror(self._errno).encode())

        def write() -> None:
            for sink in sinks.values():
                sink.rewind()
            sinks[2].write(message.encode("utf-8", "surrogateescape"))

        await trio.to_thread.run_sync(write, limiter=self._fs_limiter)
        return new_code
