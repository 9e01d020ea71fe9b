"""The running daemon: state dir, database, services, sockets, shutdown.

`async with open_daemon(config) as daemon:` prepares everything that can fail at start
(state dir 0700, no symlinked socket paths, database, profiles) and closes what it
opened on exit. `daemon.serve()` listens until SIGTERM/SIGINT, then stops
accepting, lets in-flight writes finish (they run in threads that are never abandoned),
journals `daemon.stopped` and returns.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import logging
import os
import resource
import signal
import socket
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from substrate import __version__, api
from substrate.agents.turns import Turns
from substrate.config import Config, ConfigError
from substrate.egress import EgressProxy, from_environ
from substrate.errors import Refusal, StartupError
from substrate.export import Cursors, Exporter, ExportSettings, JournalSource, Shipper
from substrate.fs.state import StatePaths
from substrate.metrics import METRICS, serve_metrics
from substrate.process.service import Execution
from substrate.protocol.server import Backend, serve_socket
from substrate.pty.service import TerminalService
from substrate.sandbox.profiles import ProfileError
from substrate.secrets import SecretStore, check_name
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import reads
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.registry import WorkspaceRegistry
from substrate.workspace.search_pool import SearchPool
from substrate.workspace.uploads import Uploads
from substrate.workspace.writes import UploadWriter, Writer

__all__ = ["Daemon", "StartupError", "configure_logging", "open_daemon"]

log = logging.getLogger("substrate")


class _IsoFormatter(logging.Formatter):
    """Log lines stamped in ISO 8601 with the local offset, to the millisecond."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created).astimezone()
        return stamp.isoformat(timespec="milliseconds")


def configure_logging(level: str) -> None:
    """The daemon's log: one line per event on stderr, `<ISO 8601 time> <logger>
    <LEVEL> <message>`, at `level` ("debug", "info", "warning", "error"). Replaces any
    handler set before (a forked test daemon inherits its parent's)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_IsoFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def prepare_state_dir(path: Path, agent_gid: int | None = None) -> Path:
    """Create the state dir 0700 (or check an existing one); refuse a symlink or foreign
    owner. With `agent_gid` (`agent_socket_group`) it is 0710 with that group: its
    members may enter it to reach the agent socket, never list it, and every entry in
    it but that socket is the daemon's alone (0700 dirs, 0600 files)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StartupError(f"state dir {path} is not a plain directory") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StartupError(f"state dir {path} belongs to uid {st.st_uid}, not us")
        if agent_gid is None:
            os.fchmod(fd, 0o700)
        else:
            os.fchown(fd, -1, agent_gid)
            os.fchmod(fd, 0o710)
    finally:
        os.close(fd)
    return path


