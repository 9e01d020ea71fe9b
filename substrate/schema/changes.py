"""Wire schema of kept change sets (docs/protocol.md §11): `changes.get/apply/discard`.

`changes.get`, `changes.apply`, `changes.discard` on the change set of a command run on
a `workspace = "layer"` profile, named by the `changeset` id of its result's
`changes`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.schema.common import Params, RelPath, Result, method
from substrate.schema.proc import ChangeCounts, ChangeEntry

ChangesetId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: At most this many `paths` in one `changes.apply`.
MAX_APPLY_PATHS = 10_000
#: `applying`: being applied whole now (a crash leaves it so: the next start finishes it).
ChangesetState = Literal["pending", "applying", "applied", "discarded"]
#: A set's layer (upper and work dirs): `kept` on disk, or `removed` once the set was
#: applied whole with nothing pending and every conflict's version kept as an artifact
#: (or discarded). A removed layer has nothing left to apply.
LayerState = Literal["kept", "removed"]


class ChangesetParams(Params):
    changeset: ChangesetId


#: A change's operation; `ref`: a git ref the sandbox created, moved or deleted in its
#: git layer (docs/working-layer.md, "The git layer").
Op = Literal["create", "replace", "delete", "chmod", "mkdir", "ref"]


class Change(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One step of a change set, applied through the guarded write path.

    `base_sha256` is the checkout's file the command saw (None: there was none, or a
    directory); `new_sha256`, `size` and `mode` what the command left (None / 0 for a
    delete). `diff` is a bounded unified preview.

    A symlink (`kind: "symlink"`, op create, replace or delete) is digested as git
    digests one: `base_sha256`/`new_sha256` are the SHA-256 of its target's bytes and
    `size` their length. `target` is what the command's link points to, verbatim (never
    followed or resolved by substrate), and `escapes` whether it leaves the checkout,
    resolved lexically from the link's directory (an absolute target always does);
    both None for a delete (docs/working-layer.md, "Symlinks").

    A `ref` entry (`op: "ref"`): `path` is the ref's name, `old_oid` what the
    sandbox started from and `new_oid` where it left it (None: absent), `subjects` the
    subjects of its new commits, newest first (at most 20).
    """

    path: str
    op: Op
    kind: Literal["file", "dir", "symlink"] = "file"
    base_sha256: str | None = None
    new_sha256: str | None = None
    size: int = 0
    mode: int | None = None
    diff: str = ""
    diff_truncated: bool = False
    target: str | None = None
    escapes: bool | None = None
    old_oid: str | None = None
    new_oid: str | None = None
    subjects: tuple[str, ...] = ()


class Blocked(msgspec.Struct, frozen=True, kw_only=True):
    """A path the change set never applies: what stood there (`kind`) and why (`symlink`:
    a link the profile's `symlinks` refuses; `target_too_long`, `target_not_utf8`,
    `target_control_character`: a link's target substrate will not make; a device,
    FIFO or socket, ..., `host_changed`: the host changed, removed or renamed away the
    checkout's file while the command ran, or a scan bound the path passes: `too_deep`,
    `too_long`, `too_many`, `too_large`, whose part stays in the set's layer)."""

    path: str
    kind: str
    reason: str


class KeptVersion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The command's version of a file that conflicted (the host changed it meanwhile,
    or the checkout was not at its base), kept as the artifact `artifact` (`proc` is the
    change set's id, `stream` "conflict"; read with `artifact.read`). Without an
    artifact, `reason` says why: `too_large` (over the per-file cap), `set_full` (the
    set's cap of kept bytes or files), `failed` (it could not be read or stored), or
    `empty` (no bytes: nothing to keep). `sha256`/`size` are the version's."""

    path: str
    size: int
    sha256: str | None = None
    artifact: str | None = None
    reason: str | None = None


class ChangesetInfo(Result):
    """A kept change set. `state`: `pending` (kept for review), `applied` (applied once
    as a whole; applying it again applies nothing twice) or `discarded`. `changes` and
    `blocked` hold at most 1,000 entries each; `total_changes`/`total_blocked` count
    them all. Each change's `diff` is bounded, and one answer carries at most 1 MiB of
    diff text (later changes then have none, `diff_truncated`). `layer`: whether the
    set's layer is still on disk; `versions`: its conflicts' versions kept as artifacts
    (at most 1,000)."""

    changeset: str
    workspace: str
    generation: int
    state: ChangesetState
    created: float  # unix time
    updated: float
    changes: list[Change]
    blocked: list[Blocked]
    total_changes: int
    total_blocked: int
    layer: LayerState = "kept"
    versions: list[KeptVersion] = msgspec.field(default_factory=list)


class ChangesApplyParams(Params):
    changeset: ChangesetId
    #: Only the changes at or beneath these workspace-relative paths; None: all.
    paths: Annotated[list[RelPath], msgspec.Meta(max_length=MAX_APPLY_PATHS)] | None = None
    dry_run: bool = False  # check everything, write nothing


class ChangesApplyResult(Result):
    """What became of each change (the lists of `proc.run`'s `changes`, at most 1,000
    entries each, `counts` the totals; `unchanged`: the checkout held it already).
    `unmatched`: the `paths` that named no change. With `dry_run`, `applied` lists what
    would be applied. A conflict's `artifact` is the command's version (`ChangeEntry`).
    `layer`: "removed" once the set is settled (applied whole, nothing pending, every
    conflict's version an artifact): a later apply has nothing left and answers empty
    lists."""

    changeset: str
    state: ChangesetState
    dry_run: bool
    applied: list[ChangeEntry]
    blocked: list[ChangeEntry]
    pending: list[ChangeEntry]
    conflicts: list[ChangeEntry]
    counts: ChangeCounts
    unmatched: list[str] = msgspec.field(default_factory=list)
    layer: LayerState = "kept"


class ChangesDiscardResult(Result):
    changeset: str
    state: ChangesetState


method("changes.get", ChangesetParams, ChangesetInfo, doc="A kept change set and its state.")
method(
    "changes.apply",
    ChangesApplyParams,
    ChangesApplyResult,
    mutating=True,
    shielded=True,
    doc="Apply a kept change set (all, or the named paths) through the guarded path, "
    "bases re-checked; a file changed since is a conflict, never overwritten.",
)
method(
    "changes.discard",
    ChangesetParams,
    ChangesDiscardResult,
    mutating=True,
    shielded=True,
    doc="Remove a kept change set's layer; nothing of it lands afterwards.",
)
