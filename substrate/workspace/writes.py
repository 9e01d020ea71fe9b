"""Guarded writes: the only way substrate changes a file (docs/protocol.md §4).

Theory of operation. A write is first *planned*, touching nothing: validate the path,
check the policy, read the current bytes through the held parent directory fd, check
them against `base_sha256`, compute the new bytes, their digest and the plan digest,
check a given `plan_digest` and the operator approval. A dry run returns that plan. To
*apply*, the new bytes go to a temp file created in the same directory (`O_CREAT |
O_EXCL | O_NOFOLLOW` through the dir fd), which is fsynced with the old mode and owner;
then, under the workspace's commit lock, the base is checked once more, the temp file is
renamed over the target through the same dir fd, the directory is fsynced, and the
approval (if any) is consumed in the same database transaction as the journal entry.
The file-system steps are `substrate.workspace.fsops`'s. The writer takes `fs.write` and
`fs.patch` decoded at the edge (`schema.fs.write_request`/`patch_request`): their
"exactly one of" pairs arrive as one tagged Struct it `match`es on.

While the workspace has a checkpoint, the bytes a write replaces are kept first (the
`preimages` hook, `substrate.workspace.checkpoints`), recorded with its journal entry.

A crash leaves the old or the new file, never a mix, plus at worst a temp file that the
next start removes: each temp file is recorded in the database before it is created
(`substrate.workspace.temp_files`), and only recorded ones are ever cleaned. Names with
the temp prefix are refused as targets, so no agent can make a file that looks like ours.

Every operation holds the workspace's root fd (`Workspace.use`) while it runs, so a
release waits for it instead of closing the fd under it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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
)
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
from substrate.store.journal import Journal, canonical
from substrate.workspace import fsops, patching, paths
from substrate.workspace.checkpoints import Checkpoints, Preimage
from substrate.workspace.digests import hash_fd
from substrate.workspace.preview import unified_preview
from substrate.workspace.registry import Workspace
from substrate.workspace.temp_files import TEMP_PREFIX, TempFiles

#: Files bigger than this are not loaded for patching, nor made by a patch.
MAX_PATCH_FILE = patching.MAX_RESULT_BYTES
#: Mode of a created file when the caller gives none.
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755

Op = Literal["create", "replace", "delete"]
DirOp = Literal["mkdir", "rmdir", "chmod"]


def plan_digest(
    root_id: str, path: str, op: Op, base: str | None, new: str | None, mode: int | None
) -> str:
    """SHA-256 of the canonical JSON array `[root_id, path, op, base, new, mode]`."""
    return hashlib.sha256(canonical([root_id, path, op, base, new, mode])).hexdigest()


@dataclass
class _Current:
    """What the target is now: absent, or a regular file's bytes, digest and metadata."""

    exists: bool
    data: bytes = b""
    sha256: str | None = None
    mode: int = DEFAULT_FILE_MODE
    uid: int = -1
    gid: int = -1


@dataclass
class _Prepared:
    parts: tuple[str, ...]
    rel: str
    missing_parents: tuple[str, ...]  # components to create before the apply
    current: _Current
    new: bytes | None
    plan: Plan


def _read_current(parent_fd: int, name: str, where: str, limit: int) -> _Current:
    st = paths.lstat_at(parent_fd, name)
    if st is None:
        return _Current(exists=False)
    if not stat.S_ISREG(st.st_mode):
        kind = paths.kind_of(st.st_mode)
        if kind == "symlink":
            raise paths.refusal_for(OSError(errno.ELOOP, "symlink"), where)
        raise NotAFile(f"{where}: is a {kind}, not a regular file")
    if st.st_size > limit:
        raise TooLarge(f"{where}: {st.st_size} bytes is over the {limit} byte bound", limit=limit)
    try:
        fst, data = fsops.read_regular(parent_fd, name, limit, where)
    except NotFound:
        return _Current(exists=False)  # removed since the lstat: it is absent now
    return _Current(
        exists=True,
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        mode=stat.S_IMODE(fst.st_mode),
        uid=fst.st_uid,
        gid=fst.st_gid,
    )


def _check_not_reserved(parts: tuple[str, ...], where: str) -> None:
    """Refuse a name substrate uses for its temp files: it must never write or delete one."""
    if any(part.startswith(TEMP_PREFIX) for part in parts):
        raise PathDenied(
            f"{where}: names starting with {TEMP_PREFIX!r} are reserved for substrate's temp files",
            reserved_prefix=TEMP_PREFIX,
        )


