"""Running argv-only commands in verified sandboxes (SPEC §5 `proc.run`).

Theory of operation. `Processes.run` validates the request against the profile (pure:
`validate_argv`, `effective_timeout`), gets the verified sandbox of (workspace, profile)
from `Containers.ensure`, records the process (SQLite row and `proc.started` journal
entry, one commit), then makes one engine exec of exactly `argv` — no shell — as the
sandbox's uid:gid, in `/workspace/<cwd>`, with the profile's environment plus the
marker `SUBSTRATE_PROC=<proc id>` that lets `substrate.reaper` find every process the
command starts. The exec's multiplexed stream is read by one worker thread, demuxed
(`Demuxer`, sans-IO) and written to two `OutputSink`s as it arrives, so daemon memory
does not grow with output; stdin, when given, is written by another thread, then the
write half is shut so the command sees EOF.

A supervisor task watches the clock and the command:
- the stream ends (the usual case) → done;
- still open after `MAIN_PROBE_S` → ask the engine for the exec's host pid and wait on
  it (pidfd): once the main process exits, anything still holding the output pipe is a
  straggler and is reaped;
- the deadline passes → TERM to every process of the command, KILL after `GRACE_S`.
After the stream ends: exit code from the engine, stragglers reaped (a background child
that closed its output), the cgroup's OOM-kill counter compared with its value before,
then, shielded from cancellation (`_conclude`): an exec the engine could not start at
all is given the shell's code (127 not found, 126 not executable) and a message on
stderr in place of the engine's text on stdout, the write gate checks the workspace,
sinks are closed into output refs, row and `proc.exited` entry committed.

A run cut off after its exec started — its caller went away (`proc.run` on a closed
connection), the daemon stops, the engine failed — ends the same way: the supervisor
kills the command (TERM, `GRACE_S`, KILL) and lets the stream drain, then `_settle`
collects the exit code, and `_conclude` runs the gate and finishes the record with the
output it had (`cancelled` in the journal). Never left running, never recorded without
its output. Each shielded step is bounded (`SETTLE_S`, `GATE_WAIT_S`).

Signals (`Processes.signal`) go from the host to every process the reaper attributes
to the command. Right after `proc.start` the exec may not have a process yet (the engine
answers the upgrade before runc has started it): a signal that finds nothing then is
*held* on the entry, and the run delivers it as soon as the engine reports the main
process (or answers 0 if the exec ended without one).

Hot path (a warm `["true"]`): three engine calls (exec create, start, inspect), two
commits, one procfs scan of the container's cgroup. Facts are observed once per
container, never per command.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from substrate import exec_stream, paths, reaper
from substrate.artifacts import ArtifactStore
from substrate.config import Config
from substrate.containers import Containers, Sandbox
from substrate.engine import ContainerGone, Engine
from substrate.errors import (
    ArgvDenied,
    LimitExceeded,
    PathInvalid,
    ProfileUnknown,
    RuntimeUnavailable,
)
from substrate.gate import SnapshotGate
from substrate.journal import Journal
from substrate.outputs import OutputSink
from substrate.proc_records import Outcome, ProcessRecords
from substrate.profiles import Profile
from substrate.sandbox_spec import WORKSPACE_TARGET
from substrate.schema.proc import PolicyBlocked, ProcResult
from substrate.store import Store
from substrate.subscriptions import Subscriptions
from substrate.workspaces import Workspace

log = logging.getLogger("substrate.procs")

#: Seconds between TERM and KILL, on timeout and for stragglers.
GRACE_S = 2.0
#: The stream still open this long: learn the main pid so its exit is noticed even when
#: a background child holds the output pipe.
MAIN_PROBE_S = 0.25
#: Largest argv (items) and total argv bytes accepted.
MAX_ARGV_ITEMS = 4096
MAX_ARGV_BYTES = 1 << 20
#: A run cut off after its exec started: at most this long to end the command and read
#: its exit code (the kill itself takes up to `GRACE_S` plus KILL rounds).
SETTLE_S = 30.0
#: The write gate's check after a command may wait this long for its workspace's lock
#: (the walk and the reverts themselves are never interrupted).
GATE_WAIT_S = 60.0
#: The exec's own code when the engine could not start the program at all.
ENGINE_START_FAILED = 126
#: At most this much of the engine's start-failure text is read to classify it.
ENGINE_MESSAGE_BYTES = 4096


# --- pure parts ----------------------------------------------------------------------------


def validate_argv(argv: Sequence[str], allow: Sequence[str]) -> None:
    """Refuse `argv_denied`: empty, a NUL anywhere, too large, argv[0] not in `allow`."""
    if not argv:
        raise ArgvDenied("argv is empty")
    if len(argv) > MAX_ARGV_ITEMS:
        raise ArgvDenied(f"argv has more than {MAX_ARGV_ITEMS} items")
    total = 0
    for i, arg in enumerate(argv):
        if "\x00" in arg:
            raise ArgvDenied(f"argv[{i}] contains NUL", index=i)
        total += len(arg.encode("utf-8", "surrogatepass")) + 1
    if total > MAX_ARGV_BYTES:
        raise ArgvDenied(f"argv is larger than {MAX_ARGV_BYTES} bytes")
    if allow and argv[0] not in allow:
        raise ArgvDenied(
            f"argv[0] {argv[0]!r} is not in the profile's argv_allow", allowed=list(allow)
        )


def effective_timeout(requested: float | None, profile: Profile) -> float:
    """The command's wall-clock limit: the profile's, or a lower requested one.

    Refuses `limit_exceeded` for a request above the profile's (a request never weakens
    a profile).
    """
    if requested is None:
        return profile.timeout_s
    if requested > profile.timeout_s:
        raise LimitExceeded(
            f"timeout_s {requested:g} is above profile {profile.name!r}'s {profile.timeout_s:g}",
            limit=profile.timeout_s,
        )
    return requested


def workdir_for(profile: Profile, cwd: str) -> str:
    """The exec's working directory for a validated workspace-relative `cwd`."""
    parts = paths.split_relpath(cwd, allow_root=True)
    if profile.workspace == "none":
        if parts:
            raise PathInvalid(f"profile {profile.name!r} mounts no workspace: cwd must be '.'")
        return "/"
    return "/".join((WORKSPACE_TARGET, *parts))


