"""Guarded writes of uploaded files: `fs.upload.commit`, streamed (docs/protocol.md §14, §4).

Theory of operation. The steps and refusals are `writer`'s, in the same order, with the
file's bytes in the upload's spool instead of in memory: validate the path, check the
policy, open the parent through held directory fds (`base.open_parent`), bind the
current file's SHA-256 (hashed as a stream, cached by version in `Digests`) to the
upload's `base_sha256`, compute the plan and its digest (`plan.plan_digest`: the digest
an `fs.write` of the same bytes would have), check a given `plan_digest` and the
operator approval. A dry run returns that plan. To apply, the spool is copied a block at
a time into a recorded temp file in the target's directory (`temp_files`), hashed again
on the way (the bytes written are the bytes declared, or `upload_mismatch`), given the
old owner and the plan's mode and fsynced, while its intent (the journal entry it will
get, `intents`) commits; under the workspace's commit lock the base is checked once
more, the pre-image kept for a live checkpoint, the temp file renamed over the target,
the directory fsynced, and the journal entry `fs.upload` (digests, size and mode; never
bytes) written in the transaction that consumes the approval and drops the intent.

Memory stays at one block (`fsops.CHUNK`) whatever the file's size, except: the plan's
diff preview reads both sides only when both are at most `PREVIEW_DIFF_LIMIT` (2 MiB),
and a live checkpoint keeps what the write replaces, which is read whole and so bounded
by `plan.MAX_PATCH_FILE` (64 MiB; a larger file under a live checkpoint is `too_large`,
as a restore could not put it back).

A crash leaves the old file or the new one, never a mix, plus at worst a recorded temp
file the next start removes; an upload that landed before its journal commit is
journaled at that start, `recovered: true` (`Writer.recover`). Blocking I/O
throughout: call from worker threads.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from dataclasses import dataclass

import msgspec

from substrate.errors import (
    AlreadyExists,
    ApprovalRequired,
    NotAFile,
    NotFound,
    PathDenied,
    PlanMismatch,
    StaleBase,
    TooLarge,
    UploadMismatch,
)
from substrate.fs import fsops, paths
from substrate.schema.fs import Plan
from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace import discoverable
from substrate.workspace.adopted import Workspace
from substrate.workspace.checkpoints import Checkpoints, Preimage
from substrate.workspace.digests import Digests
from substrate.workspace.preview import PREVIEW_DIFF_LIMIT, unified_preview
from substrate.workspace.uploads import Upload
from substrate.workspace.writes.base import open_parent
from substrate.workspace.writes.intents import Intent, Intents, Pending
from substrate.workspace.writes.plan import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    MAX_PATCH_FILE,
    Op,
    journal_data,
    no_setid,
    plan_digest,
)
from substrate.workspace.writes.temp_files import TempFiles, check_not_reserved

#: The journal kind of an applied upload.
KIND = "fs.upload"


@dataclass(frozen=True)
class _Current:
    """The target now: absent, or a regular file's digest and metadata (and its bytes
    when small enough to preview)."""

    exists: bool
    sha256: str | None = None
    size: int = 0
    mode: int = DEFAULT_FILE_MODE
    uid: int = -1
    gid: int = -1
    data: bytes | None = None


@dataclass(frozen=True)
class _Target:
    parts: tuple[str, ...]
    rel: str
    where: str


@dataclass
class _Staged:
    """One upload's apply in progress: its temp file and intent once made, and whether
    its rename may have happened (then it is never abandoned)."""

    target: _Target
    plan: Plan
    up: Upload
    actor: str
    needs_approval: bool
    temp: str | None = None
    pending: Pending | None = None
    landed: bool = False

    def intent(self, approval: str | None) -> Intent:
        """The upload's journal entry-to-be (`intents`)."""
        data = {**journal_data(self.plan, approval), "upload": self.up.id}
        return Intent(self.target.rel, KIND, self.actor, data, self.temp)


def _target(ws: Workspace, path: str) -> _Target:
    """Validate the path and the write policy (`path_invalid`, `path_denied`)."""
    parts = paths.split_relpath(path)
    rel = "/".join(parts)
    where = ws.provenance(rel)
    check_not_reserved(parts, where)
    if not ws.policy.may_write(rel):
        raise PathDenied(f"{where}: denied by the workspace write policy")
    return _Target(parts, rel, where)


