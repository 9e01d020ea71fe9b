"""How the driver talks to one started command, whichever way it was started.

An `ExecChannel` is the started command as `substrate.process.driver` needs it: pump its
output into the sinks, feed its stdin, wake those pumps when the run is cut off, learn
its main host pid, wait for its exit code, and turn "the program could not be started"
into the shell's answer. Two implementations: `EngineChannel` (an engine exec: the
multiplexed stream, `exec_inspect` for pid and code) here, and
`substrate.process.fastexec.FastChannel` (the sandbox's supervisor: pipes, a pidfd and
the supervisor's report; docs/fast-exec.md).

Threading: `feed` blocks and runs in a worker thread; `pump` holds one for the life of
an engine exec (a supervisor's pipes are read on the event loop while output is small);
`shutdown` may be called from any thread; the async methods run on the event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Literal, Protocol

import trio

from substrate.artifacts.sink import OutputSink
from substrate.process import stream as exec_stream
from substrate.process.argv import ENGINE_START_FAILED, start_failure
from substrate.process.stdin_stream import SocketStdin, StdinPipe
from substrate.sandbox import reaper
from substrate.sandbox.engine import ContainerGone, Engine, ExecStream
from substrate.sandbox.facts import Fact

#: At most this much of the engine's start-failure text is read to classify it.
ENGINE_MESSAGE_BYTES = 4096

Via = Literal["supervisor", "engine"]


class ExecChannel(Protocol):
    """A started command, as the driver drives it."""

    #: How it was started (`ProcResult.via`).
    via: Via
    #: Its own process's confinement as the host saw it before it ran ([] on the engine
    #: path, where the command's process is not observed: docs/fast-exec.md).
    facts: list[Fact]

    async def pump(self, sinks: Mapping[int, OutputSink], limiter: trio.CapacityLimiter) -> None:
        """Move stdout (1) and stderr (2) into `sinks` until both end or `shutdown`; never
        returns early on cancellation (what was read is always in the sinks). Blocking
        work runs in worker threads under `limiter`."""
        ...

    def feed(self, data: bytes) -> None:
        """Write the command's stdin, then close it (EOF); stops early on `shutdown`."""
        ...

    def stdin_pipe(self) -> StdinPipe | None:
        """The command's stdin for a streamed one (`StdinStream.drain`: non-blocking
        writes on the event loop, then EOF); None when it has none."""
        ...

    def shutdown(self) -> None:
        """Wake `pump` and `feed` (any thread): the run gives up on the streams."""
        ...

    def close(self) -> None:
        """Release the streams (after `pump` and `feed` returned, or never started)."""
        ...

    def release(self) -> None:
        """The run is over: nothing more will be asked; let go of what is left."""
        ...

    async def main_pid(self, *, first_sleep: float) -> int | None:
        """The main process's host pid once it runs; None once it ended without one."""
        ...

    async def quiesce(self) -> None:
        """Before the run scans the sandbox's processes (stragglers, a kill): whatever
        this path started besides the command is accounted for (a supervisor's next held
        child is protected: docs/fast-exec.md). Bounded."""
        ...

    async def wait_exit(self, *, host_visible: bool) -> int | None:
        """The exit code once the main process ended (128 + n for signal n); None when
        it was lost. Unbounded: the caller bounds it."""
        ...

    async def running(self) -> bool:
        """Does the main process still run? (For a run cut off under gVisor.)"""
        ...

    async def signal_group(self, signum: int) -> bool | None:
        """Under gVisor, where the command's processes are not host processes: `signum`
        to the command's process group by whatever started it; False once it ended;
        None when this path cannot (the driver then signals from the host, or removes
        the sandbox)."""
        ...

    async def start_failed(self, sinks: Mapping[int, OutputSink], argv0: str, code: int) -> int:
        """The code to report: for a program that could not be started, the shell's (127
        not found, 126 not executable) with its message on stderr instead of the way
        this path reported it; otherwise `code` unchanged."""
        ...