def _open_parent(
    ws: Workspace, parts: tuple[str, ...], where: str, create_parents: bool
) -> tuple[int | None, tuple[str, ...]]:
    """Open the deepest existing ancestor. Returns (fd of the parent or None, missing dirs)."""
    dirs = parts[:-1]
    try:
        return paths.open_dir(ws.root_fd, dirs, where), ()
    except NotFound:
        if not create_parents:
            raise
    # Find how much exists, refusing symlinks on the way like any open.
    for cut in range(len(dirs) - 1, -1, -1):
        try:
            fd = paths.open_dir(ws.root_fd, dirs[:cut], where)
        except NotFound:
            continue
        os.close(fd)
        return None, dirs[cut:]
    return None, dirs


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
    _check_not_reserved(parts, where)
    if not ws.policy.may_write(rel):
        raise PathDenied(f"{where}: denied by the workspace write policy")
    parent_fd, missing = _open_parent(ws, parts, where, create_parents)
    try:
        if parent_fd is None:
            current = _Current(exists=False)
        else:
            current = _read_current(parent_fd, parts[-1], where, MAX_PATCH_FILE)
        if (new_of is None or callable(new_of)) and not current.exists:
            raise NotFound(f"{where}: not found")
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
            new_mode &= ~(stat.S_ISUID | stat.S_ISGID)
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


class Writer:
    """Plans and applies guarded writes for every workspace."""

    def __init__(
        self, store: Store, journal: Journal, preimages: Checkpoints | None = None
    ) -> None:
        self._store = store
        self._journal = journal
        self._preimages = preimages
        self._temps = TempFiles(store, journal.epoch)
        self._approvals = Approvals(store)

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

    # -- a working layer's change set (substrate.workspace.layer.apply) --------------------

    def apply_change(
        self,
        ws: Workspace,
        path: str,
        base: str | None,
        data: bytes | None,
        mode: int | None,
        actor: str,
        dry_run: bool = False,
    ) -> Plan:
        """Apply one file of a change set: `data` (None: a delete) bound to `base`, as
        `fs.write`/`fs.delete` would, parents not made (the set makes them first).
        Journaled as `changes.apply`. Refuses as they do (`path_denied`,
        `approval_required` with the plan digest, `stale_base`, `already_exists`, ...);
        `dry_run` checks all that and writes nothing (an approval it needs is not asked)."""
        with ws.use():
            prepared, parent_fd = _plan(ws, path, base, data, mode, False, None)
            return self._finish(ws, prepared, parent_fd, dry_run, actor, "changes.apply")

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

    def apply_dir(self, ws: Workspace, path: str, op: DirOp, mode: int | None, actor: str) -> str:
        """Make (`mkdir`, the workspace owner's), remove (`rmdir`, empty only) or chmod a
        directory of a change set, journaled as `changes.apply_dir`; returns its plan digest.

        Refuses like a guarded write: `path_invalid`, `path_denied` (policy or reserved
        name), `approval_required` (with the plan digest: an approval of it lets it
        through once), `symlink_refused`/`not_found`/`not_a_directory` on the way, and
        OSError (EEXIST, ENOTEMPTY, ENOENT) from the step itself. Set-id bits are dropped.
        """
        parts = paths.split_relpath(path)
        rel = "/".join(parts)
        where = ws.provenance(rel)
        _check_not_reserved(parts, where)
        if not ws.policy.may_write(rel):
            raise PathDenied(f"{where}: denied by the workspace write policy")
        if mode is not None:
            mode &= ~(stat.S_ISUID | stat.S_ISGID)
        digest = hashlib.sha256(canonical([ws.root_id, rel, op, None, None, mode])).hexdigest()
        needs_approval = ws.policy.needs_approval(rel)
        with (
            ws.use(),
            paths.opened_dir(ws.root_fd, parts[:-1], where) as parent_fd,
            ws.commit_lock,
        ):
            approval = None
            if needs_approval:
                approval = self._approvals.find(ws.id, digest, time.time())
                if approval is None:
                    raise ApprovalRequired(
                        f"{where}: needs an operator approval of this plan",
                        plan_digest=digest,
                    )
            if op == "mkdir":
                owner = (ws.owner_uid, ws.owner_gid)
                fsops.make_dir(
                    parent_fd,
                    parts[-1],
                    mode=DEFAULT_DIR_MODE if mode is None else mode,
                    owner=owner,
                )
            elif op == "rmdir":
                os.rmdir(parts[-1], dir_fd=parent_fd)
            else:
                assert mode is not None
                with paths.opened_dir(parent_fd, parts[-1:], where) as fd:
                    os.fchmod(fd, mode)
            os.fsync(parent_fd)
            with self._store.transaction() as db:
                if approval is not None:
                    self._approvals.consume_in(db, approval, time.time())
                self._journal.append_in(
                    db,
                    "changes.apply_dir",
                    {
                        "path": where,
                        "op": op,
                        "mode": mode,
                        "plan_digest": digest,
                        "approval_id": approval,
                    },
                    workspace=ws.id,
                    actor=actor,
                )
        return digest

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
            temp = None
            if prep.new is not None:
                temp = self._write_temp(ws, parent_fd, prep)
            try:
                self._commit(ws, parent_fd, prep, temp, needs_approval, actor, kind)
            except BaseException:
                if temp is not None:
                    self._discard_temp(ws, parent_fd, prep, temp)
                raise
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

    def _discard_temp(self, ws: Workspace, parent_fd: int, prep: _Prepared, temp: str) -> None:
        self._temps.discard(ws.id, parent_fd, prep.parts[:-1], temp)

    def _write_temp(self, ws: Workspace, parent_fd: int, prep: _Prepared) -> str:
        """The new bytes in a recorded temp file beside the target, with the old owner and
        the plan's mode, fsynced."""
        assert prep.new is not None and prep.plan.mode is not None
        name, fd = self._temps.create(ws.id, parent_fd, prep.parts[:-1], prep.plan.path)
        owner = (
            (prep.current.uid, prep.current.gid)
            if prep.current.exists
            else (ws.owner_uid, ws.owner_gid)
        )
        try:
            fsops.fill(fd, prep.new, mode=prep.plan.mode, owner=owner)
        except BaseException:
            os.close(fd)
            self._discard_temp(ws, parent_fd, prep, name)
            raise
        os.close(fd)
        return name

    def _commit(
        self,
        ws: Workspace,
        parent_fd: int,
        prep: _Prepared,
        temp: str | None,
        needs_approval: bool,
        actor: str,
        kind: str,
    ) -> None:
        name = prep.parts[-1]
        where = prep.plan.path
        with ws.commit_lock:
            now = _read_current(parent_fd, name, where, MAX_PATCH_FILE)
            if now.sha256 != prep.current.sha256:
                raise StaleBase(
                    f"{where}: changed while the write was prepared", current_sha256=now.sha256
                )
            approval = None
            if needs_approval:
                approval = self._approvals.find(ws.id, prep.plan.plan_digest, time.time())
                if approval is None:
                    raise ApprovalRequired(
                        f"{where}: needs an operator approval of this plan",
                        plan_digest=prep.plan.plan_digest,
                    )
            pre = self._keep_preimage(ws, prep.rel, now)
            if temp is None:
                os.unlink(name, dir_fd=parent_fd)
                os.fsync(parent_fd)
            else:
                fsops.rename_into(parent_fd, temp, name)
            with self._store.transaction() as db:
                if temp is not None:
                    self._temps.forget_in(db, ws.id, prep.parts[:-1], temp)
                if approval is not None:
                    self._approvals.consume_in(db, approval, time.time())
                plan = prep.plan
                entry = self._journal.append_in(
                    db,
                    kind,
                    {
                        "path": plan.path,
                        "op": plan.op,
                        "base_sha256": plan.base_sha256,
                        "new_sha256": plan.new_sha256,
                        "size": plan.size,
                        "mode": plan.mode,
                        "plan_digest": plan.plan_digest,
                        "approval_id": approval,
                    },
                    workspace=ws.id,
                    actor=actor,
                )
                if pre is not None and self._preimages is not None:
                    self._preimages.record_in(db, pre, entry.seq, plan.new_sha256)
        if pre is not None and self._preimages is not None:
            self._preimages.settle()

    def _keep_preimage(self, ws: Workspace, rel: str, now: _Current) -> Preimage | None:
        """Hand what the write replaces to the checkpoints' keeper (under the commit lock,
        before the rename); the pre-image to record with the journal entry, or None."""
        if self._preimages is None:
            return None
        pre = Preimage(ws.id, rel, now.sha256, now.data, now.mode if now.exists else None)
        return pre if self._preimages.keep(pre) else None


