"""Applying a change set to the checkout, one change at a time, through the guarded path.

Theory of operation. `apply` takes the changes in the set's order (`changeset.ordered`)
and hands each to the `Writer`: a file's new bytes are read from the upper layer
(through its dir fd, never following a symlink, checked against `new_sha256`) and go
through `Writer.apply_change` - policy (`write_deny`, `write_allow`, `require_approval`),
the base re-checked under the commit lock, a same-directory temp file renamed over the
target with the old owner (the workspace owner's for a new file), a journal entry - and
a directory through `Writer.apply_dir`. Nothing here writes the checkout itself.

Each change ends in one of five lists:
- `applied`;
- `unchanged`: the checkout already holds what the change makes (a second apply of the
  same set applies nothing twice);
- `blocked`: the policy refuses the path (`path_denied`, with the `rule`);
- `pending`: `require_approval` matches; the `plan_digest` to approve is given and
  nothing is applied;
- `conflicts`: the checkout is not at the change's base (a host edit meanwhile, or
  anything else the guarded path refuses): it is never overwritten, and `kept` names the
  command's version, left in the upper layer for the caller to keep as an artifact.

One change failing never stops the others; the set is not atomic as a whole (crash
recovery of a half-applied set is not done yet: docs/working-layer.md). Blocking I/O:
call it from a worker thread.
"""

from __future__ import annotations

import errno
import hashlib
import stat
from typing import Literal

import msgspec

from substrate.errors import ApprovalRequired, NotFound, PathDenied, Refusal
from substrate.workspace import fsops, paths
from substrate.workspace.layer.changeset import Change, ChangeSet, Op
from substrate.workspace.layer.scan import MAX_FILE_BYTES
from substrate.workspace.policy import CompiledPolicy, GlobSet, is_git_path
from substrate.workspace.registry import Workspace
from substrate.workspace.temp_files import TEMP_PREFIX
from substrate.workspace.writes import Writer

Outcome = Literal["applied", "unchanged", "blocked", "pending", "conflict"]


class Outcomes(msgspec.Struct, frozen=True, kw_only=True):
    """What became of one change."""

    path: str
    op: Op
    kind: Literal["file", "dir"]
    outcome: Outcome
    #: Why it was not applied: a refusal name (`path_denied`, `stale_base`, ...) or
    #: `not_empty`, `layer_changed`.
    reason: str | None = None
    #: The policy rule that blocked it: a `write_deny` glob, `.git/**`, `write_allow`
    #: (outside every allowed glob) or `reserved` (substrate's temp-file prefix).
    rule: str | None = None
    plan_digest: str | None = None
    #: A conflict's checkout digest now (None: absent, or not a file).
    current_sha256: str | None = None
    #: A conflict's version from the command: its path in the upper layer, left there.
    kept: str | None = None


class ApplyResult(msgspec.Struct, frozen=True, kw_only=True):
    applied: tuple[Outcomes, ...] = ()
    unchanged: tuple[Outcomes, ...] = ()
    blocked: tuple[Outcomes, ...] = ()
    pending: tuple[Outcomes, ...] = ()
    conflicts: tuple[Outcomes, ...] = ()


def denying_rule(policy: CompiledPolicy, rel: str) -> str:
    """The rule a denied `rel` falls under (see `Outcomes.rule`); `filesystem` if none."""
    if any(part.startswith(TEMP_PREFIX) for part in rel.split("/")):
        return "reserved"
    if is_git_path(rel):
        return ".git/**"
    for pattern in policy.write_deny.patterns:
        if GlobSet.of([pattern]).matches(rel):
            return pattern
    if policy.write_allow and not policy.write_allow.matches(rel):
        return "write_allow"
    return "filesystem"


def _current(ws: Workspace, parts: tuple[str, ...]) -> tuple[str, int | None, str | None]:
    """What the checkout holds at `parts` now: (kind, mode, a file's sha256); kind is
    `absent` when nothing (or no directory above it) is there."""
    try:
        with paths.opened_dir(ws.root_fd, parts[:-1], "/".join(parts)) as parent:
            st = paths.lstat_at(parent, parts[-1])
            if st is None:
                return "absent", None, None
            kind = paths.kind_of(st.st_mode)
            if kind != "file" or st.st_size > MAX_FILE_BYTES:
                return kind, stat.S_IMODE(st.st_mode), None
            fst, data = fsops.read_regular(parent, parts[-1], MAX_FILE_BYTES, parts[-1])
            return kind, stat.S_IMODE(fst.st_mode), hashlib.sha256(data).hexdigest()
    except NotFound:
        return "absent", None, None
    except Refusal:
        return "other", None, None


def _target_mode(mode: int | None) -> int | None:
    # The guarded path never makes a set-id file or directory.
    return None if mode is None else mode & ~(stat.S_ISUID | stat.S_ISGID)