class EngineChannel:
    """An engine exec: its multiplexed stream, and `exec_inspect` for pid and exit code."""

    via: Via = "engine"

    def __init__(
        self,
        engine: Engine,
        exec_id: str,
        stream: ExecStream,
        *,
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._engine = engine
        self.exec_id = exec_id
        self._sock = stream.sock
        self._initial = stream.initial
        self._fs_limiter = fs_limiter
        self.facts: list[Fact] = []

    async def pump(self, sinks: Mapping[int, OutputSink], limiter: trio.CapacityLimiter) -> None:
        await trio.to_thread.run_sync(
            exec_stream.pump_stream, self._sock, self._initial, sinks, limiter=limiter
        )

    def feed(self, data: bytes) -> None:
        exec_stream.feed_stdin(self._sock, data, True)

    def stdin_pipe(self) -> StdinPipe | None:
        return SocketStdin(self._sock)

    def shutdown(self) -> None:
        exec_stream.shutdown(self._sock)

    def close(self) -> None:
        self._sock.close()

    def release(self) -> None:
        self._sock.close()  # closed by `close` already unless the run broke before

    async def quiesce(self) -> None:
        return None  # the engine starts nothing besides the command

    async def main_pid(self, *, first_sleep: float) -> int | None:
        """An exec the engine has not started yet also reads `Running: false`, but with no
        exit code: that one is asked again, after `first_sleep`, then twice as long each
        time up to 1 s (a slow engine can take a while to start a process). The engine
        reports the pid once runc has exec'd the program."""
        for attempt in itertools.count():
            try:
                info = await self._engine.exec_inspect(self.exec_id)
            except ContainerGone:
                return None
            pid = int(info.get("Pid") or 0)
            if info.get("Running") and pid > 0:
                return pid
            if not info.get("Running") and info.get("ExitCode") is not None:
                return None
            await trio.sleep(min(first_sleep * 2**attempt, 1.0))
        raise AssertionError("unreachable")

    async def wait_exit(self, *, host_visible: bool) -> int | None:
        for attempt in itertools.count():
            try:
                info = await self._engine.exec_inspect(self.exec_id)
            except ContainerGone:
                return None
            if not info.get("Running"):
                code = info.get("ExitCode")
                # Not running and no code yet: the engine is still recording the exit.
                if code is not None or attempt >= 8:
                    return int(code) if code is not None else None
            elif host_visible and int(info.get("Pid") or 0) > 0:
                await reaper.wait_exit(int(info["Pid"]))  # it closed its output: wait on it
                continue
            await trio.sleep(min(0.005 * 2**attempt, 0.5))
        raise AssertionError("unreachable")

    async def running(self) -> bool:
        try:
            info = await self._engine.exec_inspect(self.exec_id)
        except ContainerGone:
            return False
        return bool(info.get("Running"))

    async def signal_group(self, signum: int) -> bool | None:
        return None  # the engine's exec has no way to signal what it started

    async def start_failed(self, sinks: Mapping[int, OutputSink], argv0: str, code: int) -> int:
        """Exit 126 from an exec that never had a process: the engine could not start the
        program. Its message (on stdout) becomes the shell's code and a line on stderr."""
        if code != ENGINE_START_FAILED:
            return code
        try:
            info = await self._engine.exec_inspect(self.exec_id)
        except ContainerGone:
            return code
        if int(info.get("Pid") or 0) != 0:
            return code  # it ran, and exited 126 itself

        def rewrite() -> int:
            new_code, message = start_failure(argv0, sinks[1].read_at(0, ENGINE_MESSAGE_BYTES))
            for sink in sinks.values():
                sink.rewind()
            sinks[2].write(message.encode("utf-8", "surrogateescape"))
            return new_code

        return await trio.to_thread.run_sync(rewrite, limiter=self._fs_limiter)
