"""What each group of handlers is given: one frozen bundle of the services it uses.

A handler module registers with `Handles(<its bundle type>)`; the daemon builds one
bundle of each type from its services and gives them to `dispatcher`. A handler reaches
only what its bundle names, so the handlers know no daemon: `substrate.daemon` imports
this package, never the other way round (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from substrate.agents.turns import Turns
from substrate.artifacts.store import ArtifactStore
from substrate.config import Config
from substrate.export import Shipper
from substrate.layer import Changesets
from substrate.process.processes import Processes
from substrate.process.profile_registry import ProfileRegistry
from substrate.process.service import Execution
from substrate.pty.grants import Grants
from substrate.pty.service import TerminalService
from substrate.pty.terminals import Terminals
from substrate.sandbox.containers import Containers
from substrate.store.journal import Journal
from substrate.workspace.checkpoints import Checkpoints
from substrate.workspace.digests import Digests
from substrate.workspace.registry import WorkspaceRegistry
from substrate.workspace.search_pool import SearchPool
from substrate.workspace.uploads import Uploads
from substrate.workspace.writes import UploadWriter, Writer

__all__ = [
    "AgentServices",
    "ArtifactServices",
    "ChangesServices",
    "FsServices",
    "GrantServices",
    "JournalServices",
    "NoServices",
    "ProcServices",
    "ProfileServices",
    "PtyServices",
    "StatusServices",
    "UploadServices",
    "WorkspaceServices",
]


@dataclass(frozen=True, kw_only=True)
class FsServices:
    """`fs.*` but uploads (`api.fs`): reads, searches, guarded writes."""

    config: Config
    workspaces: WorkspaceRegistry
    writer: Writer
    digests: Digests
    #: Blocking file work shares one limiter, so a flood of reads cannot starve writes of
    #: threads forever; writes are never abandoned once started.
    fs_limiter: trio.CapacityLimiter
    #: Whole-file digests over `inline_hash_bytes`, asked for explicitly: threads of
    #: their own, so reads never wait behind them.
    hash_limiter: trio.CapacityLimiter
    #: Searches whose pattern needs the budgeted backtracking engine: threads of their
    #: own, never the file operations' ones.
    backtrack_limiter: trio.CapacityLimiter
    #: The search worker process sharing RE2 searches' files (`search_pool`); None:
    #: every search is serial (one CPU).
    search_pool: SearchPool | None = None


@dataclass(frozen=True, kw_only=True)
class UploadServices:
    """`fs.upload.*` (`api.upload`): uploads in progress and the writer that commits them."""

    config: Config
    workspaces: WorkspaceRegistry
    uploads: Uploads
    upload_writer: UploadWriter


@dataclass(frozen=True, kw_only=True)
class ArtifactServices:
    """`artifact.*` (`api.artifact`): the execution layer's artifact store."""

    artifacts: ArtifactStore
    fs_limiter: trio.CapacityLimiter
    backtrack_limiter: trio.CapacityLimiter


@dataclass(frozen=True, kw_only=True)
class ChangesServices:
    """`changes.*` (`api.changes`): kept change sets, applied through the guarded writer."""

    workspaces: WorkspaceRegistry
    writer: Writer
    changesets: Changesets


@dataclass(frozen=True, kw_only=True)
class WorkspaceServices:
    """`workspace.*` and `approval.grant` (`api.workspace`). `execution` for what a
    workspace's change of policy or release does to its sandboxes, change sets and home."""

    workspaces: WorkspaceRegistry
    execution: Execution
    writer: Writer
    checkpoints: Checkpoints
    journal: Journal
    fs_limiter: trio.CapacityLimiter


@dataclass(frozen=True, kw_only=True)
class ProcServices:
    """`proc.*` (`api.proc`): the runner, the profiles in force, the kept change sets."""

    config: Config
    workspaces: WorkspaceRegistry
    profiles: ProfileRegistry
    processes: Processes
    changesets: Changesets


@dataclass(frozen=True, kw_only=True)
class AgentServices:
    """`agent.*` (`api.agents`): agent CLI turns, run by `substrate.agents.turns.Turns`."""

    workspaces: WorkspaceRegistry
    turns: Turns


@dataclass(frozen=True, kw_only=True)
class ProfileServices:
    """`profile.*` and `facts.probe` (`api.profile`)."""

    workspaces: WorkspaceRegistry
    profiles: ProfileRegistry
    containers: Containers


@dataclass(frozen=True, kw_only=True)
class GrantServices:
    """`grant.*` (`api.grant`): terminal grants, and the sessions a revoke ends."""

    workspaces: WorkspaceRegistry
    profiles: ProfileRegistry
    grants: Grants
    sessions: Terminals


@dataclass(frozen=True, kw_only=True)
class PtyServices:
    """`pty.selection`, `pty.list` (`api.pty`): the terminal sessions of this run."""

    sessions: Terminals


@dataclass(frozen=True, kw_only=True)
class JournalServices:
    """`journal.*` (`api.journal`)."""

    journal: Journal
    workspaces: WorkspaceRegistry


@dataclass(frozen=True, kw_only=True)
class StatusServices:
    """`daemon.status`, `daemon.info` (`api.status`): what this daemon run is."""

    config: Config
    state_dir: Path
    #: `time.monotonic()` when the daemon was made.
    started: float
    journal: Journal
    execution: Execution
    terminals: TerminalService
    profiles: ProfileRegistry
    #: The journal export's task; None when `[journal_export]` is not configured.
    shipper: Shipper | None = None
    #: What the metrics page is bound to, HOST:PORT (a callable: known once it listens).
    metrics_address: Callable[[], str | None] = lambda: None


@dataclass(frozen=True, kw_only=True)
class NoServices:
    """`rpc.discover` (`api.discover`): it uses none (its document is the schema's)."""
