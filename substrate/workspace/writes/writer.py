"""`Writer`: one guarded write (`fs.write`, `fs.patch`, `fs.delete`); `recover` at start.

One guarded write, `fs.write`, `fs.patch`, `fs.delete` and a restore's file, the only
way substrate changes a file (docs/protocol.md §4); `recover` at start.

Theory of operation. A write is first *planned*, touching nothing (`_plan`): validate
the path, refuse the temp prefix (`temp_files.check_not_reserved`), check the policy,
read the current bytes through the held parent directory fd (`base.read_current`),
refuse what host tools would take for a repository or a misleading new name
(`discoverable.check_write`), check them against `base_sha256`, compute the new bytes,
their digest and the plan digest (`plan.plan_digest`), check a given `plan_digest` and
the operator approval. A dry run returns that plan. To *apply*, the new bytes go to a
temp file created in the same directory (`O_CREAT | O_EXCL | O_NOFOLLOW` through the dir
fd, under a recorded name: `temp_files`), which is fsynced with the old mode and owner;
meanwhile the write's intent (the journal entry it will get, `intents`) commits on
another thread (with the directory's next temp names when it runs low: `top_up`). Then,
under the workspace's commit lock, the base is checked once more (through an fd of the
target kept open across the rename, so the rename does not free the replaced file: the
fd is closed in the background after the directory fsync, `batch.RELEASER`) and the
temp file is renamed over the target through the same dir fd; the directory is
fsynced, and the approval (if any) is consumed and the intent dropped in the same
database transaction
as the journal entry. A write with no approval and no pre-image to keep reserves that
transaction's place in the store's group commit under the lock, then fsyncs the directory after
releasing it (`dir_sync`: one fsync for every write renamed there before it began),
then fills its place with the unit and waits for the commit (`substrate.store.group`),
so no entry is durable before its rename, and no commit waits inside its transaction
for a directory fsync. Concurrent writes share one fsynced commit and one directory
fsync, entries keep the lock's order, and the write returns only once its entry is
durable. The
file-system steps are `substrate.fs.fsops`'s. The writer takes `fs.write` and
`fs.patch` decoded at the edge (`schema.fs.write_request`/`patch_request`): their
"exactly one of" pairs arrive as one tagged Struct it `match`es on.

While the workspace has a checkpoint, the bytes a write replaces are kept first (the
`preimages` hook, `substrate.workspace.checkpoints`), recorded with its journal entry.

A change set's files and directories go through `Writer.batch` (`BatchWriter`: the same
checks, many files per transaction and flush; `batch`, `batch_files`, `batch_dirs`).

A crash leaves the old or the new file, never a mix, plus at worst a temp file that the
next start removes: each temp file is recorded in the database before it is created,
and only recorded ones are ever cleaned. A write that landed but whose journal
transaction the crash lost is journaled at the next start from its intent,
`recovered: true` (`Writer.recover`); one that did not land is not.

Every operation holds the workspace's root fd (`Workspace.use`) while it runs, so a
release waits for it instead of closing the fd under it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from substrate.errors import (
    AlreadyExists,
    ApprovalRequired,
    NotFound,
    PathDenied,
    PlanMismatch,
    Refusal,
    StaleBase,
)
from substrate.fs import fsops, paths
from substrate.schema.fs import (
    BytesContent,
    DeleteParams,
    Edits,
    PatchRequest,
    Plan,
    TextContent,
    UnifiedDiff,
    WriteRequest,
)
from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.group import Ticket
from substrate.store.journal import Journal
from substrate.workspace import discoverable, patching
from substrate.workspace.adopted import Workspace
from substrate.workspace.checkpoints import Checkpoints, Preimage
from substrate.workspace.preview import unified_preview
from substrate.workspace.writes.base import Current, open_parent, read_current, read_current_held
from substrate.workspace.writes.batch import RELEASER
from substrate.workspace.writes.batch_dirs import DirBatches
from substrate.workspace.writes.batch_files import (
    MAX_CHANGE_FILE_BYTES,
    MAX_CHANGESET_BYTES,
    FileBatches,
    FileChange,
)
from substrate.workspace.writes.batch_links import LinkBatches
from substrate.workspace.writes.dir_sync import DirSyncs
from substrate.workspace.writes.intents import Intent, Pending
from substrate.workspace.writes.plan import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    MAX_PATCH_FILE,
    Op,
    journal_data,
    no_setid,
    plan_digest,
)
from substrate.workspace.writes.temp_files import (
    RESERVE,
    TempFiles,
    TopUp,
    check_not_reserved,
)

log = logging.getLogger("substrate.workspace.writes")

__all__ = ["BatchWriter", "Writer"]


@dataclass
class _Staged:
    """One apply in progress: its temp file and intent once made, and whether its
    rename (or unlink) may have happened (then it is never abandoned)."""

    kind: str
    actor: str
    needs_approval: bool
    temp: str | None = None
    pending: Pending | None = None
    #: Temp names recorded with the intent, joining the reserve once it is durable.
    top_up: TopUp | None = None
    landed: bool = False
    #: What the write replaced, kept for a live checkpoint (recorded with its entry).
    preimage: Preimage | None = None

    def intent(self, prep: _Prepared, approval: str | None) -> Intent:
        """The write's journal entry-to-be (`intents`)."""
        data = journal_data(prep.plan, approval)
        return Intent(prep.rel, self.kind, self.actor, data, self.temp)


