"""Wire schema of process execution (docs/protocol.md §5 `proc.run`).

`argv` is deliberately loose here (any list of strings): an empty argv, a NUL or an
argv[0] outside the profile's `argv_allow` is the named refusal `argv_denied`, decided in
`substrate.process.processes`, not `invalid_params`. Likewise a `timeout_s` above the profile's is
`limit_exceeded`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.artifact import OutputRef
from substrate.schema.common import Params, RelPath, Result, WorkspaceId, method
from substrate.schema.facts import Fact

ProfileName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class PolicyBlocked(msgspec.Struct, frozen=True, kw_only=True):
    """A change a command made that the workspace policy denies; it was reverted (unless
    `reverted` is false: docs/write-gate.md says when). `path` is `root_id:rel`; bytes of
    a name that are not UTF-8 are written `\\xNN`. `rule` is the policy list that denies
    it: `write_deny`, or `require_approval` (sandboxed code cannot ask for an approval,
    so such a change is reverted like a denied one). `reason`, when not reverted:
    `unattributed` (not seen made by the sandbox's processes: e.g. a person's edit on
    the host, never undone), `mixed` (the sandbox and something else both changed it),
    or why the restore failed."""

    path: str
    change: Literal["create", "modify", "delete", "chmod"]
    reverted: bool
    rule: Literal["write_deny", "require_approval"] = "write_deny"
    reason: str | None = None


class EgressBlocked(msgspec.Struct, frozen=True, kw_only=True):
    """Connections an egress sandbox's proxy refused while the command ran (docs/egress.md):
    `count` every refused attempt; `hosts` the distinct `host:port` asked for, in the
    order first refused, at most 32. One whose process could not be told apart is
    counted in every command running in that sandbox at the time."""

    count: int
    hosts: list[str]


class ChangeEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What became of one change of a command's working layer (docs/working-layer.md).
    `op`: create | replace | delete | chmod | mkdir (None for what the scan blocked:
    links the profile refuses, devices, FIFOs, ...); `size`/`mode`: what the command left (a file's
    bytes and permission bits; none for a delete); `reason`: a refusal name or the
    scan's reason; `rule`: the policy rule that blocked it; `plan_digest`: the plan to
    grant (`approval.grant`) of a pending change. A conflict's `current_sha256` is the
    checkout's digest now; the command's version is the artifact `artifact` (read it
    with `artifact.read`), or, when it could not be kept as one (`artifact_reason`:
    `too_large`, `set_full`, `failed`; `empty` for a file of no bytes), `kept` names it
    in the set's layer, which then stays until `changes.discard`. A symlink's entry has
    `kind: "symlink"`, its `target` (verbatim) and `escapes` (whether the target leaves
    the checkout, resolved lexically; docs/working-layer.md, "Symlinks"). A `ref` entry
    (`op: "ref"`, `path` the ref's name) carries `old_oid`/`new_oid` (None: absent),
    and `current_oid`, the checkout's value, when it conflicted (`host_changed`)."""

    path: str
    op: str | None = None
    size: int | None = None
    mode: int | None = None
    reason: str | None = None
    rule: str | None = None
    plan_digest: str | None = None
    current_sha256: str | None = None
    artifact: str | None = None
    artifact_reason: str | None = None
    kept: str | None = None
    kind: str | None = None  # "symlink" for a link; None for a file or a directory
    target: str | None = None
    escapes: bool | None = None
    old_oid: str | None = None
    new_oid: str | None = None
    current_oid: str | None = None


#: What becomes of a layer command's change set (docs/working-layer.md).
ChangesMode = Literal["apply", "review", "discard"]


class ChangeCounts(msgspec.Struct, frozen=True, kw_only=True):
    applied: int = 0
    unchanged: int = 0  # the checkout held the result already
    blocked: int = 0
    pending: int = 0
    conflicts: int = 0
    review: int = 0  # kept for review, not applied


