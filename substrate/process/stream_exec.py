"""A command a gVisor sandbox's stream supervisor started, as the driver drives it.

`StreamChannel` is an `ExecChannel` (`substrate.process.channels`) over one command of a
`substrate.sandbox.supervisor.stream_link.StreamLink` (docs/fast-exec.md "Under
gVisor"): its output is written into the sinks by the link's reader (`pump` attaches
them and waits for the command's end), its stdin goes through a local pipe whose read end
a task forwards to the supervisor a piece at a time (so `feed` and a streamed stdin's
`PipeStdin` work as on the runc supervisor's path, and at most a pipe's worth plus one
piece is ever held), the exit code is the supervisor's `exited`, and a failed exec gets
the shell's code and message (`start_failed`). Like the engine path under gVisor, the
command's processes are not host processes: `main_pid` knows none; INT and TERM go to
the command's process group through the supervisor (`signal_group`), and the driver ends
a command for certain (timeout, KILL, a run cut off) by removing the sandbox
(`ExecDriver.kill_inside`), which ends the stream too.

Threading: `feed` blocks (a worker thread); `shutdown` may be called from any thread (it
is handed to the event loop); everything else runs on the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import trio

from substrate.artifacts.sink import OutputSink
from substrate.process.argv import start_failure
from substrate.process.channels import Via
from substrate.process.stdin_stream import PipeStdin, StdinPipe, write_until_woken
from substrate.sandbox.facts import Fact
from substrate.sandbox.supervisor import stream_agent
from substrate.sandbox.supervisor.stream_link import StreamCommand, StreamLink

log = logging.getLogger("substrate.process.stream_exec")

#: Bytes written to the local stdin pipe at a time.
WRITE_BYTES = 1 << 16
#: How long a signal waits for the supervisor's `started` of a command just asked for.
SIGNAL_WAIT_S = 10.0


class StreamChannel:
    """One command over a stream supervisor (see the module doc)."""

    via: Via = "supervisor"

    def __init__(self, link: StreamLink, command: StreamCommand, stdin: bool) -> None:
        self._link = link
        self._command = command
        self._token = trio.lowlevel.current_trio_token()
        self._woken = trio.Event()
        self._wake_r = self._wake_w = -1  # wakes `feed` (only a command with stdin has one)
        self._stdin_w: int | None = None
        #: No per-command fact is the host kernel's here: the command is a Sentry task
        #: (docs/fast-exec.md "Under gVisor": what is hidden).
        self.facts: list[Fact] = []
        if stdin:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            r, w = os.pipe2(os.O_CLOEXEC)
            self._stdin_w = w
            trio.lowlevel.spawn_system_task(self._forward, r)

    async def _forward(self, r: int) -> None:
        """The local stdin pipe to the supervisor, a piece at a time, then EOF."""
        try:
            await self._forward_from(r)
        except Exception:  # a system task: never the daemon's end
            log.exception("stream stdin forwarder failed")
        finally:
            os.close(r)

    async def _forward_from(self, r: int) -> None:
        command = self._command
        os.set_blocking(r, False)
        while not command.exited.is_set():
            try:
                data = os.read(r, stream_agent.MAX_STDIN)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(r)
                continue
            except OSError:
                data = b""
            if not data or not await self._link.send_stdin(command, data):
                break
        await self._link.close_stdin(command)

    async def pump(self, sinks: Mapping[int, OutputSink], limiter: trio.CapacityLimiter) -> None:
        """The link's reader writes the output into `sinks` from now on; this returns
        once the command ended (every byte it wrote is in them) or on `shutdown`.
        Shielded: a cancelled run still gets the output until it is woken."""
        self._command.attach(sinks, limiter)
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:

                async def ended() -> None:
                    await self._command.exited.wait()
                    nursery.cancel_scope.cancel()

                async def woken() -> None:
                    await self._woken.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(ended)
                nursery.start_soon(woken)

    def feed(self, data: bytes) -> None:
        fd = self._stdin_w
        if fd is None:
            return
        try:
            write_until_woken(fd, data, self._wake_r, WRITE_BYTES)
        finally:
            self._close_stdin()

    def stdin_pipe(self) -> StdinPipe | None:
        return None if self._stdin_w is None else PipeStdin(self._stdin_w, self._close_stdin)

    def _close_stdin(self) -> None:
        fd, self._stdin_w = self._stdin_w, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def shutdown(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:
        self._woken.set()
        self._command.detach()

    def close(self) -> None:
        self._command.detach()
        self._close_stdin()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

    def release(self) -> None:
        self.close()
        self._link.forget(self._command)

    async def quiesce(self) -> None:
        return None  # the supervisor starts nothing besides the command

    async def main_pid(self, *, first_sleep: float) -> int | None:
        return None  # a Sentry task: no host pid

    async def wait_exit(self, *, host_visible: bool) -> int | None:
        """The supervisor's `exited`; None when the stream ended first (lost)."""
        await self._command.exited.wait()
        return self._command.code

    async def running(self) -> bool:
        return not self._command.exited.is_set()

    async def signal_group(self, signum: int) -> bool | None:
        """`signum` to the command's process group, by the supervisor; False once the
        command ended (or the stream did)."""
        command = self._command
        with trio.move_on_after(SIGNAL_WAIT_S):
            await command.started.wait()  # its process group exists from then on
        if not command.started.is_set():
            return False
        return await self._link.signal(command, signum)

    async def start_failed(self, sinks: Mapping[int, OutputSink], argv0: str, code: int) -> int:
        """Exec itself failed (the supervisor's errno): the shell's code and message, as on
        the engine path."""
        err = self._command.errno
        if err is None:
            return code
        new_code, message = start_failure(argv0, os.strerror(err).encode())

        def write() -> None:
            for sink in sinks.values():
                sink.rewind()
            sinks[2].write(message.encode("utf-8", "surrogateescape"))

        await trio.to_thread.run_sync(write)
        return new_code
