"""Wire schema of workspaces and approvals (docs/protocol.md §2, §4)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import Params, Result, WorkspaceId, method

RootId = Annotated[str, msgspec.Meta(pattern="^[a-z0-9][a-z0-9-]{0,63}$")]
Glob = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
#: At most this many globs in one list of a policy, given or effective (`limit_exceeded`).
MAX_GLOBS = 1024
Globs = Annotated[list[Glob], msgspec.Meta(max_length=MAX_GLOBS)]


class Policy(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Path policy, gitignore-style globs on workspace-relative paths.

    `.git/**` is always part of `write_deny`, whatever the caller gives, and every `.git`
    deeper down is write-denied too. In a result this is the effective policy: the
    operator's default, what was set for the checkout, and the rules inherited from
    checkouts nested in it or enclosing it (docs/protocol.md §2).
    """

    write_allow: Globs = msgspec.field(default_factory=list)  # empty: all allowed
    write_deny: Globs = msgspec.field(default_factory=lambda: [".git/**"])
    read_deny: Globs = msgspec.field(default_factory=list)
    require_approval: Globs = msgspec.field(default_factory=list)


class Vcs(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["git"]
    head: str | None  # the commit sha, or None on an unborn branch


class AdoptParams(Params):
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    root_id: RootId | None = None
    policy: Policy | None = None


class HomeUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What the workspace's persistent home holds (docs/protocol.md §12): a bounded walk
    that never follows a symlink; with `truncated` the figures are a lower bound."""

    bytes: int  # apparent size of the files (st_size), each hard-linked file once
    files: int  # entries that are not directories (symlinks included)
    truncated: bool = False


class GitLayerUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What the checkout's git layer holds (docs/working-layer.md, "The git layer"):
    its sandboxes' `.git` writes, kept until `workspace.release {keep_git: false}`."""

    bytes: int  # apparent size of its files (a lower bound past 200,000 entries)


class WorkspaceInfo(Result):
    workspace: str
    root_id: str
    vcs: Vcs | None
    policy: Policy
    adopted: float = 0.0
    #: `workspace.info` only: the persistent home's size (absent before its first sandbox).
    home: HomeUsage | None = None
    #: `workspace.info` only: the git layer's size (absent before its first layer sandbox).
    git_layer: GitLayerUsage | None = None


class WorkspaceRef(Params):
    workspace: WorkspaceId


class WorkspaceList(Result):
    workspaces: list[WorkspaceInfo]


class ReleaseParams(Params):
    workspace: WorkspaceId
    #: false: remove the persistent home with the workspace (the checkout's, for every
    #: later adoption too); true keeps it for the next adoption of the same checkout.
    keep_home: bool = True
    #: false: remove the checkout's git layer (its sandboxes' HEAD, index, branches,
    #: stashes, objects not applied); true keeps it for the next adoption.
    keep_git: bool = True


class ReleaseResult(Result, omit_defaults=False):
    workspace: str
    released: bool
    #: What became of the persistent home: `kept`, `removed`, or `none` (it had none).
    home: Literal["kept", "removed", "none"] = "kept"
    #: What became of the git layer: `kept`, `removed`, or `none` (it had none).
    git: Literal["kept", "removed", "none"] = "kept"


class SetPolicyParams(Params):
    workspace: WorkspaceId
    policy: Policy


class ApprovalGrantParams(Params):
    workspace: WorkspaceId
    plan_digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 600.0


class ApprovalGrantResult(Result):
    approval_id: str
    expires: float


method("workspace.adopt", AdoptParams, WorkspaceInfo, doc="Adopt a checkout as a workspace.")
method("workspace.info", WorkspaceRef, WorkspaceInfo)
method(
    "workspace.release",
    ReleaseParams,
    ReleaseResult,
    doc="Forget it; stop its containers; keep its persistent home unless keep_home is "
    "false, and its git layer unless keep_git is false.",
)
method(
    "workspace.set_policy",
    SetPolicyParams,
    WorkspaceInfo,
    operator_only=True,
    doc="Set the operator's policy of this checkout (kept across release and restarts).",
)
method(
    "approval.grant",
    ApprovalGrantParams,
    ApprovalGrantResult,
    operator_only=True,
    doc="Approve one apply of exactly this plan digest.",
)


class WorkspaceListParams(Params):
    pass


method("workspace.list", WorkspaceListParams, WorkspaceList)


# --- checkpoints (docs/protocol.md §11) -----------------------------------------------------

CheckpointId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: Each list of a restore result shows at most this many files; `counts` has them all.
MAX_RESTORE_LISTED = 1000


class CheckpointParams(Params):
    workspace: WorkspaceId


class CheckpointResult(Result):
    checkpoint: str
    seq: int  # the journal entry of the checkpoint: later writes have later seqs


class RestoreParams(Params):
    workspace: WorkspaceId
    checkpoint: CheckpointId
    dry_run: bool = False


class RestoreFile(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a restore does (or, in a dry run, would do) to one file substrate changed
    since the checkpoint. `path` is `root_id:rel`."""

    path: str
    #: `put_back`: the checkpoint's bytes and mode; `delete`: substrate created the file
    #: since the checkpoint.
    action: Literal["put_back", "delete"]
    sha256: str | None = None  # the checkpoint's bytes (put_back)
    mode: int | None = None  # the checkpoint's mode, set-id bits dropped (put_back)
    #: What substrate last left there (None: it deleted the file): the restore's base.
    base_sha256: str | None = None
    #: A conflict's bytes now (None: absent, or not a regular file).
    current_sha256: str | None = None
    #: Why it is not restored: `changed_since` (a host edit since substrate's last
    #: write), `preimage_missing`, or the guarded path's refusal name.
    reason: str | None = None
    rule: str | None = None  # blocked: the policy rule
    plan_digest: str | None = None  # restored and pending: the guarded write's plan


class RestoreCounts(msgspec.Struct, frozen=True, kw_only=True):
    restored: int
    unchanged: int
    conflicts: int
    blocked: int
    pending: int


class RestoreResult(Result):
    """Each file substrate changed since the checkpoint, in one list. `restored`: put back
    or deleted (in a dry run: would be); `unchanged`: already as at the checkpoint;
    `conflicts`: changed since by someone else, never overwritten; `blocked`: the
    policy denies it now; `pending`: needs an operator approval of `plan_digest`."""

    checkpoint: str
    seq: int
    dry_run: bool
    restored: list[RestoreFile]
    unchanged: list[RestoreFile]
    conflicts: list[RestoreFile]
    blocked: list[RestoreFile]
    pending: list[RestoreFile]
    counts: RestoreCounts
    #: Some list holds fewer files than its count (at most `MAX_RESTORE_LISTED` each).
    truncated: bool = False


method(
    "workspace.checkpoint",
    CheckpointParams,
    CheckpointResult,
    mutating=True,
    doc="Mark the workspace's state: a later restore puts back what substrate changed since.",
)
# Shielded: a started restore writes files; it finishes and is answered across a shutdown.
method(
    "workspace.restore",
    RestoreParams,
    RestoreResult,
    mutating=True,
    shielded=True,
    doc="Put back every file substrate changed since the checkpoint, through the guarded "
    "path; a file changed on the host since is a conflict, never overwritten.",
)