def _already(ws: Workspace, change: Change) -> bool:
    """The checkout already holds what `change` makes."""
    kind, mode, sha = _current(ws, tuple(change.path.split("/")))
    if change.op == "delete":
        return kind == "absent"
    if change.kind == "dir":
        return kind == "dir" and (change.op == "mkdir" or mode == _target_mode(change.mode))
    return kind == "file" and sha == change.new_sha256 and mode == _target_mode(change.mode)


def _upper_bytes(upper_fd: int, change: Change) -> bytes | None:
    """The command's bytes of `change` from the upper layer; None when they are not the
    ones scanned (the layer changed since, or a symlink or hard link stands there)."""
    parts = tuple(change.path.split("/"))
    try:
        with paths.opened_dir(upper_fd, parts[:-1], change.path) as parent:
            fst, data = fsops.read_regular(parent, parts[-1], MAX_FILE_BYTES, change.path)
    except Refusal:
        return None
    if fst.st_nlink != 1 or hashlib.sha256(data).hexdigest() != change.new_sha256:
        return None
    return data


def _one(
    writer: Writer, ws: Workspace, upper_fd: int, change: Change, actor: str, dry_run: bool
) -> Outcomes:
    def out(outcome: Outcome, **kw: str | None) -> Outcomes:
        return Outcomes(path=change.path, op=change.op, kind=change.kind, outcome=outcome, **kw)

    if _already(ws, change):
        return out("unchanged")
    try:
        if change.kind == "dir" and dry_run:
            # Only the policy is checked: a directory step has no base to bind.
            if not ws.policy.may_write(change.path):
                raise PathDenied(change.path)
            return out("pending" if ws.policy.needs_approval(change.path) else "applied")
        if change.kind == "dir":
            dir_op: Literal["mkdir", "rmdir", "chmod"] = (
                "rmdir" if change.op == "delete" else "mkdir" if change.op == "mkdir" else "chmod"
            )
            digest = writer.apply_dir(ws, change.path, dir_op, change.mode, actor)
            return out("applied", plan_digest=digest)
        data = None
        if change.op != "delete":
            data = _upper_bytes(upper_fd, change)
            if data is None:
                return out("conflict", reason="layer_changed")
        plan = writer.apply_change(
            ws, change.path, change.base_sha256, data, change.mode, actor, dry_run
        )
        if dry_run and ws.policy.needs_approval(change.path):
            return out("pending", reason=ApprovalRequired.name, plan_digest=plan.plan_digest)
        return out("applied", plan_digest=plan.plan_digest)
    except PathDenied:
        return out("blocked", reason=PathDenied.name, rule=denying_rule(ws.policy, change.path))
    except ApprovalRequired as exc:
        return out("pending", reason=exc.name, plan_digest=exc.data.get("plan_digest"))
    except Refusal as exc:  # stale_base, already_exists, not_found, symlink_refused, ...
        return _conflict(ws, change, exc.name)
    except OSError as exc:
        reason = (
            "not_empty"
            if exc.errno == errno.ENOTEMPTY
            else errno.errorcode.get(exc.errno or 0, "os_error").lower()
        )
        return _conflict(ws, change, reason)


def _conflict(ws: Workspace, change: Change, reason: str) -> Outcomes:
    _, _, sha = _current(ws, tuple(change.path.split("/")))
    return Outcomes(
        path=change.path,
        op=change.op,
        kind=change.kind,
        outcome="conflict",
        reason=reason,
        current_sha256=sha,
        kept=change.path if change.op in ("create", "replace", "chmod") else None,
    )


def apply(
    writer: Writer,
    ws: Workspace,
    upper_fd: int,
    changeset: ChangeSet,
    actor: str,
    *,
    dry_run: bool = False,
) -> ApplyResult:
    """Apply `changeset` (scanned from the upper layer `upper_fd`) to `ws`'s checkout, in
    its order, each change through the guarded path; never refuses as a whole (each
    change's outcome says what became of it). `dry_run`: the same checks, nothing
    written; `applied` then means "would be applied" (a change after a directory the
    set would make, or bound to a file an earlier change would write, may be reported
    as a conflict it would not be). Costs, per change, a read and hash of the
    checkout's file and of the command's, plus the guarded write (two fsyncs)."""
    lists: dict[Outcome, list[Outcomes]] = {
        "applied": [],
        "unchanged": [],
        "blocked": [],
        "pending": [],
        "conflict": [],
    }
    with ws.use():
        for change in changeset.changes:
            result = _one(writer, ws, upper_fd, change, actor, dry_run)
            lists[result.outcome].append(result)
    return ApplyResult(
        applied=tuple(lists["applied"]),
        unchanged=tuple(lists["unchanged"]),
        blocked=tuple(lists["blocked"]),
        pending=tuple(lists["pending"]),
        conflicts=tuple(lists["conflict"]),
    )
