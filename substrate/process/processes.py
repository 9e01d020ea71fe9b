"""Running argv-only commands in verified sandboxes (docs/protocol.md §5 `proc.run`).

Theory of operation. `Processes.run(RunRequest)` checks the request against the profile
(pure: `substrate.process.argv`), gets the verified sandbox of (workspace, profile) from
`Containers.ensure`, records the process (SQLite row and `proc.started` journal entry,
one commit), then starts exactly `argv` — no shell — through the sandbox's supervisor or
one engine exec (`substrate.process.fastexec`, docs/fast-exec.md) as the sandbox's uid:gid, in `/workspace/<cwd>`, with the profile's environment plus
`SUBSTRATE_PROC=<proc id>` (for the command's own use), in a cgroup of its own beneath
the container's (`substrate.sandbox.cmd_cgroups`): that cgroup is how
`substrate.sandbox.reaper` finds every process the command starts, and its end kills
whatever is left in it before anything concludes. `substrate.process.driver.ExecDriver` drives the exec (pumps, supervisor,
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
Each shielded step is bounded (`driver.SETTLE_S`, `GATE_WAIT_S`).

Collaborators (engine, containers, driver, records, artifacts, subscriptions, write gate)
are given, never built here: `substrate.process.service` wires them. On a `layer` sandbox
commands share a generation, applied when the last ends (`substrate.layer.LayerUsers`;
no gate).
Hot path (a warm `["true"]`): on the fast path no engine call (engine path: four, one of
them the inspect that names the exec's process for its cgroup), two
commits, one procfs scan of the container's cgroup, a few reads of its counters
(`process.usage`); the sandbox's facts are observed once per container, the command's
own process once (fast path).
"""

from __future__ import annotations

import functools
import logging
import secrets
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from substrate.artifacts.sink import OutputSink
from substrate.artifacts.store import ArtifactStore
from substrate.config import Config
from substrate.errors import Draining, LimitExceeded, RuntimeUnavailable
from substrate.fs import paths
from substrate.layer import Changesets, LayerClosed, LayerUsers, Use
from substrate.metrics import METRICS, command_outcome
from substrate.process.argv import (
    effective_timeout,
    exec_env,
    signal_of,
    validate_argv,
    workdir_for,
)
from substrate.process.driver import Entry, ExecDriver, Run
from substrate.process.fastexec import Launcher, Prepared, new_proc_id
from substrate.process.records import Outcome, ProcessRecords
from substrate.process.requests import RunRequest, WriteGate
from substrate.process.stdin_stream import StdinStream
from substrate.process.subscriptions import Subscriptions
from substrate.process.usage import Meter
from substrate.sandbox import cmd_cgroups, reaper
from substrate.sandbox.cmd_cgroups import CommandCgroup
from substrate.sandbox.containers import Containers, Sandbox
from substrate.sandbox.engine import ContainerGone, Engine
from substrate.sandbox.profiles import Profile, find_profile
from substrate.schema.proc import PolicyBlocked, ProcChanges, ProcResult
from substrate.store.hop import run_to_end
from substrate.store.journal import Journal
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate.process.processes")

__all__ = ["Processes", "RunRequest", "WriteGate"]

#: The write gate's check after a command may wait this long for its workspace's lock
#: (the walk and the reverts themselves are never interrupted).
GATE_WAIT_S = 60.0


@dataclass(frozen=True)
class _Checked:
    """A request that passed the profile's rules."""

    profile: Profile
    workdir: str  # the exec's working directory inside the sandbox
    limit_s: float  # its wall-clock limit


@dataclass(frozen=True)
class _Launched:
    """An exec created and its record committed; its start comes next."""

    req: RunRequest
    entry: Entry
    prepared: Prepared  # the engine exec created, or the command held by the supervisor
    oom_before: int  # the cgroup's OOM-kill count before the command
    t0: float  # trio clock at the record's start
    limit_s: float
    snapshot: object  # the write gate's, None when the gate does not look
    use: Use[Sandbox] | None  # its hold on a layer sandbox's generation
    meter: Meter  # its CPU and memory, from just before its start (process.usage)
    cgroup: CommandCgroup | None  # its own cgroup (None: gVisor, or none could be made)


