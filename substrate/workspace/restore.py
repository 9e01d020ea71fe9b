"""`workspace.restore`: put back what substrate changed since a checkpoint, through the
guarded path (docs/protocol.md §11).

Theory of operation. For each path substrate wrote since the checkpoint
(`Checkpoints.changed_since`: its state at the checkpoint and the digest substrate last
left there), the file as it is now decides:
- already as at the checkpoint (bytes and mode; or absent when it was absent):
  `unchanged`, nothing done (so a second restore does nothing);
- not what substrate last left there (other bytes, absent after our write, present after
  our delete, not a regular file): a `conflict` (`changed_since`): someone else changed it
  since, and it is never overwritten;
- else `Writer.restore_file` puts the pre-image back (its bytes and mode) or deletes a
  file substrate created, bound to the digest substrate last wrote there as its base:
  policy, `require_approval`, the base re-checked under the commit lock, an atomic
  same-directory replace, one `workspace.restore_file` journal entry per file (and its own
  pre-image kept, so a later checkpoint can undo the restore too). A refusal on the way
  makes it `blocked` (policy), `pending` (approval) or a `conflict` (any other).

Deletes come first, then put-backs, each in path order; missing parent directories of a
put-back are made. Directories are not restored: one substrate made stays (emptied), one
it removed is made again only as the parent of a file put back. A dry run changes
nothing and lists what a restore would do now (a path under `require_approval` is
listed `pending` with the digest to approve). Blocking I/O: call from a worker thread.
"""

from __future__ import annotations

import errno
import hashlib
import stat

from substrate.errors import ApprovalRequired, NotFound, PathDenied, PathInvalid, Refusal
from substrate.fs import fsops, paths
from substrate.schema.workspace import (
    MAX_RESTORE_LISTED,
    RestoreCounts,
    RestoreFile,
    RestoreResult,
)
from substrate.store.journal import Journal
from substrate.workspace import discoverable
from substrate.workspace.checkpoints import Checkpoints, History
from substrate.workspace.policy import denying_rule
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import MAX_PATCH_FILE, TEMP_PREFIX, Writer

LISTS = ("restored", "unchanged", "conflicts", "blocked", "pending")


def _now(ws: Workspace, rel: str) -> tuple[str, int | None, str | None]:
    """(kind, mode, sha256) of what stands at `rel` now; kind `absent` when nothing does,
    sha256 only for a regular file the guarded path can hold."""
    parts = paths.split_relpath(rel)
    try:
        with paths.opened_dir(ws.root_fd, parts[:-1], rel) as parent:
            st = paths.lstat_at(parent, parts[-1])
            if st is None:
                return "absent", None, None
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PATCH_FILE:
                return "other", None, None
            fst, data = fsops.read_regular(parent, parts[-1], MAX_PATCH_FILE, rel)
    except NotFound:
        return "absent", None, None
    except Refusal:
        return "other", None, None
    return "file", stat.S_IMODE(fst.st_mode), hashlib.sha256(data).hexdigest()


def _one(
    writer: Writer, cps: Checkpoints, ws: Workspace, h: History, dry_run: bool, actor: str
) -> tuple[str, RestoreFile]:
    """Which list `h` lands in, and its entry; restores it unless `dry_run`."""
    mode = None if h.mode is None else h.mode & ~(stat.S_ISUID | stat.S_ISGID)
    put_back = h.sha256 is not None

    def entry(**kw: str | None) -> RestoreFile:
        return RestoreFile(
            path=ws.provenance(h.rel),
            action="put_back" if put_back else "delete",
            sha256=h.sha256,
            mode=mode,
            base_sha256=h.last_sha256,
            **kw,
        )

    kind, now_mode, now_sha = _now(ws, h.rel)
    if (kind == "absent" and not put_back) or (
        kind == "file" and now_sha == h.sha256 and now_mode == mode
    ):
        return "unchanged", entry()
    if kind == "other" or now_sha != h.last_sha256:
        return "conflicts", entry(reason="changed_since", current_sha256=now_sha)
    data = None
    if h.sha256 is not None:
        data = cps.read_blob(h.sha256, MAX_PATCH_FILE)
        if data is None:
            return "conflicts", entry(reason="preimage_missing", current_sha256=now_sha)
    try:
        plan = writer.restore_file(ws, h.rel, h.last_sha256, data, mode, dry_run, actor)
    except (PathDenied, PathInvalid) as exc:
        why = discoverable.blocked_reason(exc)  # git_dir, control_character, bidi_control
        if why is not None:
            return "blocked", entry(reason=why)
        if isinstance(exc, PathInvalid):
            return "conflicts", entry(reason=exc.name, current_sha256=now_sha)
        return "blocked", entry(
            reason=PathDenied.name, rule=denying_rule(ws.policy, h.rel, TEMP_PREFIX)
        )
    except ApprovalRequired as exc:
        return "pending", entry(reason=exc.name, plan_digest=exc.data.get("plan_digest"))
    except Refusal as exc:  # stale_base (a host edit just now), not_a_file, ...
        return "conflicts", entry(reason=exc.name, current_sha256=_now(ws, h.rel)[2])
    except OSError as exc:
        reason = errno.errorcode.get(exc.errno or 0, "os_error").lower()
        return "conflicts", entry(reason=reason, current_sha256=_now(ws, h.rel)[2])
    if dry_run and ws.policy.needs_approval(h.rel):
        return "pending", entry(reason=ApprovalRequired.name, plan_digest=plan.plan_digest)
    return "restored", entry(plan_digest=plan.plan_digest)


def restore(
    writer: Writer,
    cps: Checkpoints,
    journal: Journal,
    ws: Workspace,
    checkpoint: str,
    dry_run: bool,
    actor: str,
) -> RestoreResult:
    """`workspace.restore` (see the module doc). Refuses `checkpoint_unknown` (also for
    an expired one, with `expired: true`) before touching anything; after that never
    refuses as a whole: each file's list says what became of it. Journals
    `workspace.restore` with the counts unless `dry_run`. Costs, per file substrate
    changed since, a read and hash of it and of its pre-image, plus the guarded write."""
    lists: dict[str, list[RestoreFile]] = {name: [] for name in LISTS}
    counts = dict.fromkeys(LISTS, 0)
    with cps.pinned(checkpoint), ws.use():
        seq = cps.seq_of(ws, checkpoint)
        for created in (True, False):
            for h in cps.changed_since(ws, seq, created=created):
                where, item = _one(writer, cps, ws, h, dry_run, actor)
                counts[where] += 1
                if len(lists[where]) < MAX_RESTORE_LISTED:
                    lists[where].append(item)
    if not dry_run:
        journal.append(
            "workspace.restore",
            {"checkpoint": checkpoint, "seq": seq, **counts},
            workspace=ws.id,
            actor=actor,
        )
    return RestoreResult(
        checkpoint=checkpoint,
        seq=seq,
        dry_run=dry_run,
        restored=lists["restored"],
        unchanged=lists["unchanged"],
        conflicts=lists["conflicts"],
        blocked=lists["blocked"],
        pending=lists["pending"],
        counts=RestoreCounts(**counts),
        truncated=any(counts[name] > len(lists[name]) for name in LISTS),
    )
