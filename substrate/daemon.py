"""The running daemon: state dir, database, services, sockets, shutdown.

`Daemon.open(config)` prepares everything that can fail at start (state dir 0700, no
symlinked socket paths, database, profiles); `serve()` listens until SIGTERM/SIGINT, then
stops accepting, lets in-flight writes finish (they run in threads that are never
abandoned), journals `daemon.stopped` and returns.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import stat
import time
from pathlib import Path
from typing import Any

import trio

from substrate import __version__
from substrate.config import Config
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import reads
from substrate.workspace.registry import WorkspaceRegistry
from substrate.workspace.writes import Writer

log = logging.getLogger("substrate")


class StartupError(Exception):
    """The daemon cannot start safely; the message says why."""


def prepare_state_dir(path: Path) -> Path:
    """Create the state dir 0700 (or check an existing one); refuse a symlink or foreign owner."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"state dir {path} is not a plain directory")
    if st.st_uid != os.getuid():
        raise StartupError(f"state dir {path} belongs to uid {st.st_uid}, not us")
    os.chmod(path, 0o700)
    return path


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


class Daemon:
    """All services of one daemon run. Handlers receive it as their first argument."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.state_dir = prepare_state_dir(config.state_path())
        # Checked here too (bind_unix checks again) so a refusal is a message, not a traceback.
        for name in ("substrate.sock", "operator.sock"):
            check_socket_path(self.state_dir / name)
        _raise_fd_limit()
        self.store = Store(self.state_dir / "substrate.db")
        self.journal = Journal(self.store)
        self.workspaces = WorkspaceRegistry(config, self.store, self.journal, self.state_dir)
        self.writer = Writer(self.store, self.journal)
        # Blocking file work shares one limiter so a flood of reads cannot starve writes
        # of threads forever; writes are never abandoned once started.
        self.fs_limiter = trio.CapacityLimiter(16)
        # Whole-file digests over `inline_hash_bytes`, asked for explicitly, take minutes on
        # huge files: they get threads of their own, so reads never wait behind them.
        self.hash_limiter = trio.CapacityLimiter(2)
        self.digests = reads.Digests()
        # --- execution layer (containers, processes, artifacts) -----------------------
        from substrate.process.service import Execution
        from substrate.sandbox.profiles import ProfileError

        try:
            self.execution: Any = Execution(
                config, self.store, self.journal, self.state_dir, fs_limiter=self.fs_limiter
            )
        except ProfileError as exc:
            raise StartupError(str(exc)) from None
        # --- terminals (grants, PTY sessions) -----------------------------------------
        from substrate.pty.service import TerminalService

        self.terminals: Any = TerminalService(self)

    @property
    def epoch(self) -> int:
        return self.journal.epoch

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on both sockets until a signal; then drain and journal `daemon.stopped`."""
        from substrate.protocol.server import serve_socket

        await trio.to_thread.run_sync(
            self.journal.append, "daemon.started", {"version": __version__, "pid": os.getpid()}
        )
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    serve_socket, self, self.state_dir / "substrate.sock", 0o660, "agent"
                )
                await nursery.start(
                    serve_socket, self, self.state_dir / "operator.sock", 0o600, "operator"
                )
                nursery.start_soon(trio.to_thread.run_sync, self.workspaces.clean_stale_temp_files)
                await nursery.start(self.execution.run)  # execution layer: reaps, sweeps, stops
                await nursery.start(self.terminals.serve)
                task_status.started()
                async for signum in signals:
                    log.info("signal %s: stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
        await trio.to_thread.run_sync(self.journal.append, "daemon.stopped", {"reason": "signal"})

    def close(self) -> None:
        self.workspaces.close()
        self.store.close()