@dataclass
class _Prepared:
    parts: tuple[str, ...]
    rel: str
    missing_parents: tuple[str, ...]  # components to create before the apply
    current: Current
    new: bytes | None
    plan: Plan


#: What a write makes of the target: these bytes, a function of its current bytes (a
#: patch), or None (a delete).
NewBytes = bytes | Callable[[bytes], bytes] | None


def _plan(
    ws: Workspace,
    path: str,
    base: str | None,
    new_of: NewBytes,
    mode: int | None,
    create_parents: bool,
    given_digest: str | None,
) -> tuple[_Prepared, int | None]:
    parts = paths.split_relpath(path)
    rel = "/".join(parts)
    where = ws.provenance(rel)
    check_not_reserved(parts, where)
    if not ws.policy.may_write(rel):
        raise PathDenied(f"{where}: denied by the workspace write policy")
    parent_fd, missing = open_parent(ws, parts, where, create_parents)
    try:
        if parent_fd is None:
            current = Current(exists=False)
        else:
            current = read_current(parent_fd, parts[-1], where, MAX_PATCH_FILE)
        if (new_of is None or callable(new_of)) and not current.exists:
            raise NotFound(f"{where}: not found")
        made = (*missing, parts[-1]) if not current.exists else missing
        # The parent is held already: looked at through its fd, not opened again.
        held = {parts[:-1]: parent_fd} if parent_fd is not None else None
        discoverable.check_write(discoverable.GitDirs(ws.root_fd, held), parts, where, made)
        if base != current.sha256:
            if base is None:
                raise AlreadyExists(f"{where}: exists; bind the write to its sha256 to replace it")
            raise StaleBase(
                f"{where}: the file is not at the given base", current_sha256=current.sha256
            )
        new: bytes | None
        op: Op
        if new_of is None:
            new, op = None, "delete"
        else:
            new = new_of(current.data) if callable(new_of) else new_of
            op = "replace" if current.exists else "create"
        new_sha = None if new is None else hashlib.sha256(new).hexdigest()
        if op == "delete":
            new_mode = None
        elif mode is not None:
            new_mode = mode
        else:
            new_mode = current.mode if current.exists else DEFAULT_FILE_MODE
        if new_mode is not None:
            # Never make or keep a set-id file: we write as root, the bytes are the agent's
            # (a write by its owner would clear these bits too).
            new_mode = no_setid(new_mode)
        diff, truncated = unified_preview(current.data, new or b"", rel)
        digest = plan_digest(ws.root_id, rel, op, current.sha256, new_sha, new_mode)
        if given_digest is not None and given_digest != digest:
            raise PlanMismatch(f"{where}: plan digest does not match", plan_digest=digest)
        plan = Plan(
            path=where,
            op=op,
            base_sha256=current.sha256,
            new_sha256=new_sha,
            size=0 if new is None else len(new),
            mode=new_mode,
            diff=diff,
            diff_truncated=truncated,
            plan_digest=digest,
            applied=False,
        )
        return _Prepared(parts, rel, missing, current, new, plan), parent_fd
    except BaseException:
        if parent_fd is not None:
            os.close(parent_fd)
        raise