def _current(
    parent_fd: int | None, name: str, where: str, digests: Digests, keep_up_to: int
) -> _Current:
    """What stands at `name` now, hashed as a stream. Refuses `symlink_refused` and
    `not_a_file`. Costs a pass over the file unless `digests` knows its version."""
    if parent_fd is None:
        return _Current(exists=False)
    st = paths.lstat_at(parent_fd, name)
    if st is None:
        return _Current(exists=False)
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISLNK(st.st_mode):
            raise paths.refusal_for(OSError(errno.ELOOP, "symlink"), where)
        raise NotAFile(f"{where}: is a {paths.kind_of(st.st_mode)}, not a regular file")
    try:
        fd = paths.open_regular(parent_fd, name, where)
    except NotFound:
        return _Current(exists=False)  # removed since the lstat
    try:
        fst, sha = digests.of(fd, None)
        data = fsops.read_fd(fd, keep_up_to, expected=fst.st_size) if keep_up_to else None
    finally:
        os.close(fd)
    return _Current(
        exists=True,
        sha256=sha,
        size=fst.st_size,
        mode=stat.S_IMODE(fst.st_mode),
        uid=fst.st_uid,
        gid=fst.st_gid,
        data=data,
    )


def _check_discoverable(
    ws: Workspace, target: _Target, missing: tuple[str, ...], current: _Current
) -> None:
    """`discoverable.check_write` of the target: no git directory by content completed
    or written beneath, no misleading new name (`path_denied`, `path_invalid`)."""
    made = (*missing, target.parts[-1]) if not current.exists else missing
    discoverable.check_write(discoverable.GitDirs(ws.root_fd), target.parts, target.where, made)


def _check_base(base: str | None, current: _Current, where: str) -> None:
    if base != current.sha256:
        if base is None:
            raise AlreadyExists(f"{where}: exists; bind the upload to its sha256 to replace it")
        raise StaleBase(
            f"{where}: the file is not at the given base", current_sha256=current.sha256
        )


def _preview(current: _Current, up: Upload, spool_fd: int, rel: str) -> tuple[str, bool]:
    """`unified_preview` when both sides are small enough to diff, else its summary."""
    if current.sha256 == up.sha256:
        return "", False
    if current.size > PREVIEW_DIFF_LIMIT or up.size > PREVIEW_DIFF_LIMIT:
        return f"Files differ ({current.size} -> {up.size} bytes; too large to diff)\n", True
    new = os.pread(spool_fd, up.size, 0) if up.size else b""
    return unified_preview(current.data or b"", new, rel)