def exec_env(profile: Profile, proc: str) -> dict[str, str]:
    """The command's whole environment: the profile's plus the reaper's marker."""
    return {**profile.env, reaper.MARKER: proc}


def start_failure(argv0: str, engine_text: bytes) -> tuple[int, str]:
    """(exit code, stderr text) for an exec the engine could not start (pure).

    The engine reports such an exec as exit 126 with its own message ("OCI runtime exec
    failed: ... executable file not found in $PATH") on *stdout*. A shell says 127 for
    a program that is not there and 126 for one that cannot be executed, on stderr,
    naming it; so does substrate (docs/execution.md).
    """
    text = engine_text.decode("utf-8", "replace").lower()
    name = argv0[:256]
    if "permission denied" in text:
        return 126, f"substrate: {name}: permission denied\n"
    if "not found" in text or "no such file or directory" in text:
        why = "no such file or directory" if "/" in argv0 else "command not found"
        return 127, f"substrate: {name}: {why}\n"
    return ENGINE_START_FAILED, f"substrate: {name}: could not be started\n"


def signal_of(exit_code: int | None) -> str | None:
    """The signal name the engine's `128 + n` exit code stands for, if any.

    The engine reports a signal death as 128 + n, the way a shell does; a process that
    calls `exit(137)` looks the same (docs/execution.md).
    """
    if exit_code is None or not 128 < exit_code < 128 + 65:
        return None
    try:
        return signal.Signals(exit_code - 128).name.removeprefix("SIG")
    except ValueError:
        return None


# --- the write gate hook (issue 4) ------------------------------------------------------------


class WriteGate(Protocol):
    """Checks what a command wrote against the workspace's file-level deny globs.

    `before` snapshots the workspace as the command starts (`readonly`: the paths the
    sandbox has mounted read-only, with their identities: not walked); `after` compares,
    reverts each offending change and returns them. Implemented by
    `substrate.gate.SnapshotGate`.
    """

    async def before(
        self, ws: Workspace, readonly: Mapping[str, tuple[int, int]] | None = None
    ) -> object: ...

    async def after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]: ...