WRITE_KINDS = (
    "fs.write",
    "fs.patch",
    "fs.delete",
    "fs.upload",
    "changes.apply",
    "workspace.restore_file",
)


def drift_report(
    ws: Workspace, journal: Journal
) -> list[tuple[str, int, str | None, str | None, str]]:
    """For every file substrate wrote in `ws`: (path, last seq, last digest, current, status).

    Status is `match`, `drift` (other bytes now, or present after our delete), `missing`
    (we wrote it, it is gone) or `unreadable` (a symlink or non-file stands there now).
    Costs one pass over the journal of this workspace and one hash per file.
    """
    last: dict[str, tuple[int, str | None]] = {}
    since = 0
    while True:
        batch = journal.read(since=since, limit=5000, workspace=ws.id, kinds=WRITE_KINDS)
        if not batch:
            break
        for entry in batch:
            last[str(entry.data["path"])] = (entry.seq, entry.data.get("new_sha256"))
        since = batch[-1].seq
    prefix = ws.root_id + ":"
    report: list[tuple[str, int, str | None, str | None, str]] = []
    with ws.use():
        for path in sorted(last):
            seq, digest = last[path]
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            try:
                parts = paths.split_relpath(rel)
                with paths.opened_dir(ws.root_fd, parts[:-1], path) as parent:
                    fd = paths.open_regular(parent, parts[-1], path)
                try:  # hashed as a stream: an uploaded file may be large
                    current = hash_fd(fd)
                finally:
                    os.close(fd)
            except NotFound:
                current = None
            except Exception:
                report.append((path, seq, digest, None, "unreadable"))
                continue
            if current == digest:
                status = "match"
            elif current is None:
                status = "missing"
            else:
                status = "drift"
            report.append((path, seq, digest, current, status))
    return report
