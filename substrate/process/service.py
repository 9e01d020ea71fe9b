"""The execution layer of one daemon: engine, profiles, sandboxes, processes, artifacts.

`Execution(...)` is built by the daemon at start (profiles and seccomp policies are
loaded and validated then: a bad file stops the daemon with its name and key). `run`
is a service task started in the daemon's nursery: it removes what a previous run of
this daemon left in the engine, marks its unfinished process records `lost`, then
removes idle sandboxes now and then. `shutdown` removes this run's sandboxes.

An engine that does not answer at start is not fatal: `daemon.status` says so, and
every command is refused `runtime_unavailable` until it answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from substrate.artifacts.store import ArtifactStore
from substrate.config import Config
from substrate.egress import EgressProxy
from substrate.errors import Refusal
from substrate.fs.state import StatePaths
from substrate.layer import (
    ArtifactKeeper,
    Changesets,
    drop_unconcluded,
    finish_applying,
    fresh_view,
    sandbox_dirs,
)
from substrate.process.driver import ExecDriver
from substrate.process.fastexec import Launcher
from substrate.process.processes import Processes
from substrate.process.profile_registry import ProfileRegistry
from substrate.process.records import ProcessRecords
from substrate.process.subscriptions import Subscriptions
from substrate.sandbox.containers import Containers, daemon_id_for
from substrate.sandbox.docker_engine import DockerEngine
from substrate.sandbox.engine import Engine
from substrate.sandbox.pool import WarmPool
from substrate.sandbox.profiles import Profile, find_profile, load_profiles
from substrate.sandbox.proxy_link import ProxyLinks
from substrate.sandbox.supervisor.supervisors import Supervisors
from substrate.schema.journal import EngineStatus, FreshViewStatus
from substrate.secrets import SecretStore
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.gate import SnapshotGate
from substrate.workspace.homes import Homes
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate.process.service")

#: How often idle sandboxes are looked for, at most (seconds).
IDLE_SWEEP_S = 30.0
#: At shutdown, how long the users of layer sandboxes (terminals, cut-off commands) get
#: to end and conclude their generations before the sandboxes go (seconds). Each ends
#: within `pty.terminals` `terminate_timeout_s` (10 s) plus its conclusion; what has not
#: ended by then is kept for review (`LayerUsers.keep_left`).
SHUTDOWN_DRAIN_S = 30.0


class Execution:
    """Everything that runs commands; the daemon hands its parts to the handlers."""

    def __init__(
        self,
        config: Config,
        store: Store,
        journal: Journal,
        state_dir: Path,
        *,
        fs_limiter: trio.CapacityLimiter | None = None,
        engine: Engine | None = None,
        writer: Writer | None = None,
        egress: EgressProxy | None = None,
        homes: Homes | None = None,
    ) -> None:
        self.config = config
        self.journal = journal
        state = StatePaths(state_dir)
        self.profiles: dict[str, Profile] = load_profiles(
            Path(config.profiles_dir), Path(config.seccomp_dir)
        )
        self.engine: Engine = engine if engine is not None else DockerEngine()
        self.daemon_id = daemon_id_for(state_dir)
        #: Operator secrets (`substrate secret set`) and the workspaces' persistent homes.
        self.secrets = SecretStore(state_dir)
        self.homes = (
            homes if homes is not None else Homes(state_dir, quota_bytes=config.home_quota_bytes)
        )
        self._warn_missing_secrets()
        self.artifacts = ArtifactStore(
            store,
            state.artifacts,
            quota_bytes=config.artifact_quota_bytes,
            max_age_s=config.artifact_max_age_s,
        )
        # Each sandbox's own supervisor (docs/fast-exec.md); a previous run's directories go.
        self.supervisors: Supervisors | None = None
        if config.fast_exec:
            self.supervisors = Supervisors(
                self.engine, journal, state.supervisor, fs_limiter=fs_limiter
            )
            self.supervisors.sweep()
        self.containers = Containers(
            self.engine,
            journal,
            daemon_id=self.daemon_id,
            epoch=journal.epoch,
            seccomp_dir=Path(config.seccomp_dir),
            idle_s=config.container_idle_s,
            fs_limiter=fs_limiter,
            files_dir=state.sandbox_files,
            state_dir=str(state_dir),
            homes=self.homes,
            secrets=self.secrets,
            # Without the daemon's proxy, "egress" profiles are refused.
            egress=None
            if egress is None
            else ProxyLinks(
                egress,
                journal,
                files_dir=state.sandbox_files,
                limiter=fs_limiter,
                secrets=self.secrets,
            ),
            supervisors=self.supervisors,
        )
        #: Each checkout's git layer (docs/working-layer.md, "The git layer").
        self.git_layers = self.containers.layer_mounts.git_layers
        #: Warm sandboxes per profile (docs/execution.md, "The warm pool").
        self.pool = WarmPool(
            self.containers,
            config.warm_sandboxes,
            self.profiles,
            state_dir=str(state_dir),
            adopt_roots=config.adopt_roots,
            fs_limiter=fs_limiter,
        )
        if self.pool:
            self.containers.pool = self.pool
        #: The profiles in force with their digests (`profile.*`, SIGHUP's reload, which
        #: retires sandboxes here); its dict is `profiles`, the one every look-up reads.
        self.profile_registry = ProfileRegistry(
            self.profiles, config=config, journal=journal, containers=self.containers
        )
        # Output pumps hold a thread for the life of a command: their own limiter, so
        # long commands can never starve the engine's or the filesystem's threads.
        driver = ExecDriver(
            self.engine,
            self.containers,
            pump_limiter=trio.CapacityLimiter(max(2, 2 * config.max_processes)),
            fs_limiter=fs_limiter,
        )
        self._writer = writer if writer is not None else Writer(store, journal)
        #: Layer sandboxes' change sets kept by id (`changes.*`); conflicts' versions
        #: go to the artifact store.
        self.changesets = Changesets(store, journal, ArtifactKeeper(self.artifacts))
        # The previous runs' layers, listed before this run makes any (crash recovery).
        self._previous_layers = sandbox_dirs(str(state_dir))
        self.processes = Processes(
            engine=self.engine,
            containers=self.containers,
            driver=driver,
            records=ProcessRecords(store, journal),
            artifacts=self.artifacts,
            subscriptions=Subscriptions(),
            write_gate=SnapshotGate(
                StatePaths(config.state_path()).gate, journal, limiter=fs_limiter
            ),
            journal=journal,
            config=config,
            profiles=self.profiles,
            fs_limiter=fs_limiter,
            writer=self._writer,
            changesets=self.changesets,
            launcher=Launcher(self.engine, self.supervisors, fs_limiter=fs_limiter),
        )
        # Before any socket accepts: a previous run's spools and running records are
        # settled first, so nothing new can be confused with them.
        repaired = self.artifacts.repair()
        if any(msgspec.structs.astuple(repaired)):
            journal.append("artifact.repaired", msgspec.to_builtins(repaired))
        lost = self.processes.mark_lost(journal.epoch)
        if lost:
            log.info("%d process record(s) of a previous run marked lost", lost)

    def _warn_missing_secrets(self) -> None:
        """At start: name (never a value) each secret a profile needs that is not set.
        Not fatal: it can be set without a restart; until then that profile's commands
        are refused `secret_unknown`."""
        try:
            have = set(self.secrets.names())
        except Refusal as exc:
            log.warning("secrets cannot be listed: %s", exc.message)
            return
        for name, profile in sorted(self.profiles.items()):
            missing = sorted(set(profile.secrets.values()) - have)
            if missing:
                log.warning("profile %s names secrets that are not set: %s", name, missing)

    def finish_applying(self, workspace: Callable[[str], Workspace]) -> None:
        """At start, before any socket accepts: apply whole every change set a crash left
        half-applied (`layer.recovery.finish_applying`). Blocking."""
        done = finish_applying(self.changesets, self._writer, workspace)
        if done:
            log.info("%d change set(s) a crash left half-applied applied whole", done)

    def profile(self, name: str) -> Profile:
        """The named profile. Refuses `profile_unknown`."""
        return find_profile(self.profiles, name)

    async def engine_status(self) -> EngineStatus:
        return await self.engine.status()

    def fresh_view(self) -> FreshViewStatus:
        """The working layers' fresh view (`daemon.status`): no system call."""
        return fresh_view(s.layer for s in self.containers.live() if s.layer is not None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Service task: reap a previous run's containers, then sweep idle sandboxes and
        collect artifacts until cancelled; on the way out, remove this run's sandboxes."""
        try:
            async with trio.open_nursery() as nursery:
                # Started processes (proc.start) and subscriptions live here.
                await nursery.start(self.processes.serve)
                task_status.started()
                try:
                    await self.containers.reap_previous()
                except Refusal as exc:
                    log.warning("could not reap a previous run's containers: %s", exc.message)
                # Only once the dead run's containers are gone: they hold its layers busy.
                await self.containers.sweep_layers()
                await trio.to_thread.run_sync(
                    drop_unconcluded,
                    self.changesets,
                    self.journal,
                    self._previous_layers,
                )
                if self.pool:
                    await nursery.start(self.pool.serve)
                period = max(1.0, min(IDLE_SWEEP_S, self.config.container_idle_s / 4))
                while True:
                    await trio.sleep(period)
                    try:
                        await self.containers.reap_idle()
                    except Refusal as exc:
                        log.warning("idle sweep: %s", exc.message)
                    try:
                        await trio.to_thread.run_sync(self._collect_artifacts)
                    except Exception:  # one bad sweep must not end the service task
                        log.exception("artifact collection failed")
        finally:
            with trio.CancelScope(shield=True):
                await self.shutdown()

    def _collect_artifacts(self) -> None:
        """Collect by age and quota; journal what went (counts only), warn when still over."""
        report = self.artifacts.collect()
        if report.removed:
            self.journal.append("artifact.collected", msgspec.to_builtins(report))
        if report.over_quota:
            log.warning("artifacts over quota after collection: %d bytes in use", report.bytes_used)

    async def release_workspace(self, ws: Workspace) -> None:
        """`workspace.release`: remove the workspace's sandboxes (their commands end)."""
        await self.containers.release_workspace(ws.id)

    async def shutdown(self) -> None:
        """Remove this run's sandboxes, concluding or keeping their layers' generations
        first (docs/working-layer.md, "Shutdown"); bounded, apart from the conclusions
        already running: an unanswering engine is left alone.

        Order, each step needing the one before: (1) wait up to `SHUTDOWN_DRAIN_S` for
        every user of a layer sandbox to end and conclude — terminals end concurrently
        (the terminal service stops too), commands cut off by the stop conclude in their
        runner, all against live containers; (2) stop concluding (`LayerUsers.stop`,
        which waits for the conclusions running); (3) remove the containers, which tears
        down their layers; (4) keep what is left unconcluded as pending sets
        (`keep_left`); (5) only then sweep the layer directory's own bind: until the
        last conclusion or scan closed its fds beneath it, unmounting it is EBUSY."""
        users = self.processes.layer_users
        with trio.move_on_after(SHUTDOWN_DRAIN_S):
            await users.quiet()
        await users.stop()
        with trio.move_on_after(30):
            await self.pool.close()
            try:
                await self.containers.remove_all("shutdown")
            except Refusal as exc:
                log.warning("shutdown: %s", exc.message)
        kept = await users.keep_left()
        if kept:
            log.warning("%d layer generation(s) kept for review at shutdown", len(kept))
        if not self.containers.live():
            with trio.move_on_after(30):
                await self.containers.sweep_layers()
        self.engine.close()