def notify_service_manager(state: str) -> None:
    """Tell systemd `state` ("READY=1", "STOPPING=1") when it runs us as `Type=notify`
    (`$NOTIFY_SOCKET`: a path, or `@` for the abstract namespace); nothing otherwise.
    A failure is logged, never fatal: the daemon serves either way. One datagram."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("could not tell the service manager %s: %s", state, exc)


def check_socket_path(path: Path) -> None:
    """Refuse anything but nothing or a stale socket at `path` (never follow a planted link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket (refusing to follow or replace it)")


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass(eq=False, kw_only=True)
class Daemon:
    """All services of one daemon run. Each group of handlers is given a bundle of the
    ones it uses (`handler_services`), never the daemon.

    Made by `open_daemon`, which owns the lifetime of the store and the workspaces.
    """

    config: Config
    state_dir: Path
    store: Store
    journal: Journal
    workspaces: WorkspaceRegistry
    writer: Writer
    checkpoints: Checkpoints
    execution: Execution
    terminals: TerminalService
    #: The allow-listing proxy of egress sandboxes (docs/egress.md), served by `serve`.
    egress: EgressProxy
    #: Chunked uploads in progress (fs.upload.*) and the writer that commits them.
    uploads: Uploads
    upload_writer: UploadWriter
    #: Blocking file work shares one limiter so a flood of reads cannot starve writes of
    #: threads forever; writes are never abandoned once started.
    fs_limiter: trio.CapacityLimiter
    #: Whole-file digests over `inline_hash_bytes`, asked for explicitly, take minutes on
    #: huge files: they get threads of their own, so reads never wait behind them.
    hash_limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(2))
    #: Searches whose pattern needs the budgeted backtracking engine hold a thread for up
    #: to its budget (10 s): two threads of their own, never the file operations' ones.
    backtrack_limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(2))
    digests: reads.Digests = field(default_factory=reads.Digests)
    #: The search worker process (docs/performance.md), started by the first search.
    search_pool: SearchPool | None = None
    #: `agent_socket_group`'s gid, resolved once at start (None: root only).
    agent_gid: int | None = None
    #: The journal export's task (docs/fleet.md); None when not configured.
    shipper: Shipper | None = None
    #: HOST:PORT the metrics page is bound to, once it listens (`metrics_listen`).
    metrics_bound: str | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def epoch(self) -> int:
        return self.journal.epoch

    def handler_services(self) -> tuple[object, ...]:
        """One bundle of each type of `substrate.api.services`, for `api.dispatcher`."""
        execution, terminals = self.execution, self.terminals
        profiles = execution.profile_registry
        return (
            api.FsServices(
                config=self.config,
                workspaces=self.workspaces,
                writer=self.writer,
                digests=self.digests,
                fs_limiter=self.fs_limiter,
                hash_limiter=self.hash_limiter,
                backtrack_limiter=self.backtrack_limiter,
                search_pool=self.search_pool,
            ),
            api.UploadServices(
                config=self.config,
                workspaces=self.workspaces,
                uploads=self.uploads,
                upload_writer=self.upload_writer,
            ),
            api.ArtifactServices(
                artifacts=execution.artifacts,
                fs_limiter=self.fs_limiter,
                backtrack_limiter=self.backtrack_limiter,
            ),
            api.ChangesServices(
                workspaces=self.workspaces, writer=self.writer, changesets=execution.changesets
            ),
            api.WorkspaceServices(
                workspaces=self.workspaces,
                execution=execution,
                writer=self.writer,
                checkpoints=self.checkpoints,
                journal=self.journal,
                fs_limiter=self.fs_limiter,
            ),
            api.ProcServices(
                config=self.config,
                workspaces=self.workspaces,
                profiles=profiles,
                processes=execution.processes,
                changesets=execution.changesets,
            ),
            api.ProfileServices(
                workspaces=self.workspaces, profiles=profiles, containers=execution.containers
            ),
            api.AgentServices(
                workspaces=self.workspaces,
                turns=Turns(
                    processes=execution.processes,
                    profiles=profiles,
                    changesets=execution.changesets,
                    writer=self.writer,
                    journal=self.journal,
                    max_kept_changesets=self.config.max_kept_changesets,
                ),
            ),
            api.GrantServices(
                workspaces=self.workspaces,
                profiles=profiles,
                grants=terminals.grants,
                sessions=terminals.sessions,
            ),
            api.PtyServices(sessions=terminals.sessions),
            api.JournalServices(journal=self.journal, workspaces=self.workspaces),
            api.StatusServices(
                config=self.config,
                state_dir=self.state_dir,
                started=self.started,
                journal=self.journal,
                execution=execution,
                terminals=terminals,
                profiles=profiles,
                shipper=self.shipper,
                metrics_address=lambda: self.metrics_bound,
            ),
            api.NoServices(),
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on both sockets until a signal; then drain and journal `daemon.stopped`."""
        await trio.to_thread.run_sync(
            self.journal.append, "daemon.started", {"version": __version__, "pid": os.getpid()}
        )
        dispatch = api.dispatcher(*self.handler_services())
        backend = Backend(config=self.config, dispatch=dispatch, record=self.journal.append)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                state = StatePaths(self.state_dir)
                agent, operator = state.agent_socket, state.operator_socket
                await nursery.start(serve_socket, backend, agent, 0o660, "agent")
                if self.agent_gid is not None:  # its group may connect; so far only root
                    os.chown(agent, -1, self.agent_gid, follow_symlinks=False)
                await nursery.start(serve_socket, backend, operator, 0o600, "operator")
                nursery.start_soon(trio.to_thread.run_sync, self.workspaces.clean_stale_temp_files)
                await nursery.start(self.egress.serve)  # before any sandbox links to it
                await nursery.start(self.execution.run)  # reaps, sweeps, stops sandboxes
                await nursery.start(self.terminals.serve)
                nursery.start_soon(self._expire_uploads)
                if self.shipper is not None:
                    await nursery.start(self.shipper.run)
                if self.config.metrics_listen:
                    await nursery.start(self._serve_metrics)
                task_status.started()
                notify_service_manager("READY=1")  # every socket accepts now
                nursery.start_soon(self._banner)
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        nursery.start_soon(self._reload_profiles)
                        continue
                    log.info("signal %s: stopping", signal.Signals(signum).name)
                    notify_service_manager("STOPPING=1")
                    nursery.cancel_scope.cancel()
                    break
        await trio.to_thread.run_sync(self.journal.append, "daemon.stopped", {"reason": "signal"})
        if self.shipper is not None:  # the last entries too, if PostgreSQL answers at once
            await self.shipper.drain()

    async def _serve_metrics(self, *, task_status: trio.TaskStatus[None]) -> None:
        """`/metrics` on `metrics_listen` (docs/fleet.md), with the scrape-time gauges of
        this daemon. An address that cannot be bound is logged, never fatal: the
        daemon serves without its page (`daemon.status` shows no `metrics_listen`)."""
        execution, shipper = self.execution, self.shipper
        METRICS.gauge(
            "substrate_sandboxes", "Sandboxes this daemon holds", execution.containers.count
        )
        METRICS.gauge(
            "substrate_artifact_store_bytes",
            "Bytes the artifact store holds on disk (files and live spools)",
            execution.artifacts.usage,
        )
        METRICS.gauge(
            "substrate_journal_export_lag_entries",
            "Committed journal entries not yet known to be in PostgreSQL",
            (lambda: None) if shipper is None else shipper.lag,
        )
        listen = self.config.metrics_listen
        async with trio.open_nursery() as nursery:
            try:
                port = await nursery.start(
                    functools.partial(
                        serve_metrics,
                        listen,
                        METRICS,
                        allow_remote=self.config.metrics_allow_remote,
                    )
                )
            except OSError as exc:
                log.error("metrics: cannot listen on %s: %s; no metrics page", listen, exc)
                task_status.started()
                return
            self.metrics_bound = f"{listen.rpartition(':')[0]}:{port}"
            log.info("metrics http://%s/metrics", self.metrics_bound)
            task_status.started()

    async def _reload_profiles(self) -> None:
        """SIGHUP: `profile.reload`, its outcome logged (a refusal keeps the set in force)."""
        log.info("signal SIGHUP: reloading profiles")
        with contextlib.suppress(Refusal):  # logged and journaled by the reload
            await self.execution.profile_registry.reload(actor="operator:signal")

    async def _banner(self) -> None:
        """Say at start what this daemon is: sockets, terminal URL, state dir, profiles,
        engine. Logged once the sockets accept; the engine line waits for the engine's
        answer (bounded by its client's timeout). Never a path inside a workspace, never
        a secret."""
        state = StatePaths(self.state_dir)
        agent, operator = state.agent_socket, state.operator_socket
        log.info("substrate %s serving: pid %d, epoch %d", __version__, os.getpid(), self.epoch)
        log.info("state dir %s", self.state_dir)
        log.info("agent socket %s (0660), operator socket %s (0600)", agent, operator)
        listen = self.terminals.address()
        log.info("terminals %s", f"http://{listen}/" if listen else "not listening (see above)")
        names = sorted(self.execution.profiles)
        log.info(
            "profiles %s: %d loaded: %s",
            self.config.profiles_dir,
            len(names),
            ", ".join(names) or "(none)",
        )
        log.info("log level %s", self.config.log_level)
        engine = await self.execution.engine_status()
        if engine.reachable:
            runtimes = ", ".join(engine.runtimes) or "none"
            log.info("engine reachable: Docker %s, runtimes %s", engine.version, runtimes)
        else:
            log.warning(
                "engine not reachable: commands are refused runtime_unavailable until it answers"
            )

    async def _expire_uploads(self) -> None:
        """Drop uploads idle for `upload_idle_s` (and their spools), checking a few times
        per idle period (at most every 30 s)."""
        period = min(max(self.config.upload_idle_s / 4, 0.05), 30.0)
        while True:
            await trio.sleep(period)
            expired = await trio.to_thread.run_sync(self.uploads.expire)
            if expired:
                log.info("uploads expired (idle): %d", len(expired))


@contextlib.asynccontextmanager
async def open_daemon(config: Config) -> AsyncIterator[Daemon]:
    """Open the daemon's state and services for `config`; close the engine client, the
    workspaces and the database on exit.

    Raises `StartupError` (the message says why) for a state dir that is a symlink or
    not ours, a socket path holding anything but a stale socket, or a bad profile or
    seccomp file. Costs the database's open and the artifact and process-record repair
    of a previous run (blocking: nothing else runs yet at start).
    """
    with contextlib.ExitStack() as closing:
        yield _open(config, closing)


def _open(config: Config, closing: contextlib.ExitStack) -> Daemon:
    """Build every service in order; each one that holds resources is closed by `closing`."""
    try:
        agent_gid = config.agent_gid()
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    state_dir = prepare_state_dir(config.state_path(), agent_gid)
    state = StatePaths(state_dir)
    # Checked here too (bind_unix checks again) so a refusal is a message, not a traceback.
    for sock in (state.agent_socket, state.operator_socket):
        check_socket_path(sock)
    _raise_fd_limit()
    store = Store(state.database)
    closing.callback(store.close)
    journal = Journal(store)
    workspaces = WorkspaceRegistry(config, store, journal, state_dir)
    closing.callback(workspaces.close)
    checkpoints = Checkpoints(store, journal, state_dir, config.preimage_quota_bytes)
    closing.callback(checkpoints.close)
    checkpoints.sweep()  # blobs a crash left without a row; no write runs yet
    fs_limiter = trio.CapacityLimiter(16)
    digests = reads.Digests()
    # Uploads never outlive a run: the spools of earlier runs are removed here.
    uploads = Uploads(
        state_dir,
        max_bytes=config.max_upload_bytes,
        max_open=config.max_uploads,
        idle_s=config.upload_idle_s,
    )
    closing.callback(uploads.close)
    # One writer for fs.* and the working layers' change sets, keeping pre-images for both.
    writer = Writer(
        store,
        journal,
        checkpoints,
        max_change_file_bytes=config.max_change_file_bytes,
        max_changeset_bytes=config.max_changeset_bytes,
    )
    # Chained to the upstream proxy the daemon's own environment names, if any.
    egress = EgressProxy(
        upstream=from_environ(os.environ), refuse_private=config.egress_refuse_private
    )
    try:
        execution = Execution(
            config,
            store,
            journal,
            state_dir,
            fs_limiter=fs_limiter,
            writer=writer,
            egress=egress,
            homes=workspaces.homes,
        )
    except ProfileError as exc:
        raise StartupError(str(exc)) from None
    # Before any socket accepts: no change set stays half-applied across a crash.
    execution.finish_applying(workspaces.get)
    # `execution.run` closes it too on its way out; here for a daemon that never served.
    closing.callback(execution.engine.close)
    shipper = _shipper(config, store, state, closing)
    # Its worker starts with the first search; killed and reaped when the daemon closes.
    search_pool = SearchPool.for_machine()
    if search_pool is not None:
        closing.callback(search_pool.close)
    return Daemon(
        config=config,
        state_dir=state_dir,
        store=store,
        journal=journal,
        workspaces=workspaces,
        writer=writer,
        checkpoints=checkpoints,
        execution=execution,
        terminals=TerminalService(config, store, journal, execution, workspaces),
        fs_limiter=fs_limiter,
        egress=egress,
        digests=digests,
        uploads=uploads,
        upload_writer=UploadWriter(store, journal, digests, checkpoints),
        agent_gid=agent_gid,
        shipper=shipper,
        search_pool=search_pool,
    )


def _shipper(
    config: Config, store: Store, state: StatePaths, closing: contextlib.ExitStack
) -> Shipper | None:
    """The journal export's task for `[journal_export]` (docs/fleet.md), or None when no
    DSN is set. Raises StartupError for a `password_secret` that is not a secret's name."""
    export = config.journal_export
    if not export.postgres_dsn:
        return None
    name = export.password_secret
    if name:
        try:
            check_name(name)
        except Refusal as exc:
            raise StartupError(f"journal_export.password_secret: {exc.message}") from None
    secrets = SecretStore(state.root)

    def password() -> str | None:
        return secrets.load([name])[name] if name else None

    source = JournalSource(state.database, export.node_name())
    closing.callback(source.close)
    settings = ExportSettings(
        dsn=export.postgres_dsn,
        node=export.node_name(),
        password=password,
        batch_entries=export.batch_entries,
        poll_s=export.poll_s,
        max_backoff_s=export.max_backoff_s,
        timeout_s=export.timeout_s,
    )
    exporter = Exporter(settings, source, Cursors(store.transaction))
    return Shipper(exporter, on_error=METRICS.journal_export_errors.inc)