class BatchWriter(FileBatches, DirBatches, LinkBatches):
    """Applies change sets' files (`apply_files`, `batch_files`), directories
    (`apply_dirs`, `batch_dirs`) and symlinks (`apply_links`, `batch_links`) in batches
    over one shared frame (`batch`)."""


class Writer:
    """Plans and applies guarded writes for every workspace."""

    def __init__(
        self,
        store: Store,
        journal: Journal,
        preimages: Checkpoints | None = None,
        *,
        max_change_file_bytes: int = MAX_CHANGE_FILE_BYTES,
        max_changeset_bytes: int = MAX_CHANGESET_BYTES,
    ) -> None:
        """`max_change_file_bytes`: the largest file a change set's batch reads or writes
        (streamed past `streamed.STREAM_BYTES`); `max_changeset_bytes`: what a change set
        scanned for this writer may hash in all (the layer's scan reads both here)."""
        self._store = store
        self._journal = journal
        self._preimages = preimages
        self._temps = TempFiles(store, journal.epoch, reserve=RESERVE)
        #: The journal transactions of plain writes, committed together when concurrent.
        self._group = store.group
        #: Directory fsyncs after the rename, shared by concurrent writes (`dir_sync`).
        self._dir_syncs = DirSyncs()
        self._approvals = Approvals(store)
        #: Change sets' files and directories, in batches.
        self.batch = BatchWriter(store, journal, self._temps, self._approvals, preimages)
        self.batch.max_file_bytes = max_change_file_bytes
        self.max_changeset_bytes = max_changeset_bytes
        #: Every write's journal entry-to-be, durable before its rename (`intents`).
        self._intents = self.batch.intents
        #: Told (workspace id, path, new sha256 or None) of each plain write that landed,
        #: from the thread that made it: the working layers take those files as
        #: substrate's own, not a host edit (`LayerUsers.note_landed`).
        self.on_landed: Callable[[str, str, str | None], None] | None = None

    def recover(self, workspace: Callable[[str], Workspace]) -> int:
        """At start, before anything writes: journal (`recovered: true`) every guarded
        write of an earlier run that landed but whose journal transaction a crash lost,
        and drop the intents of those that did not land (`Intents.resolve`);
        returns how many were journaled. The intents of a workspace `workspace` refuses
        (no longer adopted) stay for a start that knows it. Costs a query, and a read
        per path left unjournaled."""
        recovered = 0
        for ws_id in self._intents.stale_workspaces():
            try:
                ws = workspace(ws_id)
            except Refusal:
                log.warning("write intents of workspace %s: not adopted", ws_id)
                continue
            recovered += self._intents.resolve(ws)
        if recovered:
            log.info("%d write(s) landed before a crash journaled now", recovered)
        return recovered

    # -- the three wire operations --------------------------------------------------------

    def write(self, ws: Workspace, req: WriteRequest, actor: str) -> Plan:
        """`fs.write` (decoded by `schema.fs.write_request`). Refuses path/policy
        problems, `already_exists`, `stale_base`, ..."""
        match req.content:
            case TextContent(text=text):
                data = text.encode("utf-8", "surrogatepass")
            case BytesContent(data=data):
                pass
        with ws.use():
            prepared, parent_fd = _plan(
                ws, req.path, req.base_sha256, data, req.mode, req.create_parents, req.plan_digest
            )
            return self._finish(ws, prepared, parent_fd, req.dry_run, actor, "fs.write")

    def patch(self, ws: Workspace, req: PatchRequest, actor: str) -> Plan:
        """`fs.patch` (decoded by `schema.fs.patch_request`): edits or a strict unified
        diff. Refuses `patch_conflict` and the rest."""
        transform: Callable[[bytes], bytes]
        match req.change:
            case Edits(edits=edits):

                def transform(old: bytes) -> bytes:
                    return patching.apply_edits(old, edits, MAX_PATCH_FILE)

            case UnifiedDiff(text=diff):

                def transform(old: bytes) -> bytes:
                    return patching.apply_unified_diff(old, diff, MAX_PATCH_FILE)

        with ws.use():
            prepared, parent_fd = _plan(
                ws, req.path, req.base_sha256, transform, None, False, req.plan_digest
            )
            return self._finish(ws, prepared, parent_fd, req.dry_run, actor, "fs.patch")

    def delete(self, ws: Workspace, p: DeleteParams, actor: str) -> Plan:
        """`fs.delete`, bound to the base like any write."""
        with ws.use():
            prepared, parent_fd = _plan(ws, p.path, p.base_sha256, None, None, False, p.plan_digest)
            return self._finish(ws, prepared, parent_fd, p.dry_run, actor, "fs.delete")

    # -- a working layer's change set (substrate.layer.changes.apply) --------------------

    def apply_change(
        self,
        ws: Workspace,
        path: str,
        base: str | None,
        data: bytes | None,
        mode: int | None,
        actor: str,
        dry_run: bool = False,
    ) -> str | None:
        """Apply one file of a change set: `data` (None: a delete) bound to `base`, parents
        not made, journaled as `changes.apply` - a batch of one (`batch_files`; a change
        set goes through `batch` whole). Returns the plan digest, None when the checkout
        already held the result. Refuses as `fs.write`/`fs.delete` do (`path_denied`,
        `approval_required` with the plan digest, `stale_base`, `already_exists`, ...) and
        raises the OSError of a failed step; `dry_run` checks and writes nothing."""
        sha = None if data is None else hashlib.sha256(data).hexdigest()
        change = FileChange(path, base, sha, 0 if data is None else len(data), mode)
        [landing] = self.batch.apply_files(ws, [change], lambda _: data, actor, dry_run=dry_run)
        if landing.refusal is not None:
            raise landing.refusal
        if landing.error is not None:
            raise landing.error
        return landing.plan_digest

    def restore_file(
        self,
        ws: Workspace,
        path: str,
        base: str | None,
        data: bytes | None,
        mode: int | None,
        dry_run: bool,
        actor: str,
    ) -> Plan:
        """Put back one file of a checkpoint (`substrate.workspace.checkpoints`): `data`
        (None: a delete) bound to `base`, missing parents made, journaled as
        `workspace.restore_file`. Refuses as `fs.write`/`fs.delete` do."""
        with ws.use():
            prepared, parent_fd = _plan(ws, path, base, data, mode, True, None)
            return self._finish(ws, prepared, parent_fd, dry_run, actor, "workspace.restore_file")

    # -- apply ----------------------------------------------------------------------------

    def _finish(
        self,
        ws: Workspace,
        prep: _Prepared,
        parent_fd: int | None,
        dry_run: bool,
        actor: str,
        kind: str,
    ) -> Plan:
        try:
            needs_approval = ws.policy.needs_approval(prep.rel)
            if needs_approval and not self._approvals.find(
                ws.id, prep.plan.plan_digest, time.time()
            ):
                if dry_run:
                    return prep.plan
                raise ApprovalRequired(
                    f"{prep.plan.path}: needs an operator approval of this plan",
                    plan_digest=prep.plan.plan_digest,
                )
            if dry_run:
                return prep.plan
            if parent_fd is None:
                parent_fd = self._make_parents(ws, prep)
            staged = _Staged(kind, actor, needs_approval)
            try:
                self._stage(ws, parent_fd, prep, staged)
                self._commit(ws, parent_fd, prep, staged)
            except BaseException:
                if not staged.landed:
                    self._abandon(ws, parent_fd, prep, staged)
                raise
            if self.on_landed is not None:
                self.on_landed(ws.id, prep.rel, prep.plan.new_sha256)
            return msgspec.structs.replace(prep.plan, applied=True)
        finally:
            if parent_fd is not None:
                os.close(parent_fd)

    def _make_parents(self, ws: Workspace, prep: _Prepared) -> int:
        """The target's parent, its missing directories made (the workspace owner's, 0755)."""
        dirs = prep.parts[:-1]
        have = len(dirs) - len(prep.missing_parents)
        where = ws.provenance(prep.rel)
        owner = (ws.owner_uid, ws.owner_gid)
        with paths.opened_dir(ws.root_fd, dirs[:have], where) as deepest:
            return fsops.make_dirs(
                deepest, prep.missing_parents, where, lambda _: (DEFAULT_DIR_MODE, owner)
            )

    def _abandon(self, ws: Workspace, parent_fd: int, prep: _Prepared, staged: _Staged) -> None:
        """A write that did not land: its temp file goes, then in one transaction its
        temp record and its intent."""
        if staged.top_up is not None:
            self._temps.topped_up(staged.top_up, committed=False)
        if staged.temp is not None:
            fsops.unlink_quietly(parent_fd, staged.temp)
        if staged.temp is None and staged.pending is None:
            return
        with self._store.transaction() as db:
            if staged.temp is not None:
                self._temps.forget_in(db, ws.id, prep.parts[:-1], staged.temp)
            if staged.pending is not None:
                self._intents.drop_in(db, staged.pending.token)

    def _stage(self, ws: Workspace, parent_fd: int, prep: _Prepared, staged: _Staged) -> None:
        """The new bytes in a recorded temp file beside the target, with the old owner
        and the plan's mode, fsynced; the write's intent queued meanwhile (unless it
        needs an approval: its id is known under the lock)."""
        if prep.new is None:
            if not staged.needs_approval:
                staged.pending = self._intents.submit(ws.id, staged.intent(prep, None))
            return
        assert prep.plan.mode is not None
        staged.temp, fd = self._temps.create(ws.id, parent_fd, prep.parts[:-1], prep.plan.path)
        owner = (
            (prep.current.uid, prep.current.gid)
            if prep.current.exists
            else (ws.owner_uid, ws.owner_gid)
        )
        try:
            if not staged.needs_approval:
                # The directory's next temp names ride on this commit when it runs low.
                top = staged.top_up = self._temps.top_up(ws.id, prep.parts[:-1])
                also = None if top is None else top.record_in
                staged.pending = self._intents.submit(ws.id, staged.intent(prep, None), also)
            fsops.fill(fd, prep.new, mode=prep.plan.mode, owner=owner)
        finally:
            os.close(fd)

    def _commit(self, ws: Workspace, parent_fd: int, prep: _Prepared, staged: _Staged) -> None:
        if staged.pending is not None:
            # Durable before the rename, waited for outside the lock (usually shared with
            # the commit of another write's entry).
            top, staged.top_up = staged.top_up, None
            try:
                staged.pending.wait()
            except BaseException:
                if top is not None:
                    self._temps.topped_up(top, committed=False)
                raise
            if top is not None:
                self._temps.topped_up(top, committed=True)
        held: int | None = None
        try:
            with ws.commit_lock:
                # Read through an fd kept open across the rename (or unlink) and closed
                # in the background after the directory fsync (`RELEASER`): the last close
                # of the replaced file frees its inode and blocks, which the rename would
                # otherwise do, and the directory fsync commit.
                now, held = read_current_held(
                    parent_fd, prep.parts[-1], prep.plan.path, MAX_PATCH_FILE
                )
                place = self._land(ws, parent_fd, prep, staged, now)
            if place is not None:
                journal, ticket = place
                try:
                    self._dir_syncs.sync(parent_fd)
                except BaseException as exc:
                    self._group.drop(ticket, OSError(f"the directory fsync failed: {exc}"))
                    raise
                if held is not None:
                    # Freed while the entry commits (its fdatasync waits on the disk).
                    RELEASER.release(held)
                    held = None
                self._group.fill(ticket, journal)
                self._group.wait(ticket)
        finally:
            if held is not None:
                RELEASER.release(held)
        if staged.preimage is not None and self._preimages is not None:
            self._preimages.settle()

    def _land(
        self, ws: Workspace, parent_fd: int, prep: _Prepared, staged: _Staged, now: Current
    ) -> tuple[Callable[[sqlite3.Connection], None], Ticket[None]] | None:
        """Under the commit lock: the base checked once more, the approval found, the
        pre-image kept, the rename (or unlink); then either the entry committed at once
        (an approval consumed or a pre-image kept: under the lock) or, returned, the
        journal unit and the place it takes in the group commit's order (given after
        the directory fsync, outside the lock)."""
        name = prep.parts[-1]
        where = prep.plan.path
        temp = staged.temp
        if now.sha256 != prep.current.sha256:
            raise StaleBase(
                f"{where}: changed while the write was prepared", current_sha256=now.sha256
            )
        approval = None
        if staged.needs_approval:
            approval = self._approvals.find(ws.id, prep.plan.plan_digest, time.time())
            if approval is None:
                raise ApprovalRequired(
                    f"{where}: needs an operator approval of this plan",
                    plan_digest=prep.plan.plan_digest,
                )
            staged.pending = self._intents.record(ws.id, staged.intent(prep, approval))
        intent = staged.intent(prep, approval)
        token = staged.pending.token if staged.pending is not None else None
        pre = staged.preimage = self._keep_preimage(ws, prep.rel, now)
        if temp is None:
            os.unlink(name, dir_fd=parent_fd)
        else:
            fsops.rename_into(parent_fd, temp, name, fsync=False)
        # Landed: from here on its intent is the next start's to settle, never dropped.
        staged.landed = True

        def journal(db: sqlite3.Connection) -> None:
            # Run only once the rename is durable (the directory fsync), so no entry
            # is ever durable before its change.
            if temp is not None:
                self._temps.forget_in(db, ws.id, prep.parts[:-1], temp)
            if approval is not None:
                self._approvals.consume_in(db, approval, time.time())
            if token is not None:
                self._intents.drop_in(db, token)
            entry = self._journal.append_in(
                db, intent.kind, intent.data, workspace=ws.id, actor=intent.actor
            )
            if pre is not None and self._preimages is not None:
                self._preimages.record_in(db, pre, entry.seq, prep.plan.new_sha256)

        if approval is not None or pre is not None:
            # Consumed or kept under the lock: no later write may see it unsettled.
            self._dir_syncs.sync(parent_fd)
            with self._store.transaction() as db:
                journal(db)
            return None
        # Its place in the journal's order is taken in lock order; the entry is given
        # once the directory fsync after the lock is done (shared with concurrent
        # writes there), and commits with concurrent writes' entries and intents.
        return journal, self._group.reserve()

    def _keep_preimage(self, ws: Workspace, rel: str, now: Current) -> Preimage | None:
        """Hand what the write replaces to the checkpoints' keeper (under the commit lock,
        before the rename); the pre-image to record with the journal entry, or None."""
        if self._preimages is None:
            return None
        pre = Preimage(ws.id, rel, now.sha256, now.data, now.mode if now.exists else None)
        return pre if self._preimages.keep(pre) else None
