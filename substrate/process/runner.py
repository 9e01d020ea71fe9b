"""Running argv-only commands in verified sandboxes (SPEC §5 `proc.run`).

Theory of operation. `Processes.run` validates the request against the profile (pure:
`validate_argv`, `effective_timeout`), gets the verified sandbox of (workspace, profile)
from `Containers.ensure`, records the process (SQLite row and `proc.started` journal
entry, one commit), then makes one engine exec of exactly `argv` — no shell — as the
sandbox's uid:gid, in `/workspace/<cwd>`, with the profile's environment plus the
marker `SUBSTRATE_PROC=<proc id>` that lets `substrate.sandbox.reaper` find every process the
command starts. `substrate.process.driver.ExecDriver` drives the exec (pumps, supervisor,
timeout, signals, the kill) until its main process has ended and its stream is drained.

Then the stragglers are reaped (a background child that closed its output), the cgroup's
OOM-kill counter compared with its value before, and, shielded from cancellation
(`_conclude`): an exec the engine could not start at all is given the shell's code (127
not found, 126 not executable) and a message on stderr in place of the engine's text on
stdout, the write gate checks the workspace, sinks are closed into output refs, row and
`proc.exited` entry committed.

A run cut off after its exec started — its caller went away (`proc.run` on a closed
connection), the daemon stops, the engine failed — ends the same way: the driver kills
the command (TERM, grace, KILL) and drains its stream, `settle` collects the exit code,
and `_conclude` runs the gate and finishes the record with the output it had
(`cancelled` in the journal). Never left running, never recorded without its output.
Each shielded step is bounded (`exec_driver.SETTLE_S`, `GATE_WAIT_S`).

Hot path (a warm `["true"]`): three engine calls (exec create, start, inspect), two
commits, one procfs scan of the container's cgroup. Facts are observed once per
container, never per command.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import trio

from substrate.artifacts.sink import OutputSink
from substrate.artifacts.store import ArtifactStore
from substrate.config import Config
from substrate.errors import (
    ArgvDenied,
    LimitExceeded,
    PathInvalid,
    ProfileUnknown,
    RuntimeUnavailable,
)
from substrate.process.driver import Entry, ExecDriver, Run
from substrate.process.records import Outcome, ProcessRecords
from substrate.process.subscriptions import Subscriptions
from substrate.sandbox import reaper
from substrate.sandbox.containers import Containers, Sandbox
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import WORKSPACE_TARGET
from substrate.schema.proc import PolicyBlocked, ProcResult
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import paths
from substrate.workspace.gate import SnapshotGate
from substrate.workspace.registry import Workspace

log = logging.getLogger("substrate.process.runner")

__all__ = ["Entry", "Processes", "WriteGate"]

#: Largest argv (items) and total argv bytes accepted.
MAX_ARGV_ITEMS = 4096
MAX_ARGV_BYTES = 1 << 20
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
    `substrate.workspace.gate.SnapshotGate`.
    """

    async def before(
        self, ws: Workspace, readonly: Mapping[str, tuple[int, int]] | None = None
    ) -> object: ...

    async def after(self, ws: Workspace, snapshot: object) -> list[PolicyBlocked]: ...


# --- running -----------------------------------------------------------------------------------


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
        self.driver = ExecDriver(
            engine,
            containers,
            pump_limiter=trio.CapacityLimiter(max(2, 2 * config.max_processes)),
            fs_limiter=fs_limiter,
        )
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
                # Its record is finished (or lost, if it never ran); nobody awaits us.
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
        return await self.driver.signal(entry, name)

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
        run = Run(
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
            await self.driver.drive(run, stdin)
            exit_code = await self.driver.exit_code(run)
            if exit_code is None and run.timed_out:
                # Killed with its whole sandbox (gVisor): the engine lost the code.
                exit_code = 128 + signal.SIGKILL
            oom_after = await self.driver.reap_stragglers(run)
        except BaseException as exc:
            # Cancelled (its caller went away, the daemon stops) or the engine failed:
            # the command is ended below and its record finished, then this re-raised.
            cut_off = exc
        with trio.CancelScope(shield=True):
            if cut_off is not None:
                exit_code, oom_after = await self.driver.settle(run, exit_code)
            result = await self._conclude(
                run, ws, exit_code, oom_before, oom_after, t0, snapshot, actor, cut_off is not None
            )
        if cut_off is not None:
            raise cut_off
        return result

    async def _conclude(
        self,
        run: Run,
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

    async def _start_failed(self, run: Run, exit_code: int) -> int:
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


def _check_dir(root_fd: int, parts: tuple[str, ...], where: str) -> None:
    os.close(paths.open_dir(root_fd, parts, where))
