"""Wire schema of the journal (docs/protocol.md §8) and daemon status (docs/protocol.md §9)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from substrate.schema.common import NonNegative, Params, Result, WorkspaceId, method
from substrate.schema.profile import ProfileDigest


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One journal entry as stored and as returned by `journal.read`."""

    seq: int
    epoch: int
    ts: float
    kind: str
    workspace: str | None
    actor: str
    data: dict[str, Any]
    prev: str
    hash: str


#: The longest `argv0` the journal keeps, in characters.
MAX_ARGV0_CHARS = 256


def argv_summary(argv: Sequence[str]) -> dict[str, Any]:
    """What the journal keeps of an argv, which can hold a prompt or an inline script:
    `argv0` (at most 256 characters), `argc`, and `argv_sha256`, the SHA-256 of the argv
    as a compact JSON array in UTF-8 (msgspec's encoding). Pure; the whole argv lives
    only in the process record."""
    return {
        "argv0": argv[0][:MAX_ARGV0_CHARS] if argv else "",
        "argc": len(argv),
        "argv_sha256": hashlib.sha256(msgspec.json.encode(list(argv))).hexdigest(),
    }


class JournalReadParams(Params):
    since: NonNegative = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 1000
    workspace: WorkspaceId | None = None


class JournalReadResult(Result):
    entries: list[Entry]


class JournalVerifyParams(Params):
    pass


class JournalVerifyResult(Result):
    ok: bool
    entries: int
    first_bad_seq: int | None = None


class ReplayParams(Params):
    workspace: WorkspaceId


class ReplayFile(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # root_id:relative/path
    last_seq: int
    last_sha256: str | None  # None: substrate's last act was a delete
    current_sha256: str | None  # None: absent now
    status: Literal["match", "drift", "missing", "unreadable"]


class ReplayResult(Result):
    files: list[ReplayFile]
    drifted: int


class StatusParams(Params):
    pass


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    reachable: bool
    version: str | None = None
    runtimes: list[str] = msgspec.field(default_factory=list)


class JournalExportStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The journal export to PostgreSQL (docs/fleet.md): where it stands."""

    #: "off": not configured; "connecting"; "shipping": entries behind, being sent;
    #: "caught_up": every committed entry is in PostgreSQL; "retrying": the last
    #: attempt failed (`last_error`), waiting to try again.
    state: Literal["off", "connecting", "shipping", "caught_up", "retrying"] = "off"
    #: The highest seq of this node PostgreSQL is known to hold.
    last_seq: int = 0
    #: Committed entries not yet known to be in PostgreSQL.
    lag_entries: int = 0
    #: The last failure, `<kind>: <detail>` (never the password); None after a success.
    last_error: str | None = None


class FreshViewStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The working layers' fresh view (docs/working-layer.md, "The fresh view"), over the
    layer sandboxes live now."""

    #: Layer sandboxes live.
    layers: int = 0
    #: Checkout directories watched for host changes, over them all.
    watched_dirs: int = 0
    #: Generations mounted again before a command because their checkout changed.
    remounts: int = 0
    #: Layers whose watch was given up: each of their commands gets a fresh mount.
    degraded: int = 0
    #: Why (distinct, sorted): "watch_limit", "too_many_dirs", "too_deep", "no_inotify
    #: (...)", "walk_failed (...)".
    reasons: list[str] = msgspec.field(default_factory=list)


class WarmPoolStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One profile's warm pool (`warm_sandboxes`, docs/execution.md "The warm pool")."""

    ready: int  # sandboxes waiting for a workspace now
    wanted: int  # how many are kept
    #: Why the last refill failed (engine down, image missing, ...); None: it did not.
    last_error: str | None = None


class StatusResult(Result):
    version: str
    epoch: int
    uptime_s: float
    engine: EngineStatus
    #: True once `daemon.drain` was asked (until it is cancelled): no new command starts.
    draining: bool
    #: Commands running now (`proc.run` and `proc.start`, every workspace).
    running: int
    #: The journal export to PostgreSQL (`[journal_export]`); state "off" when not configured.
    journal_export: JournalExportStatus
    #: HOST:PORT the terminal endpoint is bound to (the real port, also for `:0`);
    #: absent when terminals could not listen.
    listen: str | None = None
    #: The daemon process's resident memory, bytes; absent when the system does not say.
    rss_bytes: int | None = None
    #: File descriptors the daemon process holds open; absent when the system does not say.
    open_fds: int | None = None
    #: Threads of the daemon process; absent when the system does not say.
    threads: int | None = None
    #: HOST:PORT the metrics page (`metrics_listen`) is bound to; absent when not served.
    metrics_listen: str | None = None
    #: How the working layers keep a command's view of the checkout fresh.
    fresh_view: FreshViewStatus = msgspec.field(default_factory=FreshViewStatus)
    #: profile → its warm pool; empty when `warm_sandboxes` keeps none.
    warm_pool: dict[str, WarmPoolStatus] = msgspec.field(default_factory=dict)


method("journal.read", JournalReadParams, JournalReadResult)
method("journal.verify", JournalVerifyParams, JournalVerifyResult)
method(
    "journal.replay",
    ReplayParams,
    ReplayResult,
    doc="For every file substrate wrote: do its bytes still match the last digest written?",
)


class InfoResult(Result, omit_defaults=False):
    """What this daemon is and how it was configured (for `substrate doctor`)."""

    version: str
    pid: int
    epoch: int
    uptime_s: float
    state_dir: str
    agent_socket: str
    operator_socket: str
    #: As `StatusResult.listen`: the bound terminal HOST:PORT, or null.
    listen: str | None
    #: The effective configuration (file, flags, defaults), every key but secrets.
    config: dict[str, Any]
    #: The profiles in force (after the last reload) with their digests.
    profiles: list[ProfileDigest]
    engine: EngineStatus


#: The longest a `daemon.drain` waits for running commands, seconds.
MAX_DRAIN_S = 3600.0


class DrainParams(Params):
    #: How long to wait for the running commands to end, seconds (0: do not wait).
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_DRAIN_S)] = 60.0
    #: Accept new commands again (a drain called off); nothing is waited for.
    cancel: bool = False


class DrainResult(Result, omit_defaults=False):
    draining: bool
    #: Commands still running when the call returned (0: the node is idle).
    running: int
    waited_s: float


method("daemon.status", StatusParams, StatusResult)
method(
    "daemon.drain",
    DrainParams,
    DrainResult,
    operator_only=True,
    doc="Start no new command or terminal session; wait (bounded) for the running ones.",
)
method(
    "daemon.info",
    StatusParams,
    InfoResult,
    operator_only=True,
    doc="The daemon's effective configuration, sockets and profiles in force.",
)