class ProcChanges(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The change set of a command on a `workspace = "layer"` sandbox, applied when it
    ended. Each list holds at most 1,000 entries (`counts` has the totals). `deferred`:
    other commands or terminals still used the generation when this one ended, so its
    changes wait in it and are applied (once, with theirs) when the last of them ends;
    that one's result carries the set (docs/protocol.md §11). `error`: why nothing (or
    not everything) was applied: `layer_busy` (the layer was still in use; its changes
    apply after the next command), `layer_unverified` (the next generation did not
    verify: the sandbox is dropped), `daemon_stopped` (the daemon stopped before the
    generation concluded: it is kept as a pending set, `changeset` when known), or a
    refusal name. `mode` is the mode the set was concluded in (the most conservative its
    users asked; the run's own `changes` when deferred); `changeset` the id under which
    the set is kept (`changes.get`), absent for "discard" and for a command that changed
    nothing; `review` the changes awaiting `changes.apply` (mode "review")."""

    generation: int  # the layer generation that held the changes (upper/<generation>)
    deferred: bool = False
    changeset: str | None = None
    mode: ChangesMode = "apply"
    review: list[ChangeEntry] = msgspec.field(default_factory=list)
    applied: list[ChangeEntry] = msgspec.field(default_factory=list)
    blocked: list[ChangeEntry] = msgspec.field(default_factory=list)
    pending: list[ChangeEntry] = msgspec.field(default_factory=list)
    conflicts: list[ChangeEntry] = msgspec.field(default_factory=list)
    counts: ChangeCounts = msgspec.field(default_factory=ChangeCounts)
    error: str | None = None


#: How a result carries the confinement facts: "summary" (`facts_digest` and
#: `facts_summary` only) or "full" (the `facts` list as well).
FactsMode = Literal["summary", "full"]

#: `stdin` of `proc.start` that keeps the command's stdin open for `proc.write`.
STDIN_STREAM = "stream"


class StartParams(Params):
    """A command to start (`proc.start`). `stdin: "stream"` (exactly) keeps its stdin
    open for `proc.write` (docs/protocol.md §14); any other `stdin` text, or
    `stdin_b64`, is written to it, then EOF; neither: no stdin is attached."""

    workspace: WorkspaceId
    argv: list[str]
    #: the operator's profile to run under; absent: the daemon's `default_profile`
    profile: ProfileName | None = None
    cwd: RelPath = "."
    stdin: str | None = None  # UTF-8 text fed to the command, then EOF; or "stream"
    stdin_b64: str | None = None  # or bytes, base64 (not both)
    timeout_s: Seconds | None = None  # may only lower the profile's
    #: A `workspace = "layer"` profile's change set: applied, kept for review, or
    #: discarded; any other profile refuses "review"/"discard" (`invalid_params`).
    changes: ChangesMode = "apply"


class RunParams(StartParams):
    """A command to run to its end (`proc.run`): as `proc.start`, except that
    `stdin: "stream"` is `invalid_params` (nobody could write to it: send the text
    "stream" as `stdin_b64`)."""

    facts: FactsMode = "summary"  # "full": the result carries the `facts` list too


class FactsSummary(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the confinement facts say, in a few fields (docs/protocol.md §5). `verified`:
    they were observed before the command ran and matched the profile (false only for
    a record older than kept facts); `count`: how many there are. `seccomp`: "filter"
    (the kernel shows a filter on the command), "sentry" (gVisor: the sandbox kernel is
    filtered, the command inside is not under the profile's filter), or "none";
    `capabilities`: how many the command could ever hold (the bounding set); `network`:
    "none" (loopback only, no route), "egress" (loopback only, out through the daemon's
    allow-listing proxy) or "open"; `workspace`: "rw", "ro", "layer" or "absent";
    `exec_checked`: the command's own process was observed too before it ran (fast
    exec: `exec_facts`; left out on the engine path). A field whose fact is missing is
    left out."""

    verified: bool
    count: int
    runtime: str | None = None
    uid: int | None = None
    gid: int | None = None
    seccomp: str | None = None
    capabilities: int | None = None
    no_new_privs: bool | None = None
    rootfs_readonly: bool | None = None
    network: str | None = None
    workspace: str | None = None
    exec_checked: bool = False


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """CPU and memory used while the command ran, read from its sandbox's cgroup
    (docs/execution.md "Usage"). The cgroup is the sandbox's, not the command's:
    `exclusive` says nothing else (command, terminal) used the sandbox from the
    command's start to its end, so the figures are the command's own (with its
    children and stragglers, plus the sandbox's idle init); when false they include
    whatever else ran there meanwhile, an upper bound. `cpu_s`: user + system CPU
    seconds over the command's life; `peak_memory_bytes`: the cgroup's memory
    high-water mark (page cache included) since the command started, None where that
    cannot be scoped to it (cgroup v2 before Linux 6.12). Under gVisor both include
    the sandbox kernel itself. `source`: "cgroup-v1" or "cgroup-v2"."""

    cpu_s: float | None = None
    peak_memory_bytes: int | None = None
    exclusive: bool = False
    source: str = ""


class ProcResult(Result):
    """A finished command. `exit_code` is the engine's: 128 + n for a death by signal n
    (then `signal` names it, e.g. "KILL"); None only if the engine (or the sandbox's
    supervisor, when it died while the command ran) lost it. `via`: how it was started
    ("supervisor": fast exec, docs/fast-exec.md; "engine": the engine's exec). The
    confinement facts come as `facts_digest` (SHA-256 of their compact JSON encoding,
    the key of the record's fact set) and `facts_summary`, and in full only when asked
    (`facts: "full"`): `facts`, the sandbox's, and `exec_facts`, the command's own
    process as the host saw it before it ran (fast exec under runc; empty on the engine
    path and under gVisor, where no command has a host process: docs/fast-exec.md
    "Under gVisor"): NoNewPrivs, Seccomp, capabilities, ids, and `parent`/`cgroup`/`namespaces`
    ("supervisor"/"sandbox"/"sandbox")."""

    proc: str
    exit_code: int | None
    signal: str | None
    timed_out: bool
    oom_killed: bool
    duration_ms: float
    stdout: OutputRef
    stderr: OutputRef
    policy_blocked: list[PolicyBlocked]
    facts: list[Fact] | None = None  # with `facts: "full"` only
    facts_digest: str | None = None
    facts_summary: FactsSummary | None = None
    usage: Usage | None = None  # None: not measured (no readable cgroup)
    changes: ProcChanges | None = None  # a "layer" profile's applied change set
    egress_blocked: EgressBlocked | None = None  # an "egress" profile's refused connections
    via: Literal["supervisor", "engine"] | None = None
    exec_facts: list[Fact] = msgspec.field(default_factory=list)


method(
    "proc.run",
    RunParams,
    ProcResult,
    mutating=True,
    doc="Run argv (no shell) in the workspace's verified sandbox; wait for it to end.",
)


# --- intents (docs/protocol.md §5: proc.start, wait, signal, status, list, subscribe) -----------------

ProcId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
ProcState = Literal["running", "exited", "lost"]
WaitSeconds = Annotated[float, msgspec.Meta(ge=0, le=86400)]


class StartResult(Result):
    proc: str


class ProcParams(Params):
    proc: ProcId
    facts: FactsMode = "summary"  # "full": a finished command's `facts` list too


class WaitParams(Params):
    proc: ProcId
    timeout_s: WaitSeconds | None = None  # None: until it ends; 0: poll
    facts: FactsMode = "summary"  # "full": the result carries the `facts` list too


class ProcPending(Result):
    """A process with no result (yet): still `running`, or `lost` (its daemon died)."""

    proc: str
    state: ProcState


class WaitResult(Result):
    """Either the `proc.run` result (the process ended: every field of it, no `state`)
    or `{proc, state}` with state `running` (timeout_s passed) or `lost`."""

    proc: str
    state: ProcState | None = None
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool | None = None
    oom_killed: bool | None = None
    duration_ms: float | None = None
    stdout: OutputRef | None = None
    stderr: OutputRef | None = None
    facts: list[Fact] | None = None
    facts_digest: str | None = None
    facts_summary: FactsSummary | None = None
    usage: Usage | None = None
    policy_blocked: list[PolicyBlocked] | None = None
    changes: ProcChanges | None = None
    egress_blocked: EgressBlocked | None = None
    via: Literal["supervisor", "engine"] | None = None
    exec_facts: list[Fact] | None = None


SignalName = Literal["INT", "TERM", "KILL"]


class SignalParams(Params):
    proc: ProcId
    signal: SignalName


class SignalResult(Result):
    """`delivered`: processes of the command signalled (0 when it had ended already)."""

    proc: str
    state: ProcState
    delivered: int


class ProcStatus(Result):
    """A process as recorded; byte counts grow while it runs. `proc.status` of a finished
    process adds the `facts_digest`, `facts_summary` (and `facts` when asked), `usage`,
    `policy_blocked`, `changes` and `egress_blocked` of its result (`proc.list` does
    not)."""

    proc: str
    workspace: str
    profile: str
    argv: list[str]
    state: ProcState
    started: float  # unix time
    stdout_bytes: int
    stderr_bytes: int
    ended: float | None = None  # unknown for a lost process
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool | None = None
    facts: list[Fact] | None = None
    facts_digest: str | None = None
    facts_summary: FactsSummary | None = None
    usage: Usage | None = None
    policy_blocked: list[PolicyBlocked] | None = None
    changes: ProcChanges | None = None
    egress_blocked: EgressBlocked | None = None
    exec_facts: list[Fact] | None = None  # with `facts: "full"`, on the fast path


class ListParams(Params):
    workspace: WorkspaceId | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100


class ListResult(Result):
    processes: list[ProcStatus]  # newest first


class SubscribeParams(Params):
    proc: ProcId
    since: Annotated[int, msgspec.Meta(ge=0)] = 0  # byte offset, applied to both streams
    facts: FactsMode = "summary"  # "full": the `proc.exit` result carries `facts` too


class SubscribeResult(Result):
    proc: str
    subscribed: bool


class OutputNotice(Result):
    """`proc.output` notification: bytes [offset, offset + len) of one stream.

    `data` is UTF-8 text, or `data_b64` when the piece is not valid UTF-8 as cut. When
    the subscriber fell too far behind, `skipped_from` is set: bytes [skipped_from,
    offset) were skipped (they stay readable: resubscribe with `since`, or the artifact).
    """

    proc: str
    stream: Literal["stdout", "stderr"]
    offset: int
    data: str | None = None
    data_b64: str | None = None
    skipped_from: int | None = None


method(
    "proc.start",
    StartParams,
    StartResult,
    mutating=True,
    doc="Start argv like proc.run; answer {proc} once it runs (refusals as proc.run).",
)
method(
    "proc.wait",
    WaitParams,
    WaitResult,
    doc="The proc.run result once the process ends, or {proc, state: running|lost}.",
)
method(
    "proc.signal",
    SignalParams,
    SignalResult,
    doc="Send INT, TERM or KILL to every process of the command, from the host.",
)
method("proc.status", ProcParams, ProcStatus, doc="A process's record and output sizes.")
method("proc.list", ListParams, ListResult, doc="Recent processes, newest first (bounded).")
method(
    "proc.subscribe",
    SubscribeParams,
    SubscribeResult,
    doc="Stream proc.output notifications from byte `since`, then one proc.exit.",
    notifications=(("proc.output", OutputNotice), ("proc.exit", WaitResult)),
)


# --- streaming stdin (docs/protocol.md §14: proc.write) ----------------------------------------

#: The most bytes one `proc.write` may carry (decoded); a request line holds it as base64.
MAX_WRITE_BYTES = 256 << 10
#: Bytes a streamed stdin holds that the command has not taken yet; a write that would
#: pass it waits for room (`STDIN_WAIT_S`), then is `limit_exceeded`.
STDIN_BUFFER_BYTES = 1 << 20


class WriteParams(Params):
    """Bytes for the stdin of a command started with `stdin: "stream"`: `data` (UTF-8
    text) or `data_b64` (not both), at most `MAX_WRITE_BYTES` (256 KiB) decoded, else
    `too_large`; either may be absent (an `eof` alone). Only the caller that started
    the command (same socket and uid) or the operator may write (`unauthorized`)."""

    proc: ProcId
    data: Annotated[str, msgspec.Meta(max_length=MAX_WRITE_BYTES)] | None = None
    data_b64: Annotated[str, msgspec.Meta(max_length=4 * (MAX_WRITE_BYTES // 3 + 1))] | None = None
    eof: bool = False  # after these bytes, close the command's stdin


class WriteResult(Result):
    """`accepted`: bytes of this call taken (all of them: a refusal takes none);
    `buffered`: bytes taken that the command has not been handed yet; `written`: bytes
    handed to the command's stdin so far, in all; `eof`: EOF is sent, or will be after
    the buffered bytes."""

    proc: str
    accepted: int
    buffered: int
    written: int
    eof: bool


method(
    "proc.write",
    WriteParams,
    WriteResult,
    doc="Write to the stdin of a command started with stdin: stream; eof closes it.",
)