class Processes:
    """Every command this daemon runs, and their records."""

    def __init__(
        self,
        *,
        engine: Engine,
        containers: Containers,
        driver: ExecDriver,
        records: ProcessRecords,
        artifacts: ArtifactStore,
        subscriptions: Subscriptions,
        write_gate: WriteGate | None,
        journal: Journal,
        config: Config,
        profiles: Mapping[str, Profile],
        fs_limiter: trio.CapacityLimiter | None = None,
        writer: Writer | None = None,
        changesets: Changesets | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self._engine = engine
        #: Layer sandboxes' shared generations, concluded and applied (and kept by id).
        self.layer_users: LayerUsers[Sandbox] = LayerUsers(
            containers, writer, changesets, journal, fs_limiter
        )
        if writer is not None:  # its plain writes are substrate's own to the layers
            writer.on_landed = self.layer_users.note_landed
        # Starts each command, through the sandbox's supervisor or the engine (fastexec).
        self.launcher = (
            launcher if launcher is not None else Launcher(engine, fs_limiter=fs_limiter)
        )
        self._containers = containers
        self.driver = driver
        self.records = records
        self.artifacts = artifacts
        self.subscriptions = subscriptions
        self.write_gate = write_gate
        self._journal = journal
        self._config = config
        self._profiles = profiles
        self._fs_limiter = fs_limiter
        self._running: set[str] = set()
        self._live: dict[str, Entry] = {}
        self._nursery: trio.Nursery | None = None
        #: Set by `daemon.drain`: no new command or terminal session starts.
        self.draining = False
        self._idle = trio.Event()
        self._idle.set()

    @property
    def running(self) -> int:
        return len(self._running)

    def refuse_if_draining(self) -> None:
        """`draining` while `daemon.drain` holds (docs/deployment.md "Draining a node")."""
        if self.draining:
            raise Draining("this daemon is draining: it starts no new command")

    async def drain(self, timeout_s: float) -> int:
        """Start no new command; wait up to `timeout_s` for the running ones to end.
        Returns how many still run. Never kills anything: the orchestrator's stop
        (SIGTERM) does that, bounded, after the drain."""
        self.draining = True
        with trio.move_on_after(timeout_s):
            while self._running:
                await self._idle.wait()
        return len(self._running)

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

    async def start(self, req: RunRequest) -> str:
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
                await self.run(req, on_started=on_started)
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
        this daemon run. See `ExecDriver.signal` (held signals, KILL rounds, gVisor).
        """
        entry = self._live.get(proc)
        if entry is None:
            return None
        return await self.driver.signal(entry, name)

    def mark_lost(self, epoch: int) -> int:
        """At start: records still `running` from an earlier daemon run become `lost`."""
        return self.records.mark_lost(epoch)

    async def run(
        self, req: RunRequest, *, on_started: Callable[[Entry], None] | None = None
    ) -> ProcResult:
        """Run `req.argv` to completion in the (ws, profile) sandbox; return its result.

        Refuses (before anything runs): `profile_unknown`, `argv_denied`,
        `limit_exceeded` (timeout above the profile's, or `max_processes` running),
        `path_invalid`/`symlink_refused`/`not_found`/`not_a_directory` (cwd),
        `confinement_unmet`, `image_missing`, `runtime_unavailable`. `on_started` is
        called once the engine started the exec.
        """
        self.refuse_if_draining()
        checked = await self._check(req)
        if len(self._running) >= self._config.max_processes:
            raise LimitExceeded(
                f"{self._config.max_processes} processes are running already",
                limit=self._config.max_processes,
            )
        slot = secrets.token_hex(8)
        self._running.add(slot)
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            for attempt in (1, 2):
                sandbox = await self._containers.ensure(req.ws, checked.profile)
                # The id its supervisor's spare was moved ahead for, if any: that spare
                # is then in the command's cgroup already (docs/fast-exec.md).
                claimed = self.launcher.claim(sandbox)
                proc = claimed.owner if claimed is not None else new_proc_id()
                sandbox.acquire(command=True)
                use = None
                cgroup: CommandCgroup | None = None
                try:
                    if sandbox.layer is not None:  # shares the generation mounted now
                        use = await self.layer_users.join(sandbox, proc, req)
                    # Its own cgroup: made ahead with the spare it takes, or now (a mkdir
                    # on cgroupfs, on the loop).
                    if claimed is not None:
                        cgroup = claimed
                    elif sandbox.host_visible:
                        cgroup = cmd_cgroups.make(sandbox.cgroups, proc)
                    return await self._run_in(req, checked, sandbox, proc, on_started, use, cgroup)
                except (ContainerGone, LayerClosed):
                    # Removed or stopped under us before the exec started: once more
                    # with a fresh, freshly verified container.
                    await self._containers.forget(sandbox, "gone")
                    if attempt == 2:
                        raise RuntimeUnavailable(
                            "the sandbox container keeps disappearing"
                        ) from None
                finally:
                    if cgroup is not None:  # whatever is left of the command ends with it
                        with trio.CancelScope(shield=True):
                            await cmd_cgroups.close(cgroup, limiter=self._fs_limiter)
                    if use is not None:  # a no-op once its conclusion ran
                        await self.layer_users.abandon(use)
                    sandbox.release()
            raise AssertionError("unreachable")
        finally:
            self._running.discard(slot)
            if not self._running:
                self._idle.set()

    async def _check(self, req: RunRequest) -> _Checked:
        """The profile's rules for `req` (see `run`'s refusals, up to `max_processes`)."""
        profile = find_profile(self._profiles, req.profile)
        validate_argv(req.argv, profile.argv_allow)
        limit_s = effective_timeout(req.timeout_s, profile)
        workdir = workdir_for(profile, req.cwd)
        if profile.workspace != "none":
            parts = paths.split_relpath(req.cwd, allow_root=True)
            # Held only to prove the directory is really there, beneath the root, with no
            # symlink on the way; inside the sandbox the engine resolves it again, but
            # only within the sandbox's own mount namespace. The root itself (the usual
            # cwd) is one reopen of a held fd: no thread hop for it.
            if parts:
                await trio.to_thread.run_sync(req.ws.check_dir, parts, req.cwd)
            else:
                req.ws.check_dir(parts, req.cwd)
        return _Checked(profile=profile, workdir=workdir, limit_s=limit_s)

    async def _run_in(
        self,
        req: RunRequest,
        checked: _Checked,
        sandbox: Sandbox,
        proc: str,
        on_started: Callable[[Entry], None] | None,
        use: Use[Sandbox] | None,
        cgroup: CommandCgroup | None,
    ) -> ProcResult:
        profile = sandbox.profile
        snapshot = None
        if self.write_gate is not None and profile.workspace == "rw":
            # Only an rw workspace can be written; the mounts it has read-only are not walked.
            snapshot = await self.write_gate.before(req.ws, sandbox.readonly, sandbox.init_pid)
        t0 = trio.current_time()
        # The exec is created while the record commits: two round trips overlap.
        created: list[Prepared] = []
        started: list[tuple[dict[int, OutputSink], int, Meter]] = []

        async def create() -> None:
            # The record's worker thread starts first: its commit is the longer side, and
            # what `create` does before its first wait runs on the loop meanwhile.
            await trio.lowlevel.checkpoint()
            created.append(
                await self.launcher.create(
                    sandbox,
                    req.argv,
                    user=str(sandbox.who),
                    workdir=checked.workdir,
                    environment=exec_env(profile, proc),
                    stdin=req.stdin is not None,
                    cgroup=cgroup,
                )
            )

        async def record() -> None:
            started.append(
                await run_to_end(
                    functools.partial(self._start_record, req, sandbox, proc), self._fs_limiter
                )
            )

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(create)
                nursery.start_soon(record)
        except BaseException as exc:
            self.launcher.discard(created)
            if started:
                started[0][2].close()
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._abort_record, req.ws, proc, started[0][0])
            single = _sole(exc)
            if isinstance(single, ContainerGone):
                raise ContainerGone(sandbox.id) from None  # run() retries, with a new id
            if single is not exc:
                raise single from None
            raise
        sinks, oom_before, meter = started[0]
        entry = Entry(
            proc=proc,
            workspace=req.ws.id,
            profile=profile.name,
            argv=list(req.argv),
            started=time.time(),
            sandbox=sandbox,
            sinks=sinks,
            stdin=req.stdin if isinstance(req.stdin, StdinStream) else None,
        )
        launched = _Launched(
            req=req,
            entry=entry,
            prepared=created[0],
            oom_before=oom_before,
            t0=t0,
            limit_s=checked.limit_s,
            snapshot=snapshot,
            use=use,
            meter=meter,
            cgroup=cgroup,
        )
        self._live[proc] = entry
        try:
            return await self._run_started(launched, on_started)
        finally:
            entry.ended = time.time()
            entry.channel = None  # released: nothing more is signalled through it
            self._live.pop(proc, None)
            entry.done.set()
            for held in entry.held:  # its exec never started: nothing to signal
                held.done.set()
            entry.held.clear()

    async def _run_started(
        self, launched: _Launched, on_started: Callable[[Entry], None] | None
    ) -> ProcResult:
        entry, ws = launched.entry, launched.req.ws
        entry.sandbox.code_started = True  # before it may run: docs/fast-exec.md "Under gVisor"
        try:
            channel = await self.launcher.start(launched.prepared)
        except BaseException as exc:
            # Nothing ran: the record says lost (no outcome to keep).
            launched.meter.close()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._abort_record, ws, entry.proc, entry.sinks)
            if isinstance(exc, ContainerGone):
                # The record exists now: no silent retry under the same process id.
                raise RuntimeUnavailable("the sandbox went away as the command started") from None
            raise
        entry.channel = channel
        if on_started is not None:
            on_started(entry)
        run = Run(
            entry=entry,
            proc=entry.proc,
            sandbox=entry.sandbox,
            channel=channel,
            sinks=entry.sinks,
            deadline=launched.t0 + launched.limit_s,
            cgroup=launched.cgroup,
        )
        cut_off: BaseException | None = None
        exit_code: int | None = None
        oom_after = launched.oom_before
        try:
            await self.driver.drive(run, launched.req.stdin)
            async with trio.open_nursery() as nursery:
                # The next command's held child is settled while the supervisor's report
                # of this one's exit is on its way (both are answers it sends).
                nursery.start_soon(run.channel.quiesce)
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
            try:
                if cut_off is not None:
                    exit_code, oom_after = await self.driver.settle(run, exit_code)
                if run.cgroup is not None:
                    # Nothing of the command outlives it, whatever it forged: before the
                    # gate and the layer look at what it changed.
                    await cmd_cgroups.close(run.cgroup, limiter=self._fs_limiter)
                result = await self._conclude(
                    launched, run, exit_code, oom_after, cancelled=cut_off is not None
                )
            finally:
                run.channel.release()
        if cut_off is not None:
            raise cut_off
        return result

    async def _conclude(
        self,
        launched: _Launched,
        run: Run,
        exit_code: int | None,
        oom_after: int,
        *,
        cancelled: bool,
    ) -> ProcResult:
        """Gate, outputs, record: the end of every run whose exec started. Called shielded;
        every wait in it is bounded, and the record is always finished (or, if even that
        fails, marked lost)."""
        entry, ws = run.entry, launched.req.ws
        duration_ms = round((trio.current_time() - launched.t0) * 1000, 3)
        usage = launched.meter.finish()
        if exit_code is not None:  # a program that could not be started: the shell's code
            exit_code = await run.channel.start_failed(run.sinks, run.entry.argv[0], exit_code)
        blocked = await self._gate_after(ws, launched.snapshot)
        changes = None  # a layer sandbox's change set, or deferred (docs/working-layer.md)
        if launched.use is not None:
            changes = await self.layer_users.end(launched.use)
        outcome = Outcome(
            exit_code=exit_code,
            signal=signal_of(exit_code),
            timed_out=run.timed_out,
            oom_killed=oom_after > launched.oom_before,
            duration_ms=duration_ms,
            reaped=run.reaped,
            killed=run.killed,
            cancelled=cancelled,
            egress_blocked=self.driver.egress_blocked(run),
            via=run.channel.via,
            exec_facts=run.channel.facts,
            usage=usage,
        )
        METRICS.command_finished(
            run.sandbox.profile.name,
            outcome.via or "none",
            command_outcome(
                exit_code=outcome.exit_code,
                signal=outcome.signal,
                timed_out=outcome.timed_out,
                oom_killed=outcome.oom_killed,
                cancelled=cancelled,
            ),
            duration_ms / 1000,
        )
        try:
            entry.result = await run_to_end(
                functools.partial(
                    self._finish_record, launched.req, run, outcome, blocked, changes
                ),
                self._fs_limiter,
            )
        except Exception:
            log.exception("%s: finishing the record failed; it is marked lost", run.proc)
            await trio.to_thread.run_sync(self._abort_record, ws, run.proc, run.sinks)
            raise
        return entry.result

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
        self, req: RunRequest, sandbox: Sandbox, proc: str
    ) -> tuple[dict[int, OutputSink], int, Meter]:
        """The sinks, the OOM count and the usage meter from just before the start (its
        cgroupfs reads here rather than on the event loop), once the record committed."""
        profile = sandbox.profile
        inline = self._config.inline_output_bytes
        sinks = {
            1: self.artifacts.open_sink(proc, "stdout", inline, profile.max_output_bytes),
            2: self.artifacts.open_sink(proc, "stderr", inline, profile.max_output_bytes),
        }
        self.records.started(
            workspace=req.ws.id,
            proc=proc,
            profile=profile.name,
            argv=req.argv,
            cwd=req.cwd,
            container=sandbox.id,
            actor=req.actor,
            facts=sandbox.facts,
        )
        return sinks, reaper.oom_kills(sandbox.cgroups), Meter.start(sandbox)

    def _abort_record(self, ws: Workspace, proc: str, sinks: Mapping[int, OutputSink]) -> None:
        for sink in sinks.values():
            try:
                sink.close()
            except Exception:  # the record below is what matters now
                log.exception("%s: closing an output sink failed", proc)
        self.records.lost(workspace=ws.id, proc=proc)

    def _finish_record(
        self,
        req: RunRequest,
        run: Run,
        outcome: Outcome,
        blocked: list[PolicyBlocked],
        changes: ProcChanges | None,
    ) -> ProcResult:
        stdout, stderr = run.sinks[1].close(), run.sinks[2].close()
        self.records.exited(
            workspace=req.ws.id,
            proc=run.proc,
            outcome=outcome,
            stdout=stdout,
            stderr=stderr,
            blocked=blocked,
            actor=req.actor,
            changes=changes,
        )
        return ProcResult(
            proc=run.proc,
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            timed_out=outcome.timed_out,
            oom_killed=outcome.oom_killed,
            duration_ms=outcome.duration_ms,
            stdout=stdout,
            stderr=stderr,
            facts=list(run.sandbox.facts),
            policy_blocked=blocked,
            changes=changes,
            egress_blocked=outcome.egress_blocked,
            via=run.channel.via,
            exec_facts=list(run.channel.facts),
            usage=outcome.usage,
        )


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups, else `exc`."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
