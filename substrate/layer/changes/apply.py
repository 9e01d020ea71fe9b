"""Applying a change set to the checkout, one change at a time, through the guarded path.

Theory of operation. `apply` takes the changes in the set's order (`changeset.ordered`)
and hands each to the `Writer`: a file's new bytes are read from the upper layer
(through its dir fd, never following a symlink, checked against `new_sha256`) and go
through `Writer.apply_change` - policy (`write_deny`, `write_allow`, `require_approval`),
the base re-checked under the commit lock, a same-directory temp file renamed over the
target with the old owner (the workspace owner's for a new file), a journal entry - a
directory through `Writer.batch.apply_dirs`, and a symlink through
`Writer.batch.apply_links` (`links.apply_links`: `symlinkat` into a temp name, renamed
over, the target never followed). Nothing here writes the checkout itself.

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
import os
import stat
from typing import Literal

import msgspec

from substrate.errors import ApprovalRequired, PathDenied, Refusal
from substrate.fs import paths
from substrate.layer.changes import links
from substrate.layer.changes.changeset import Change, ChangeSet, Op
from substrate.layer.changes.links import apply_links
from substrate.workspace import discoverable
from substrate.workspace.policy import denying_rule
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import (
    STREAM_BYTES,
    TEMP_PREFIX,
    DirChange,
    DirOp,
    FileChange,
    Landing,
    Streamed,
    Writer,
    hash_fd_bounded,
)

Outcome = Literal["applied", "unchanged", "blocked", "pending", "conflict"]


class Outcomes(msgspec.Struct, frozen=True, kw_only=True):
    """What became of one change."""

    path: str
    op: Op
    kind: Literal["file", "dir", "symlink"]
    outcome: Outcome
    #: Why it was not applied: a refusal name (`path_denied`, `stale_base`, ...) or
    #: `not_empty`, `layer_changed`.
    reason: str | None = None
    #: The policy rule that blocked it: a `write_deny` glob, `.git/**`, `write_allow`
    #: (outside every allowed glob) or `reserved` (substrate's temp-file prefix).
    rule: str | None = None
    plan_digest: str | None = None
    #: A conflict's checkout digest now (None: absent, or neither a file nor a link; a
    #: link's is its target's, `links.digest`).
    current_sha256: str | None = None
    #: A conflict's version from the command: its path in the upper layer, left there.
    kept: str | None = None


class ApplyResult(msgspec.Struct, frozen=True, kw_only=True):
    applied: tuple[Outcomes, ...] = ()
    unchanged: tuple[Outcomes, ...] = ()
    blocked: tuple[Outcomes, ...] = ()
    pending: tuple[Outcomes, ...] = ()
    conflicts: tuple[Outcomes, ...] = ()


def _current(ws: Workspace, parts: tuple[str, ...], limit: int) -> str | None:
    """A conflict's checkout digest now: None when absent, neither a regular file nor a
    symlink (whose digest is its target's: read, never followed), or over `limit` bytes
    (a file is hashed as a stream)."""
    try:
        with paths.opened_dir(ws.root_fd, parts[:-1], "/".join(parts)) as parent:
            st = paths.lstat_at(parent, parts[-1])
            if st is not None and stat.S_ISLNK(st.st_mode):
                return links.digest(links.read_target(parent, parts[-1]))
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            fd = paths.open_regular(parent, parts[-1], parts[-1])
            try:
                hashed = hash_fd_bounded(fd, limit)
            finally:
                os.close(fd)
            return None if hashed is None else hashed[0]
    except (Refusal, OSError):
        return None


#: A file of the upper layer: never through a symlink, never blocking on a FIFO (a
#: regular file's reads ignore O_NONBLOCK).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class _Upper:
    """The command's bytes of a change, read from the upper layer through dir fds (never
    following a symlink): whole, or past `STREAM_BYTES` as an open fd to stream from
    (`Streamed`); None when not a regular file or over `limit` bytes. Holds the last
    directory it read from (files come sorted by path) until `close`."""

    def __init__(self, upper_fd: int, limit: int) -> None:
        self._fd = upper_fd
        self._limit = limit
        self._held: tuple[tuple[str, ...], int] | None = None

    def __call__(self, path: str) -> bytes | Streamed | None:
        parts = tuple(path.split("/"))
        try:
            if self._held is None or self._held[0] != parts[:-1]:
                self.close()
                self._held = (parts[:-1], paths.open_dir(self._fd, parts[:-1], path))
            fd = os.open(parts[-1], _READ_FLAGS, dir_fd=self._held[1])
        except (Refusal, OSError):
            return None
        try:
            st = os.fstat(fd)
            # Several links are fine (hard links made in the sandbox: each name becomes
            # a separate file); the bytes are checked against the digest scanned.
            if not stat.S_ISREG(st.st_mode) or st.st_size > self._limit:
                os.close(fd)
                return None
            if st.st_size > STREAM_BYTES:
                return Streamed(fd, st.st_size)  # the batch copies, checks and closes it
            # One read of a byte more than its size: the batch checks the digest, so
            # bytes that grew or shrank since are refused there (`layer_changed`).
            data = os.pread(fd, st.st_size + 1, 0)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        return data

    def close(self) -> None:
        if self._held is not None:
            os.close(self._held[1])
            self._held = None


#: The apply's phases, in order: file deletes, symlink deletes, directory deletes
#: (deepest first), new directories (shallowest first), files made or changed,
#: symlinks made or replaced, directory modes (deepest first). Within a phase the
#: set's order (`changeset.ordered`) holds.
_PHASES = (
    ("delete", "file"),
    ("delete", "symlink"),
    ("delete", "dir"),
    ("mkdir", "dir"),
    ("write", "file"),
    ("write", "symlink"),
    ("chmod", "dir"),
)
_DIR_OPS: dict[str, DirOp] = {"delete": "rmdir", "mkdir": "mkdir", "chmod": "chmod"}


def _phase(change: Change) -> int:
    op = "write" if change.kind != "dir" and change.op != "delete" else change.op
    return _PHASES.index((op, change.kind))


def _outcome(ws: Workspace, change: Change, landing: Landing, limit: int) -> Outcomes:
    def out(outcome: Outcome, **kw: str | None) -> Outcomes:
        return Outcomes(path=change.path, op=change.op, kind=change.kind, outcome=outcome, **kw)

    match landing.status:
        case "applied":
            return out("applied", plan_digest=landing.plan_digest)
        case "unchanged":
            return out("unchanged")
        case "source_changed":
            return out("conflict", reason="layer_changed")
        case "failed":
            code = landing.error.errno if landing.error is not None else None
            reason = (
                "not_empty"
                if code == errno.ENOTEMPTY
                else errno.errorcode.get(code or 0, "os_error").lower()
            )
            return _conflict(ws, change, reason, limit)
    refusal = landing.refusal
    why = discoverable.blocked_reason(refusal)  # git_dir, control_character, bidi_control
    if why is not None:
        return out("blocked", reason=why)
    if isinstance(refusal, PathDenied):
        rule = denying_rule(ws.policy, change.path, TEMP_PREFIX)
        return out("blocked", reason=PathDenied.name, rule=rule)
    if isinstance(refusal, ApprovalRequired):
        return out("pending", reason=refusal.name, plan_digest=refusal.data.get("plan_digest"))
    # stale_base, already_exists, not_found, symlink_refused, ...
    return _conflict(ws, change, refusal.name if refusal is not None else "internal", limit)


def _conflict(ws: Workspace, change: Change, reason: str, limit: int) -> Outcomes:
    return Outcomes(
        path=change.path,
        op=change.op,
        kind=change.kind,
        outcome="conflict",
        reason=reason,
        current_sha256=_current(ws, tuple(change.path.split("/")), limit),
        # A link's version is its target, in the entry: nothing to keep in the layer.
        kept=change.path
        if change.kind == "file" and change.op in ("create", "replace", "chmod")
        else None,
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
    """Apply `changeset` (scanned from the upper layer `upper_fd`) to `ws`'s checkout
    through the guarded path, phase by phase (`_PHASES`), each phase one batch
    (`Writer.batch`); never refuses as a whole (each change's outcome says what became of
    it; the lists keep the set's order). `dry_run`: the same checks, nothing written;
    `applied` then means "would be applied" (a change after a directory the set would
    make, or bound to a file an earlier change would write, may be reported as a
    conflict it would not be). Costs, per file, a read and hash of the checkout's file
    (two when it exists) and of the command's, a temp file and a rename; per batch of up
    to `writes.batch.CHUNK` files, two transactions, a `syncfs` for the temp files and one
    for the directories written in (an fsync when there is one)."""
    changes = changeset.changes
    results: list[Outcomes | None] = [None] * len(changes)
    by_phase: list[list[int]] = [[] for _ in _PHASES]
    for i, change in enumerate(changes):
        by_phase[_phase(change)].append(i)
    with ws.use():
        for (op, kind), indices in zip(_PHASES, by_phase, strict=True):
            if not indices:
                continue
            if kind == "symlink":
                landings = apply_links(writer, ws, [changes[i] for i in indices], actor, dry_run)
            elif kind == "file":
                files = [
                    FileChange(c.path, c.base_sha256, c.new_sha256, c.size, c.mode)
                    for c in (changes[i] for i in indices)
                ]
                upper = _Upper(upper_fd, writer.batch.max_file_bytes)
                try:
                    landings = writer.batch.apply_files(ws, files, upper, actor, dry_run=dry_run)
                finally:
                    upper.close()
            else:
                dirs = [DirChange(changes[i].path, _DIR_OPS[op], changes[i].mode) for i in indices]
                landings = writer.batch.apply_dirs(ws, dirs, actor, dry_run=dry_run)
            for i, landing in zip(indices, landings, strict=True):
                results[i] = _outcome(ws, changes[i], landing, writer.batch.max_file_bytes)
    lists: dict[Outcome, list[Outcomes]] = {
        "applied": [],
        "unchanged": [],
        "blocked": [],
        "pending": [],
        "conflict": [],
    }
    for result in results:
        assert result is not None
        lists[result.outcome].append(result)
    return ApplyResult(
        applied=tuple(lists["applied"]),
        unchanged=tuple(lists["unchanged"]),
        blocked=tuple(lists["blocked"]),
        pending=tuple(lists["pending"]),
        conflicts=tuple(lists["conflict"]),
    )