# --- running -----------------------------------------------------------------------------------


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
    #: (host pid, start ticks) of the main process, once the engine reported it: it is
    #: the command's even if it scrubbed its environment (no marker).
    main: tuple[int, int] | None = None
    #: The engine reported the main process (or the exec's end): a signal that finds
    #: nothing after this is answered 0, never held.
    appeared: bool = False
    held: list[HeldSignal] = field(default_factory=list)
    held_added: trio.Event = field(default_factory=trio.Event)

    @property
    def state(self) -> str:
        if not self.done.is_set():
            return "running"
        return "exited" if self.result is not None else "lost"


@dataclass
class _Run:
    """The state of one running command, shared by its tasks."""

    entry: Entry
    proc: str
    sandbox: Sandbox
    exec_id: str
    sock: socket.socket
    initial: bytes
    sinks: dict[int, OutputSink]
    deadline: float
    pump_done: trio.Event = field(default_factory=trio.Event)
    main_exited: bool = False
    timed_out: bool = False
    reaped: int = 0
    killed: int = 0


class Processes:
    """Every command this daemon runs, and their records."""

    def __init__(
        self,
        *,
        engine: Engine,
        containers: Containers,
        artifacts: ArtifactStore,
        store: Store,
        journal: Journal,
        config: Config,
        profiles: Mapping[str, Profile],
        fs_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._engine = engine
        self._journal = journal
        self._containers = containers
        self._artifacts = artifacts
        self.artifacts = artifacts
        self._config = config
        self._profiles = profiles
        self._fs_limiter = fs_limiter
        # Output pumps hold a thread for the life of a command: their own limiter, so
        # long commands can never starve the engine's or the filesystem's threads.
        self._pump_limiter = trio.CapacityLimiter(max(2, 2 * config.max_processes))
        self._running: set[str] = set()
        self._live: dict[str, Entry] = {}
        self._nursery: trio.Nursery | None = None
        self.subscriptions = Subscriptions()
        self.write_gate: WriteGate | None = SnapshotGate(
            config.state_path() / "gate", journal, limiter=fs_limiter
        )
        self.records = ProcessRecords(store, journal)

    @property
    def running(self) -> int:
        return len(self._running)

    def profile(self, name: str) -> Profile:
        found = self._profiles.get(name)
        if found is None:
            raise ProfileUnknown(f"no profile {name!r}", profiles=sorted(self._profiles))
        return found

    @property
    def nursery(self) -> trio.Nursery:
        """Where started processes and subscriptions run; `runtime_unavailable` before
        `serve` started (or after it ended)."""
        if self._nursery is None:
            raise RuntimeUnavailable("the execution layer is not serving")
        return self._nursery

    def live(self, proc: str) -> Entry | None:
        """The running command `proc` of this daemon run, if it is one."""
        return self._live.get(proc)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Service task: holds the nursery of started processes and subscriptions.

        Cancelled (the daemon stops): every started process is cancelled like an
        interrupted `proc.run` (its record becomes `lost`), every subscription ends.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def start(
        self,
        ws: Workspace,
        profile_name: str,
        argv: Sequence[str],
        *,
        cwd: str = ".",
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        actor: str = "daemon",
    ) -> str:
        """`proc.start`: like `run`, but answer the process id once the exec started.

        Same refusals as `run`, raised here; the command then runs on in the service
        nursery, detached from the caller (a closing connection never kills it).
        """
        nursery = self.nursery

        async def background(*, task_status: trio.TaskStatus[str]) -> None:
            started = False

            def on_started(entry: Entry) -> None:
                nonlocal started
                started = True
                task_status.started(entry.proc)

            try:
                await self.run(
                    ws,
                    profile_name,
                    argv,
                    cwd=cwd,
                    stdin=stdin,
                    timeout_s=timeout_s,
                    actor=actor,
                    on_started=on_started,
                )
            except Exception:
                if not started:
                    raise
                # The record says lost already (`_abort_record`); nobody awaits us.
                log.exception("a started process failed")

        proc: str = await nursery.start(background)
        return proc

    async def signal(self, proc: str, name: str) -> int | None:
        """`proc.signal`: send INT/TERM/KILL to every process of the running command.

        Returns how many processes were signalled, or None when `proc` is not running in
        this daemon run. KILL goes in rounds with the cgroup frozen (a forking command
        cannot outrun it). A signal that finds no process before the engine reported the
        main one is held and delivered by the run as soon as it is (this call waits for
        that); 0 means the command had no process left. Under gVisor the command's
        processes are not host processes: TERM and KILL remove the whole sandbox (every
        command in it ends), INT is sent to nothing (0).
        """
        entry = self._live.get(proc)
        if entry is None:
            return None
        sandbox = entry.sandbox
        if not sandbox.host_visible:
            if name == "INT":
                return 0
            await self._containers.forget(sandbox, "signal")
            return 1
        delivered = await self._send(entry, name)
        if delivered or entry.appeared or entry.done.is_set():
            return delivered
        held = HeldSignal(name)
        entry.held.append(held)
        entry.held_added.set()
        await held.done.wait()
        return held.delivered

    async def _send(self, entry: Entry, name: str) -> int:
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

    async def _release_held(self, run: _Run) -> None:
        """Deliver held signals once the engine reports the main process (run task)."""
        entry = run.entry
        while True:
            await entry.held_added.wait()
            entry.held_added = trio.Event()
            await self._learn_main(run, first_sleep=0.005)
            await self._deliver_held(entry)

    async def _learn_main(self, run: _Run, *, first_sleep: float) -> int | None:
        """Wait until the engine reports the exec's main process (or its end); record it
        on the entry. Returns its host pid, None once the exec ended without one."""
        pid = await self._started_pid(run.exec_id, first_sleep=first_sleep)
        entry = run.entry
        if pid is not None and entry.main is None:
            info = await trio.to_thread.run_sync(reaper.read_proc, pid)
            if info is not None:
                entry.main = (pid, info.start)
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
                    held.delivered = await self._send(entry, held.name)
            finally:
                held.done.set()

    def mark_lost(self, epoch: int) -> int:
        """At start: records still `running` from an earlier daemon run become `lost`."""
        return self.records.mark_lost(epoch)

    async def run(
        self,
        ws: Workspace,
        profile_name: str,
        argv: Sequence[str],
        *,
        cwd: str = ".",
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        actor: str = "daemon",
        on_started: Callable[[Entry], None] | None = None,
    ) -> ProcResult:
        """Run `argv` to completion in the (ws, profile) sandbox; return its result.

        Refuses (before anything runs): `profile_unknown`, `argv_denied`,
        `limit_exceeded` (timeout above the profile's, or `max_processes` running),
        `path_invalid`/`symlink_refused`/`not_found`/`not_a_directory` (cwd),
        `confinement_unmet`, `image_missing`, `runtime_unavailable`.
        """
        profile = self.profile(profile_name)
        validate_argv(argv, profile.argv_allow)
        timeout = effective_timeout(timeout_s, profile)
        workdir = workdir_for(profile, cwd)
        if profile.workspace != "none":
            parts = paths.split_relpath(cwd, allow_root=True)
            # Held only to prove the directory is really there, beneath the root, with no
            # symlink on the way; inside the sandbox the engine resolves it again, but
            # only within the sandbox's own mount namespace.
            await trio.to_thread.run_sync(_check_dir, ws.root_fd, parts, cwd)
        if len(self._running) >= self._config.max_processes:
            raise LimitExceeded(
                f"{self._config.max_processes} processes are running already",
                limit=self._config.max_processes,
            )
        slot = secrets.token_hex(8)
        self._running.add(slot)
        try:
            for attempt in (1, 2):
                proc = "p_" + secrets.token_hex(8)
                sandbox = await self._containers.ensure(ws, profile)
                sandbox.acquire()
                try:
                    return await self._run_in(
                        sandbox, ws, proc, argv, workdir, cwd, stdin, timeout, actor, on_started
                    )
                except ContainerGone:
                    # Removed or stopped under us before the exec started: once more
                    # with a fresh, freshly verified container.
                    await self._containers.forget(sandbox, "gone")
                    if attempt == 2:
                        raise RuntimeUnavailable(
                            "the sandbox container keeps disappearing"
                        ) from None
                finally:
                    sandbox.release()
            raise AssertionError("unreachable")
        finally:
            self._running.discard(slot)

    async def _run_in(
        self,
        sandbox: Sandbox,
        ws: Workspace,
        proc: str,
        argv: Sequence[str],
        workdir: str,
        cwd: str,
        stdin: bytes | None,
        limit_s: float,
        actor: str,
        on_started: Callable[[Entry], None] | None,
    ) -> ProcResult:
        profile = sandbox.profile
        snapshot = None
        if self.write_gate is not None and profile.workspace == "rw":
            # Only an rw workspace can be written; the mounts it has read-only are not walked.
            snapshot = await self.write_gate.before(ws, sandbox.readonly)
        t0 = trio.current_time()
        # The exec is created while the record commits: two round trips overlap.
        created: list[str] = []
        started: list[tuple[dict[int, OutputSink], int]] = []

        async def create() -> None:
            created.append(
                await self._engine.exec_create(
                    sandbox.id,
                    argv,
                    user=str(sandbox.who),
                    workdir=workdir,
                    environment=exec_env(profile, proc),
                    stdin=stdin is not None,
                )
            )

        async def record() -> None:
            started.append(
                await trio.to_thread.run_sync(
                    self._start_record,
                    ws,
                    sandbox,
                    proc,
                    argv,
                    cwd,
                    actor,
                    limiter=self._fs_limiter,
                )
            )

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(create)
                nursery.start_soon(record)
        except BaseException as exc:
            if started:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._abort_record, ws, proc, started[0][0])
            single = _sole(exc)
            if isinstance(single, ContainerGone):
                raise ContainerGone(sandbox.id) from None  # run() retries, with a new id
            if single is not exc:
                raise single from None
            raise
        exec_id = created[0]
        sinks, oom_before = started[0]
        entry = Entry(
            proc=proc,
            workspace=ws.id,
            profile=profile.name,
            argv=list(argv),
            started=time.time(),
            sandbox=sandbox,
            sinks=sinks,
        )
        self._live[proc] = entry
        try:
            return await self._run_started(
                entry, ws, exec_id, oom_before, t0, limit_s, snapshot, stdin, actor, on_started
            )
        finally:
            entry.ended = time.time()
            self._live.pop(proc, None)
            entry.done.set()
            for held in entry.held:  # its exec never started: nothing to signal
                held.done.set()
            entry.held.clear()

    async def _run_started(
        self,
        entry: Entry,
        ws: Workspace,
        exec_id: str,
        oom_before: int,
        t0: float,
        limit_s: float,
        snapshot: object,
        stdin: bytes | None,
        actor: str,
        on_started: Callable[[Entry], None] | None,
    ) -> ProcResult:
        proc, sandbox, sinks = entry.proc, entry.sandbox, entry.sinks
        try:
            stream = await self._engine.exec_start(exec_id)
        except BaseException as exc:
            # Nothing ran: the record says lost (no outcome to keep).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._abort_record, ws, proc, sinks)
            if isinstance(exc, ContainerGone):
                # The record exists now: no silent retry under the same process id.
                raise RuntimeUnavailable("the sandbox went away as the command started") from None
            raise
        if on_started is not None:
            on_started(entry)
        run = _Run(
            entry=entry,
            proc=proc,
            sandbox=sandbox,
            exec_id=exec_id,
            sock=stream.sock,
            initial=stream.initial,
            sinks=sinks,
            deadline=t0 + limit_s,
        )
        cut_off: BaseException | None = None
        exit_code: int | None = None
        oom_after = oom_before
        try:
            await self._drive(run, stdin)
            exit_code = await self._exit_code(run)
            if exit_code is None and run.timed_out:
                # Killed with its whole sandbox (gVisor): the engine lost the code.
                exit_code = 128 + signal.SIGKILL
            oom_after = await self._reap_stragglers(run)
        except BaseException as exc:
            # Cancelled (its caller went away, the daemon stops) or the engine failed:
            # the command is ended below and its record finished, then this re-raised.
            cut_off = exc
        with trio.CancelScope(shield=True):
            if cut_off is not None:
                exit_code, oom_after = await self._settle(run, exit_code)
            result = await self._conclude(
                run, ws, exit_code, oom_before, oom_after, t0, snapshot, actor, cut_off is not None
            )
        if cut_off is not None:
            raise cut_off
        return result

    async def _reap_stragglers(self, run: _Run) -> int:
        """After the main process: reap what it left behind; return the OOM-kill count."""
        sandbox = run.sandbox
        alone = sandbox.running <= 1
        stragglers, oom_after = await trio.to_thread.run_sync(
            _after_exit, sandbox, run.proc, alone, limiter=self._fs_limiter
        )
        if stragglers:
            termed, killed = await reaper.terminate(
                sandbox.cgroups,
                run.proc,
                sandbox.protected,
                alone=alone,
                grace_s=GRACE_S,
                roots=_roots(run.entry),
            )
            run.reaped += termed
            run.killed += killed
        return oom_after

    async def _settle(self, run: _Run, exit_code: int | None) -> tuple[int | None, int]:
        """A run cut off after its exec started: end whatever of the command is left and
        read its exit code (bounded by `SETTLE_S`); return (exit code, OOM-kill count).
        Called shielded."""
        sandbox = run.sandbox
        if not run.pump_done.is_set():  # cut off before its stream was driven at all
            exec_stream.shutdown(run.sock)
            run.sock.close()
        with trio.move_on_after(SETTLE_S):
            if sandbox.host_visible:
                await self._kill(run)  # targeted: one scan when nothing is left
            elif exit_code is None:
                try:
                    info = await self._engine.exec_inspect(run.exec_id)
                except ContainerGone:
                    info = {}
                if info.get("Running"):
                    await self._kill_inside(run)
            if exit_code is None:
                with trio.move_on_after(GRACE_S):
                    exit_code = await self._wait_exit(run)
        oom_after = await trio.to_thread.run_sync(
            reaper.oom_kills, sandbox.cgroups, limiter=self._fs_limiter
        )
        return exit_code, oom_after

    async def _conclude(
        self,
        run: _Run,
        ws: Workspace,
        exit_code: int | None,
        oom_before: int,
        oom_after: int,
        t0: float,
        snapshot: object,
        actor: str,
        cancelled: bool,
    ) -> ProcResult:
        """Gate, outputs, record: the end of every run whose exec started. Called shielded;
        every wait in it is bounded, and the record is always finished (or, if even that
        fails, marked lost)."""
        entry, sinks = run.entry, run.sinks
        duration_ms = round((trio.current_time() - t0) * 1000, 3)
        if exit_code == ENGINE_START_FAILED:
            exit_code = await self._start_failed(run, exit_code)
        blocked = await self._gate_after(ws, snapshot)
        outcome = Outcome(
            exit_code=exit_code,
            signal=signal_of(exit_code),
            timed_out=run.timed_out,
            oom_killed=oom_after > oom_before,
            duration_ms=duration_ms,
            reaped=run.reaped,
            killed=run.killed,
            cancelled=cancelled,
        )
        try:
            entry.result = await trio.to_thread.run_sync(
                self._finish_record,
                ws,
                run.proc,
                run.sandbox,
                outcome,
                sinks,
                blocked,
                actor,
                limiter=self._fs_limiter,
            )
        except Exception:
            log.exception("%s: finishing the record failed; it is marked lost", run.proc)
            await trio.to_thread.run_sync(self._abort_record, ws, run.proc, sinks)
            raise
        return entry.result

    async def _start_failed(self, run: _Run, exit_code: int) -> int:
        """Exit 126 from an exec that never had a process: the engine could not start the
        program. Its message (on stdout) becomes the shell's code and a line on stderr."""
        try:
            info = await self._engine.exec_inspect(run.exec_id)
        except ContainerGone:
            return exit_code
        if int(info.get("Pid") or 0) != 0:
            return exit_code  # it ran, and exited 126 itself
        sinks = run.sinks
        argv0 = run.entry.argv[0]

        def rewrite() -> int:
            code, message = start_failure(argv0, sinks[1].read_at(0, ENGINE_MESSAGE_BYTES))
            for sink in sinks.values():
                sink.rewind()
            sinks[2].write(message.encode("utf-8", "surrogateescape"))
            return code

        return await trio.to_thread.run_sync(rewrite, limiter=self._fs_limiter)

    async def _gate_after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]:
        """The write gate's check, bounded by `GATE_WAIT_S`; a failure is journalled
        (`policy.gate_failed`) and reported as nothing blocked, never left unfinished."""
        if self.write_gate is None or snapshot is None:
            return []
        reason = "timeout"
        with trio.move_on_after(GATE_WAIT_S):
            try:
                return await self.write_gate.after(ws, snapshot)
            except Exception as exc:
                log.exception("write gate check of %s failed", ws.root_id)
                reason = type(exc).__name__
        await trio.to_thread.run_sync(
            functools.partial(
                self._journal.append, "policy.gate_failed", {"reason": reason}, workspace=ws.id
            )
        )
        return []

    # -- driving one exec -----------------------------------------------------------------

    async def _drive(self, run: _Run, stdin: bytes | None) -> None:
        """Pump output (and stdin) until the stream ends; supervise timeout and exit;
        deliver held signals. Cancelled, it kills the command and drains its stream
        before it returns (see `_supervise`): the pump thread is never abandoned, so
        nothing writes to a sink after the run closed it."""
        try:
            async with trio.open_nursery() as signals:
                signals.start_soon(self._release_held, run)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, run)
                    if stdin is not None:
                        nursery.start_soon(
                            trio.to_thread.run_sync, exec_stream.feed_stdin, run.sock, stdin, True
                        )
                    nursery.start_soon(self._supervise, run)
                signals.cancel_scope.cancel()
        finally:
            exec_stream.shutdown(run.sock)
            run.sock.close()
            with trio.CancelScope(shield=True):
                await self._release_remaining(run.entry)

    async def _pump(self, run: _Run) -> None:
        try:
            # Not abandoned on cancel: the run ends the command (or shuts the socket) and
            # this returns once every byte it read is in the sinks.
            await trio.to_thread.run_sync(
                exec_stream.pump_stream,
                run.sock,
                run.initial,
                run.sinks,
                limiter=self._pump_limiter,
            )
        finally:
            run.pump_done.set()

    async def _supervise(self, run: _Run) -> None:
        try:
            await self._watch(run)
        except BaseException:
            # Cut off (cancelled, or a failure here): the command must not outlive its
            # run. End it, let its stream drain, shut the stream; bounded.
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + SETTLE_S
                if not run.pump_done.is_set():
                    await self._kill(run)
                    with trio.move_on_after(GRACE_S):
                        await run.pump_done.wait()
            if not run.pump_done.is_set():
                log.warning("%s: output stream still open after kill; closing it", run.proc)
                exec_stream.shutdown(run.sock)
            raise

    async def _watch(self, run: _Run) -> None:
        sandbox = run.sandbox
        with trio.move_on_at(run.deadline):
            with trio.move_on_after(MAIN_PROBE_S):
                await run.pump_done.wait()
            if run.pump_done.is_set():
                return
            if sandbox.host_visible:
                # Still streaming: watch the main process itself, so a background child
                # holding the output pipe cannot keep the command "running".
                pid = await self._learn_main(run, first_sleep=0.05)
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
                    termed, killed = await reaper.terminate(
                        sandbox.cgroups,
                        run.proc,
                        sandbox.protected,
                        alone=sandbox.running <= 1,
                        grace_s=GRACE_S,
                        roots=_roots(run.entry),
                    )
                    run.reaped += termed
                    run.killed += killed
            # Under gVisor the engine itself closes the stream soon after the main exits.
            await run.pump_done.wait()
        if run.pump_done.is_set():
            return
        run.timed_out = not run.main_exited
        await self._kill(run)
        with trio.move_on_after(GRACE_S):
            await run.pump_done.wait()
        if not run.pump_done.is_set():
            log.warning("%s: output stream still open after kill; closing it", run.proc)
            exec_stream.shutdown(run.sock)

    async def _kill(self, run: _Run) -> None:
        sandbox = run.sandbox
        if sandbox.host_visible:
            termed, killed = await reaper.terminate(
                sandbox.cgroups,
                run.proc,
                sandbox.protected,
                alone=sandbox.running <= 1,
                grace_s=GRACE_S,
                roots=_roots(run.entry),
            )
            run.reaped += termed
            run.killed += killed
        else:
            await self._kill_inside(run)

    async def _kill_inside(self, run: _Run) -> None:
        """Under gVisor the command's processes are not host processes: the sandbox is
        stopped instead (its next command gets a fresh, verified one)."""
        await self._containers.forget(run.sandbox, "timeout")

    async def _started_pid(self, exec_id: str, *, first_sleep: float = 0.05) -> int | None:
        """The exec's host pid once it runs; None once it has exited (or vanished).

        An exec the engine has not started yet also reads `Running: false`, but with no
        exit code: that one is asked again, after `first_sleep`, then twice as long each
        time up to 1 s (a slow engine can take longer than `MAIN_PROBE_S` to start a
        process). The engine reports the pid once runc has exec'd the program.
        """
        for attempt in itertools.count():
            try:
                info = await self._engine.exec_inspect(exec_id)
            except ContainerGone:
                return None
            pid = int(info.get("Pid") or 0)
            if info.get("Running") and pid > 0:
                return pid
            if not info.get("Running") and info.get("ExitCode") is not None:
                return None
            await trio.sleep(min(first_sleep * 2**attempt, 1.0))
        raise AssertionError("unreachable")

    async def _exit_code(self, run: _Run) -> int | None:
        """The exit code once the main process has ended; None if the engine lost it.

        The stream usually closes as the process exits, and the first inspect has the
        code. A command can also close its output and go on running: then it is waited
        for until the deadline, and killed there (`timed_out`).
        """
        with trio.move_on_at(run.deadline):
            return await self._wait_exit(run)
        run.timed_out = True
        await self._kill(run)
        with trio.move_on_after(GRACE_S):
            return await self._wait_exit(run)
        return None

    async def _wait_exit(self, run: _Run) -> int | None:
        for attempt in itertools.count():
            try:
                info = await self._engine.exec_inspect(run.exec_id)
            except ContainerGone:
                return None
            if not info.get("Running"):
                code = info.get("ExitCode")
                # Not running and no code yet: the engine is still recording the exit.
                if code is not None or attempt >= 8:
                    return int(code) if code is not None else None
            elif run.sandbox.host_visible and int(info.get("Pid") or 0) > 0:
                await reaper.wait_exit(int(info["Pid"]))  # it closed its output: wait on it
                continue
            await trio.sleep(min(0.005 * 2**attempt, 0.5))
        raise AssertionError("unreachable")

    # -- records (blocking; worker threads) -------------------------------------------------

    def _start_record(
        self,
        ws: Workspace,
        sandbox: Sandbox,
        proc: str,
        argv: Sequence[str],
        cwd: str,
        actor: str,
    ) -> tuple[dict[int, OutputSink], int]:
        profile = sandbox.profile
        inline = self._config.inline_output_bytes
        sinks = {
            1: self._artifacts.open_sink(proc, "stdout", inline, profile.max_output_bytes),
            2: self._artifacts.open_sink(proc, "stderr", inline, profile.max_output_bytes),
        }
        self.records.started(
            workspace=ws.id,
            proc=proc,
            profile=profile.name,
            argv=argv,
            cwd=cwd,
            container=sandbox.id,
            actor=actor,
            facts=sandbox.facts,
        )
        return sinks, reaper.oom_kills(sandbox.cgroups)

    def _abort_record(self, ws: Workspace, proc: str, sinks: Mapping[int, OutputSink]) -> None:
        for sink in sinks.values():
            try:
                sink.close()
            except Exception:  # the record below is what matters now
                log.exception("%s: closing an output sink failed", proc)
        self.records.lost(workspace=ws.id, proc=proc)

    def _finish_record(
        self,
        ws: Workspace,
        proc: str,
        sandbox: Sandbox,
        outcome: Outcome,
        sinks: Mapping[int, OutputSink],
        blocked: list[PolicyBlocked],
        actor: str,
    ) -> ProcResult:
        stdout, stderr = sinks[1].close(), sinks[2].close()
        self.records.exited(
            workspace=ws.id,
            proc=proc,
            outcome=outcome,
            stdout=stdout,
            stderr=stderr,
            blocked=blocked,
            actor=actor,
        )
        return ProcResult(
            proc=proc,
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            timed_out=outcome.timed_out,
            oom_killed=outcome.oom_killed,
            duration_ms=outcome.duration_ms,
            stdout=stdout,
            stderr=stderr,
            facts=list(sandbox.facts),
            policy_blocked=blocked,
        )


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups, else `exc`."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _roots(entry: Entry) -> dict[int, int]:
    """The main process as the reaper's extra root (pid → start ticks), once known."""
    return dict([entry.main]) if entry.main is not None else {}


def _after_exit(sandbox: Sandbox, proc: str, alone: bool) -> tuple[bool, int]:
    """After the main process: does anything of the command remain? And the OOM count."""
    left = sandbox.host_visible and bool(
        reaper.targets(sandbox.cgroups, proc, sandbox.protected, alone)
    )
    return left, reaper.oom_kills(sandbox.cgroups)


def _check_dir(root_fd: int, parts: tuple[str, ...], where: str) -> None:
    os.close(paths.open_dir(root_fd, parts, where))
