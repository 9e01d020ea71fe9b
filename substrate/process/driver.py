"""Driving one exec: its output and stdin pumps, the supervisor, signals, the kill.

`substrate.process.processes.Processes` creates the exec and the record; `ExecDriver` runs it from
the engine's start until its main process has ended and its stream is drained, then
`Processes` checks the write gate and finishes the record.

Theory of operation. The command is reached through its `ExecChannel`
(`substrate.process.channels`: an engine exec's multiplexed stream, or the pipes of a
command the sandbox's supervisor started, docs/fast-exec.md). Its output is read by one
worker thread and written to two `OutputSink`s as it arrives; stdin, when given, is
written by another thread, then closed so the command sees EOF; a streamed one
(`stdin_stream.StdinStream`) is handed over by a task as the command reads, until EOF or
the run's end. A watcher task watches the clock and the command:
- the output ends (the usual case) → done;
- still open after `MAIN_PROBE_S` → learn the main process's host pid (the engine's
  inspect, or the supervisor's pidfd) and wait on it (pidfd): once the main process
  exits, anything still holding the output pipe is a straggler and is reaped;
- the deadline passes → TERM to every process of the command, KILL after `GRACE_S`.
The run cut off (its caller went away, the daemon stops, a failure): the watcher
kills the command and lets its stream drain (the pump thread is never abandoned, so
nothing writes to a sink after the run closed it); `settle` then reads its exit code.
Every such step is bounded (`SETTLE_S`).

Signals (`signal`) go from the host to every process the reaper attributes to the
command, plus its main process once it is known (even with a scrubbed
environment). Right after `proc.start` the exec may have no process yet: the engine
answers the start before runc has run the program. A signal that finds nothing then is
*held* on the entry, and the run delivers it as soon as the engine reports the main
process (or answers 0 if the exec ended without one): a caller is never told
`delivered: 0` for a command that then keeps running.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from collections.abc import Hashable
from dataclasses import dataclass, field

import trio

from substrate.artifacts.sink import OutputSink
from substrate.process.channels import ExecChannel
from substrate.process.stdin_stream import StdinStream
from substrate.sandbox import cmd_cgroups, reaper
from substrate.sandbox.cmd_cgroups import CommandCgroup
from substrate.sandbox.containers import Containers, Sandbox
from substrate.sandbox.engine import Engine
from substrate.schema.proc import EgressBlocked, ProcResult

log = logging.getLogger("substrate.process.processes")

#: Seconds between TERM and KILL, on timeout and for stragglers.
GRACE_S = 2.0
#: The stream still open this long: learn the main pid so its exit is noticed even when
#: a background child holds the output pipe.
MAIN_PROBE_S = 0.25
#: How long a signal that finds nothing is tried again while the command runs, seconds.
#: The command's processes are known by their cgroup or as the main process the engine
#: reports, never by anything they carry themselves; under load the engine may take
#: seconds to place and report an exec's process, so a second was too short (a KILL right
#: after `proc.start` then answered `delivered: 0` for a command that kept running).
SIGNAL_RETRY_S = 5.0
#: A run cut off after its exec started: at most this long to end the command and read
#: its exit code (the kill itself takes up to `GRACE_S` plus KILL rounds).
SETTLE_S = 30.0


@dataclass
class HeldSignal:
    """A signal sent before the command had a process: delivered by its run."""

    name: str
    done: trio.Event = field(default_factory=trio.Event)
    delivered: int = 0


@dataclass
class Entry:
    """A command of this daemon run, from its exec start until its record is final.

    Held by `Processes` while it runs (intents look it up by id); whoever waits on it
    or streams it keeps the object after that, and reads the closed sinks.
    """

    proc: str
    workspace: str
    profile: str
    argv: list[str]
    started: float  # unix time
    sandbox: Sandbox
    sinks: dict[int, OutputSink]
    done: trio.Event = field(default_factory=trio.Event)
    result: ProcResult | None = None  # set when it ended with an outcome
    ended: float | None = None
    #: The identity of the main process (`reaper.ProcInfo.ident`), once the engine
    #: reported it: it is the command's even outside its cgroup (before it was moved in).
    main: Hashable | None = None
    #: The engine reported the main process (or the exec's end): a signal that finds
    #: nothing after this is never held; it is tried again for `SIGNAL_RETRY_S` while the
    #: command runs, then answered 0.
    appeared: bool = False
    held: list[HeldSignal] = field(default_factory=list)
    held_added: trio.Event = field(default_factory=trio.Event)
    stdin: StdinStream | None = None  # its stdin, open for `proc.write` (stdin: "stream")
    channel: ExecChannel | None = None  # once its exec started

    @property
    def state(self) -> str:
        if not self.done.is_set():
            return "running"
        return "exited" if self.result is not None else "lost"


@dataclass
class Run:
    """The state of one running command, shared by its tasks."""

    entry: Entry
    proc: str
    sandbox: Sandbox
    channel: ExecChannel
    sinks: dict[int, OutputSink]
    deadline: float
    pump_done: trio.Event = field(default_factory=trio.Event)
    main_exited: bool = False
    timed_out: bool = False
    reaped: int = 0
    killed: int = 0
    #: The command's own cgroup (`cmd_cgroups`): made by the runner, entered by the held
    #: child before it execs (fast path) or by `_enclose` once it runs (engine path).
    cgroup: CommandCgroup | None = None


class ExecDriver:
    """Drives the execs of one daemon: pumps, supervision, signals, kills. Used by
    `substrate.process.processes.Processes` (which records, gates and answers)."""

    def __init__(
        self,
        engine: Engine,
        containers: Containers,
        *,
        pump_limiter: trio.CapacityLimiter,
        fs_limiter: trio.CapacityLimiter | None,
    ) -> None:
        self._engine = engine
        self._containers = containers
        self._pump_limiter = pump_limiter
        self._fs_limiter = fs_limiter

    async def signal(self, entry: Entry, name: str) -> int:
        """Send INT/TERM/KILL to every process of `entry`'s running command; how many.

        KILL goes in rounds with the cgroup frozen (a forking command cannot outrun it).
        A signal that finds no process before the engine reported the main one is held
        and delivered by the run as soon as it is (this call waits for that); 0 means
        the command had no process left. Under gVisor the command's processes are not
        host processes: INT and TERM go to the command's process group through the
        stream supervisor that started it; KILL (and TERM or INT of a command on the
        engine's exec, which cannot signal: INT then reaches nothing) removes the whole
        sandbox, every command in it ending.
        """
        sandbox = entry.sandbox
        if not sandbox.host_visible:
            if name != "KILL" and entry.channel is not None:
                sent = await entry.channel.signal_group(signal.Signals["SIG" + name])
                if sent is not None:
                    return int(sent)
            if name == "INT":
                return 0
            await self._containers.forget(sandbox, "signal")
            return 1
        # Whether the main process was known must be read *before* sending: if the engine
        # reports it while `send` looks, that look may have come too early to find it.
        known = entry.appeared or entry.done.is_set()
        delivered = await self.send(entry, name)
        if delivered or known:
            return delivered if delivered else await self._send_while_running(entry, name)
        if entry.appeared or entry.done.is_set():
            # It appeared meanwhile: look again.
            return await self._send_while_running(entry, name)
        held = HeldSignal(name)
        entry.held.append(held)
        entry.held_added.set()
        await held.done.wait()
        return held.delivered

    async def _send_while_running(self, entry: Entry, name: str) -> int:
        """`send`, again for a moment while it finds nothing and the command has not
        ended: the engine may report a main process that is still runc's init, neither
        readable as the command's nor marked yet, so a first look can miss it. 0 only
        once the command ended or after `SIGNAL_RETRY_S`."""
        deadline = trio.current_time() + SIGNAL_RETRY_S
        delay = 0.005
        while True:
            delivered = await self.send(entry, name)
            if delivered or entry.done.is_set() or trio.current_time() >= deadline:
                return delivered
            await trio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def send(self, entry: Entry, name: str) -> int:
        """Signal every process of `entry`'s command now; how many were signalled."""
        sandbox = entry.sandbox
        roots = _roots(entry)
        if name == "KILL":
            total = 0
            for _ in range(10):
                n = await trio.to_thread.run_sync(
                    functools.partial(
                        reaper.kill_round,
                        sandbox.cgroups,
                        entry.proc,
                        sandbox.protected,
                        False,
                        roots=roots,
                    )
                )
                if n == 0:
                    break
                total = max(total, n)
                await trio.sleep(0.02)
            return total
        signum = signal.Signals["SIG" + name]

        def deliver() -> int:
            found = reaper.targets(
                sandbox.cgroups, entry.proc, sandbox.protected, False, roots=roots
            )
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            return len(found)

        return await trio.to_thread.run_sync(deliver, limiter=self._fs_limiter)

    async def _release_held(self, run: Run) -> None:
        """Deliver held signals once the engine reports the main process (run task)."""
        entry = run.entry
        while True:
            await entry.held_added.wait()
            entry.held_added = trio.Event()
            await self.learn_main(run, first_sleep=0.005)
            await self._deliver_held(entry)

    async def learn_main(self, run: Run, *, first_sleep: float) -> int | None:
        """Wait until the engine reports the exec's main process (or its end); record it
        on the entry. Returns its host pid, None once the exec ended without one."""
        pid = await run.channel.main_pid(first_sleep=first_sleep)
        entry = run.entry
        if pid is not None and entry.main is None:
            entry.main = await trio.to_thread.run_sync(reaper.identity, pid)
        entry.appeared = True
        return pid

    async def _release_remaining(self, entry: Entry) -> None:
        """The stream ended: one last delivery for anything still held."""
        entry.appeared = True
        await self._deliver_held(entry)

    async def _deliver_held(self, entry: Entry) -> None:
        """Send each held signal now and answer its caller. Shielded: once taken off the
        list, a signal is sent (the run's end cancels the releaser) and answered."""
        while entry.held:
            held = entry.held.pop(0)
            try:
                with trio.CancelScope(shield=True):
                    held.delivered = await self._send_while_running(entry, held.name)
            finally:
                held.done.set()

    async def reap_stragglers(self, run: Run) -> int:
        """After the main process: reap what it left behind; return the OOM-kill count."""
        sandbox = run.sandbox
        await run.channel.quiesce()
        if not sandbox.host_visible or _only_protected(sandbox):
            # The usual case: nothing but the container's own processes is left. Two small
            # cgroupfs reads, on the event loop (no thread hop for a quick command).
            return reaper.oom_kills(sandbox.cgroups)
        stragglers, oom_after = await trio.to_thread.run_sync(
            _after_exit, sandbox, run.proc, limiter=self._fs_limiter
        )
        if stragglers:
            await self._terminate(run)
        return oom_after

    def egress_blocked(self, run: Run) -> EgressBlocked | None:
        """What an egress sandbox's proxy refused to the command (None: nothing, or not an
        egress sandbox); its filing ends here. Called once, as the run concludes."""
        link = run.sandbox.egress
        return None if link is None else link.ledger.close_run(run.proc)

    async def settle(self, run: Run, exit_code: int | None) -> tuple[int | None, int]:
        """A run cut off after its exec started: end whatever of the command is left and
        read its exit code (bounded by `SETTLE_S`); return (exit code, OOM-kill count).
        Called shielded."""
        sandbox = run.sandbox
        if not run.pump_done.is_set():  # cut off before its stream was driven at all
            run.channel.shutdown()
            run.channel.close()
        with trio.move_on_after(SETTLE_S):
            if sandbox.host_visible:
                await self.kill(run)  # targeted: one scan when nothing is left
            elif exit_code is None and await run.channel.running():
                await self.kill_inside(run)
            if exit_code is None:
                with trio.move_on_after(GRACE_S):
                    exit_code = await self.wait_exit(run)
        oom_after = await trio.to_thread.run_sync(
            reaper.oom_kills, sandbox.cgroups, limiter=self._fs_limiter
        )
        return exit_code, oom_after

    # -- driving one exec -----------------------------------------------------------------

    async def drive(self, run: Run, stdin: bytes | StdinStream | None) -> None:
        """Pump output (and stdin) until the stream ends; supervise timeout and exit;
        deliver held signals; a streamed stdin is drained into the command until its
        output ends (`StdinStream.drain`). Cancelled, it kills the command and drains its stream
        before it returns (see `_supervise`): the pump thread is never abandoned, so
        nothing writes to a sink after the run closed it."""
        if run.sandbox.egress is not None:  # its refused connections are filed from now on
            run.sandbox.egress.ledger.open_run(run.proc)
        try:
            async with trio.open_nursery() as signals:
                signals.start_soon(self._release_held, run)
                if isinstance(stdin, StdinStream):
                    pipe = run.channel.stdin_pipe()
                    if pipe is None:  # no stdin to write to: writes are refused
                        stdin.end("closed")
                    else:
                        signals.start_soon(stdin.drain, pipe)
                async with trio.open_nursery() as nursery:
                    if isinstance(stdin, bytes):
                        nursery.start_soon(trio.to_thread.run_sync, run.channel.feed, stdin)
                    if run.cgroup is not None and run.channel.via == "engine":
                        nursery.start_soon(self._enclose, run, run.cgroup)
                    nursery.start_soon(self._supervise, run)
                    await self._pump(run)  # in the body: one task fewer per command
                signals.cancel_scope.cancel()
        finally:
            run.channel.shutdown()
            run.channel.close()
            with trio.CancelScope(shield=True):
                await self._release_remaining(run.entry)

    async def _enclose(self, run: Run, cgroup: CommandCgroup) -> None:
        """An engine exec: move its process, and whatever it forked already, into the
        command's cgroup as soon as the engine names it (its first inspect: a few ms).
        Bounded: the exec runs, or its end is reported."""
        pid = await self.learn_main(run, first_sleep=0.002)
        if pid is None:
            return  # it ended before the engine named it: its stragglers are reaped
        dirs = run.sandbox.cgroups

        def move() -> int:
            return cmd_cgroups.enclose(cgroup, pid, reaper.cgroup_pids(dirs))

        await trio.to_thread.run_sync(move, limiter=self._fs_limiter)

    async def _pump(self, run: Run) -> None:
        try:
            # Not abandoned on cancel: the run ends the command (or shuts the stream) and
            # this returns once every byte it read is in the sinks.
            await run.channel.pump(run.sinks, self._pump_limiter)
        finally:
            run.pump_done.set()

    async def _supervise(self, run: Run) -> None:
        try:
            await self._watch(run)
        except BaseException:
            # Cut off (cancelled, or a failure here): the command must not outlive its
            # run. End it, let its stream drain, shut the stream; bounded.
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + SETTLE_S
                if not run.pump_done.is_set():
                    await self.kill(run)
                    with trio.move_on_after(GRACE_S):
                        await run.pump_done.wait()
            if not run.pump_done.is_set():
                log.warning("%s: output stream still open after kill; closing it", run.proc)
                run.channel.shutdown()
            raise

    async def _watch(self, run: Run) -> None:
        sandbox = run.sandbox
        with trio.move_on_at(run.deadline):
            with trio.move_on_after(MAIN_PROBE_S):
                await run.pump_done.wait()
            if run.pump_done.is_set():
                return
            if sandbox.host_visible:
                # Still streaming: watch the main process itself, so a background child
                # holding the output pipe cannot keep the command "running".
                pid = await self.learn_main(run, first_sleep=0.05)
                if pid is not None:
                    async with trio.open_nursery() as nursery:

                        async def main_exit() -> None:
                            await reaper.wait_exit(pid)
                            nursery.cancel_scope.cancel()

                        async def stream_end() -> None:
                            await run.pump_done.wait()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(main_exit)
                        nursery.start_soon(stream_end)
                if not run.pump_done.is_set():
                    # The main process is gone but the stream is open: stragglers hold it.
                    run.main_exited = True
                    await self._terminate(run)
            # Under gVisor the engine itself closes the stream soon after the main exits.
            await run.pump_done.wait()
        if run.pump_done.is_set():
            return
        run.timed_out = not run.main_exited
        await self.kill(run)
        with trio.move_on_after(GRACE_S):
            await run.pump_done.wait()
        if not run.pump_done.is_set():
            log.warning("%s: output stream still open after kill; closing it", run.proc)
            run.channel.shutdown()

    async def kill(self, run: Run) -> None:
        sandbox = run.sandbox
        if sandbox.host_visible:
            await self._terminate(run)
        else:
            await self.kill_inside(run)

    async def _terminate(self, run: Run) -> None:
        """TERM the command's processes, KILL what is left after the grace; count both.
        Whether it is alone in its sandbox is asked at each scan (`reaper.Alone`)."""
        sandbox = run.sandbox
        await run.channel.quiesce()
        termed, killed = await reaper.terminate(
            sandbox.cgroups,
            run.proc,
            sandbox.protected,
            alone=lambda: sandbox.running <= 1,
            grace_s=GRACE_S,
            roots=_roots(run.entry),
        )
        run.reaped += termed
        run.killed += killed

    async def kill_inside(self, run: Run) -> None:
        """Under gVisor the command's processes are not host processes: the sandbox is
        stopped instead (its next command gets a fresh, verified one)."""
        await self._containers.forget(run.sandbox, "timeout")

    async def exit_code(self, run: Run) -> int | None:
        """The exit code once the main process has ended; None if the engine lost it.

        The stream usually closes as the process exits, and the first inspect has the
        code. A command can also close its output and go on running: then it is waited
        for until the deadline, and killed there (`timed_out`).
        """
        with trio.move_on_at(run.deadline):
            return await self.wait_exit(run)
        run.timed_out = True
        await self.kill(run)
        with trio.move_on_after(GRACE_S):
            return await self.wait_exit(run)
        return None

    async def wait_exit(self, run: Run) -> int | None:
        return await run.channel.wait_exit(host_visible=run.sandbox.host_visible)


def _roots(entry: Entry) -> frozenset[Hashable]:
    """The main process as the reaper's extra root (its identity), once known."""
    return frozenset() if entry.main is None else frozenset([entry.main])


def _only_protected(sandbox: Sandbox) -> bool:
    """Is every process in the sandbox's cgroup a protected one (init, keep-alive,
    supervisor, held child)? Then no command's process is left. In-memory cgroupfs: a
    read and a listing, tens of microseconds."""
    protected = sandbox.protected
    return all(pid in protected for pid in reaper.cgroup_pids(sandbox.cgroups))


def _after_exit(sandbox: Sandbox, proc: str) -> tuple[bool, int]:
    """After the main process: does anything of the command remain? And the OOM count."""
    left = sandbox.host_visible and bool(
        reaper.targets(sandbox.cgroups, proc, sandbox.protected, sandbox.running <= 1)
    )
    return left, reaper.oom_kills(sandbox.cgroups)