class UploadWriter:
    """Checks upload targets at begin and applies uploads at commit, for every workspace."""

    def __init__(
        self,
        store: Store,
        journal: Journal,
        digests: Digests,
        preimages: Checkpoints | None = None,
    ) -> None:
        self._store = store
        self._journal = journal
        self._digests = digests
        self._preimages = preimages
        self._temps = TempFiles(store, journal.epoch)
        self._approvals = Approvals(store)
        #: Its journal entry-to-be, durable before the rename (`intents`).
        self._intents = Intents(store, journal)

    def check(self, ws: Workspace, path: str, base: str | None, create_parents: bool) -> None:
        """`fs.upload.begin`'s early check of the target, so that no bytes are sent for a
        write that would be refused now: path, policy, parents (`not_found` without
        `create_parents`), base (`stale_base`, `already_exists`), and a replaced file
        too large to keep for a live checkpoint (`too_large`). Costs a hash of the current
        file unless its digest is cached."""
        with ws.use():
            target = _target(ws, path)
            parent_fd, missing = open_parent(ws, target.parts, target.where, create_parents)
            try:
                current = _current(parent_fd, target.parts[-1], target.where, self._digests, 0)
            finally:
                if parent_fd is not None:
                    os.close(parent_fd)
            _check_discoverable(ws, target, missing, current)
            _check_base(base, current, target.where)
            self._check_keepable(ws, current, target.where)

    def commit(
        self,
        ws: Workspace,
        up: Upload,
        spool_fd: int,
        dry_run: bool,
        given_digest: str | None,
        actor: str,
    ) -> Plan:
        """Plan, and unless `dry_run` apply, the upload `up` (complete and checked, its
        bytes readable from `spool_fd`). Refuses as `fs.write` does (path, policy,
        `stale_base`, `already_exists`, `plan_mismatch`, `approval_required`, ...) and
        `upload_mismatch` when the spool no longer holds the declared bytes. Costs a hash
        of the current file (unless cached) and, to apply, a copy of the upload with its
        hash, two fsyncs and one transaction."""
        with ws.use():
            target = _target(ws, up.path)
            parent_fd, missing = open_parent(ws, target.parts, target.where, up.create_parents)
            try:
                return self._plan_and_apply(
                    ws, up, spool_fd, target, parent_fd, missing, dry_run, given_digest, actor
                )
            finally:
                if parent_fd is not None:
                    os.close(parent_fd)

    # -- inside -------------------------------------------------------------------------

    def _check_keepable(self, ws: Workspace, current: _Current, where: str) -> None:
        if (
            current.exists
            and current.size > MAX_PATCH_FILE
            and self._preimages is not None
            and self._preimages.has_live(ws.id)
        ):
            raise TooLarge(
                f"{where}: a live checkpoint keeps what a write replaces, up to"
                f" {MAX_PATCH_FILE} bytes; this file has {current.size}",
                limit=MAX_PATCH_FILE,
            )

    def _plan_and_apply(
        self,
        ws: Workspace,
        up: Upload,
        spool_fd: int,
        target: _Target,
        parent_fd: int | None,
        missing: tuple[str, ...],
        dry_run: bool,
        given_digest: str | None,
        actor: str,
    ) -> Plan:
        name, where = target.parts[-1], target.where
        current = _current(parent_fd, name, where, self._digests, PREVIEW_DIFF_LIMIT)
        _check_discoverable(ws, target, missing, current)
        _check_base(up.base_sha256, current, where)
        self._check_keepable(ws, current, where)
        op: Op = "replace" if current.exists else "create"
        if up.mode is not None:
            mode = up.mode
        else:
            mode = current.mode if current.exists else DEFAULT_FILE_MODE
        mode = no_setid(mode)  # never make a set-id file
        digest = plan_digest(ws.root_id, target.rel, op, current.sha256, up.sha256, mode)
        if given_digest is not None and given_digest != digest:
            raise PlanMismatch(f"{where}: plan digest does not match", plan_digest=digest)
        diff, truncated = _preview(current, up, spool_fd, target.rel)
        plan = Plan(
            path=where,
            op=op,
            base_sha256=current.sha256,
            new_sha256=up.sha256,
            size=up.size,
            mode=mode,
            diff=diff,
            diff_truncated=truncated,
            plan_digest=digest,
            applied=False,
        )
        needs_approval = ws.policy.needs_approval(target.rel)
        if needs_approval and not self._approvals.find(ws.id, digest, time.time()):
            if dry_run:
                return plan
            raise ApprovalRequired(
                f"{where}: needs an operator approval of this plan", plan_digest=digest
            )
        if dry_run:
            return plan
        owned_fd = None
        if parent_fd is None:
            parent_fd = owned_fd = self._make_parents(ws, target, missing)
        try:
            owner = (current.uid, current.gid) if current.exists else (ws.owner_uid, ws.owner_gid)
            staged = _Staged(target, plan, up, actor, needs_approval)
            try:
                self._copy_to_temp(ws, parent_fd, staged, spool_fd, mode, owner)
                self._commit(ws, parent_fd, staged, current)
            except BaseException:
                if not staged.landed:
                    self._abandon(ws, parent_fd, staged)
                raise
        finally:
            if owned_fd is not None:
                os.close(owned_fd)
        return msgspec.structs.replace(plan, applied=True)

    def _make_parents(self, ws: Workspace, target: _Target, missing: tuple[str, ...]) -> int:
        dirs = target.parts[:-1]
        owner = (ws.owner_uid, ws.owner_gid)
        with paths.opened_dir(ws.root_fd, dirs[: len(dirs) - len(missing)], target.where) as fd:
            return fsops.make_dirs(fd, missing, target.where, lambda _: (DEFAULT_DIR_MODE, owner))

    def _abandon(self, ws: Workspace, parent_fd: int, staged: _Staged) -> None:
        """An upload that did not land: its temp file goes, then in one transaction its
        temp record and its intent."""
        if staged.temp is None:
            return
        fsops.unlink_quietly(parent_fd, staged.temp)
        with self._store.transaction() as db:
            self._temps.forget_in(db, ws.id, staged.target.parts[:-1], staged.temp)
            if staged.pending is not None:
                self._intents.drop_in(db, staged.pending.token)

    def _copy_to_temp(
        self,
        ws: Workspace,
        parent_fd: int,
        staged: _Staged,
        spool_fd: int,
        mode: int,
        owner: fsops.Owner,
    ) -> None:
        """The spool's bytes in a recorded temp file beside the target, hashed on the way,
        with `owner` and `mode`, fsynced; the upload's intent queued meanwhile (unless
        it needs an approval: its id is known under the lock). Refuses
        `upload_mismatch` when they are not the declared bytes."""
        target, up = staged.target, staged.up
        staged.temp, fd = self._temps.create(ws.id, parent_fd, target.parts[:-1], target.where)
        try:
            if not staged.needs_approval:
                staged.pending = self._intents.submit(ws.id, staged.intent(None))
            digest = hashlib.sha256()
            offset = 0
            while offset < up.size:
                block = os.pread(spool_fd, min(fsops.CHUNK, up.size - offset), offset)
                if not block:
                    break
                digest.update(block)
                fsops.write_all(fd, block)
                offset += len(block)
            if offset != up.size or digest.hexdigest() != up.sha256:
                raise UploadMismatch(
                    f"{up.id}: the spooled bytes changed before the commit",
                    sha256=up.sha256,
                    received_sha256=digest.hexdigest(),
                )
            fsops.fill(fd, b"", mode=mode, owner=owner)
        finally:
            os.close(fd)

    def _commit(self, ws: Workspace, parent_fd: int, staged: _Staged, planned: _Current) -> None:
        target, plan, temp = staged.target, staged.plan, staged.temp
        assert temp is not None
        name, where = target.parts[-1], target.where
        if staged.pending is not None:
            staged.pending.wait()  # durable before the rename; waited for outside the lock
        with ws.commit_lock:
            now = _current(parent_fd, name, where, self._digests, 0)
            if now.sha256 != planned.sha256:
                raise StaleBase(
                    f"{where}: changed while the upload was written", current_sha256=now.sha256
                )
            approval = None
            if staged.needs_approval:
                approval = self._approvals.find(ws.id, plan.plan_digest, time.time())
                if approval is None:
                    raise ApprovalRequired(
                        f"{where}: needs an operator approval of this plan",
                        plan_digest=plan.plan_digest,
                    )
                staged.pending = self._intents.record(ws.id, staged.intent(approval))
            assert staged.pending is not None
            intent = staged.intent(approval)
            pre = self._keep_preimage(ws, parent_fd, target, now)
            fsops.rename_into(parent_fd, temp, name, fsync=False)
            # Landed: from here on its intent is the next start's to settle, never dropped.
            staged.landed = True
            os.fsync(parent_fd)
            with self._store.transaction() as db:
                self._temps.forget_in(db, ws.id, target.parts[:-1], temp)
                if approval is not None:
                    self._approvals.consume_in(db, approval, time.time())
                self._intents.drop_in(db, staged.pending.token)
                entry = self._journal.append_in(
                    db, intent.kind, intent.data, workspace=ws.id, actor=intent.actor
                )
                if pre is not None and self._preimages is not None:
                    self._preimages.record_in(db, pre, entry.seq, plan.new_sha256)
        if pre is not None and self._preimages is not None:
            self._preimages.settle()

    def _keep_preimage(
        self, ws: Workspace, parent_fd: int, target: _Target, now: _Current
    ) -> Preimage | None:
        """Hand what the upload replaces to a live checkpoint (under the commit lock,
        before the rename), as `Writer` does; the pre-image to record, or None."""
        if self._preimages is None or not self._preimages.has_live(ws.id):
            return None
        self._check_keepable(ws, now, target.where)
        data = b""
        if now.exists:
            _st, data = fsops.read_regular(
                parent_fd, target.parts[-1], MAX_PATCH_FILE, target.where
            )
            if hashlib.sha256(data).hexdigest() != now.sha256:
                raise StaleBase(
                    f"{target.where}: changed while the upload was written",
                    current_sha256=hashlib.sha256(data).hexdigest(),
                )
        pre = Preimage(ws.id, target.rel, now.sha256, data, now.mode if now.exists else None)
        return pre if self._preimages.keep(pre) else None
