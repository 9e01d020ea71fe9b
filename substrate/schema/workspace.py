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


class WorkspaceInfo(Result):
    workspace: str
    root_id: str
    vcs: Vcs | None
    policy: Policy
    adopted: float = 0.0


class WorkspaceRef(Params):
    workspace: WorkspaceId


class WorkspaceList(Result):
    workspaces: list[WorkspaceInfo]


class ReleaseResult(Result):
    workspace: str
    released: bool


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
method("workspace.release", WorkspaceRef, ReleaseResult, doc="Forget it; stop its containers.")
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
