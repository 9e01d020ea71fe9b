"""A change set's files in batches, each bound to its base (`changes.apply`).

A change set's files in batches: step by step as the theory of operation in `batch`
says, each file bound to its base, re-checked under the commit lock right before its
rename, journaled `changes.apply`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from substrate.errors import (
    AlreadyExists,
    ApprovalRequired,
    NotFound,
    PathDenied,
    Refusal,
    StaleBase,
    TooLarge,
)
from substrate.fs import fsops, paths
from substrate.fs.fsops import make_durable, rename_new
from substrate.workspace import discoverable
from substrate.workspace.adopted import Workspace
from substrate.workspace.checkpoints import Checkpoints, Preimage
from substrate.workspace.writes import batch
from substrate.workspace.writes.base import Current, read_current, read_current_held
from substrate.workspace.writes.batch import (
    RELEASER,
    SOURCE_CHANGED,
    SYNCFS_FROM,
    UNCHANGED,
    BatchCore,
    HeldDirs,
    Landing,
    Step,
    Temp,
)
from substrate.workspace.writes.intents import FILE_KIND, Intent
from substrate.workspace.writes.plan import (
    DEFAULT_FILE_MODE,
    MAX_PATCH_FILE,
    Op,
    no_setid,
    plan_digest,
)
from substrate.workspace.writes.streamed import (
    STREAM_BYTES,
    Streamed,
    copy_hashed,
    hash_fd_bounded,
)
from substrate.workspace.writes.temp_files import check_not_reserved, new_name

#: The largest file a change set's file batch reads or writes by default (the
#: `max_change_file_bytes` config key sets it: `Writer`).
MAX_CHANGE_FILE_BYTES = 8 << 30
#: The bytes a change set's scan hashes in all by default, both layers counted (the
#: `max_changeset_bytes` config key sets it: `Writer`).
MAX_CHANGESET_BYTES = 32 << 30


@dataclass(frozen=True)
class FileChange:
    """A file to make hold `new_sha256` (`size` bytes, `mode`), or to delete
    (`new_sha256` None), bound to `base` (None: nothing stands there)."""

    path: str
    base: str | None
    new_sha256: str | None
    size: int = 0
    mode: int | None = None


#: Reads the new bytes of a change at a path - whole, or for a big file an open fd to
#: stream them from (`streamed.Streamed`, which the batch closes); None when they cannot
#: be read as a regular file of one link. The batch checks them against the digest.
Source = Callable[[str], "bytes | Streamed | None"]


def _source_digest(data: bytes | Streamed | None, size: int) -> str | None:
    """The digest of what a source gave (a dry run's check); None: nothing, or a stream
    that is not `size` bytes. Closes a stream."""
    if data is None:
        return None
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    try:
        hashed = hash_fd_bounded(data.fd, size)
    finally:
        data.close()
    return None if hashed is None or hashed[1] != size else hashed[0]


class FileBatches(BatchCore):
    """`apply_files`; the directories are `batch_dirs.DirBatches`'s (`writer.BatchWriter`
    is both)."""

    #: The largest file read (a target) or written (new bytes); larger: `too_large`.
    max_file_bytes: int = MAX_CHANGE_FILE_BYTES

    def apply_files(
        self,
        ws: Workspace,
        changes: Sequence[FileChange],
        source: Source,
        actor: str,
        *,
        dry_run: bool = False,
    ) -> list[Landing]:
        """Apply `changes` in order (`batch`'s theory of operation); their landings, in order.
        `dry_run`: every check, nothing written (`approval_required` whenever the policy
        asks for one). Costs per change a read and hash of the target (two when it
        exists), a read and hash of the new bytes, a temp file and a rename; per chunk
        two transactions, a `syncfs` for the temp files and one for the parents (an
        fsync when there is one)."""

        git_dirs = discoverable.GitDirs(ws.root_fd)  # the pieces of this batch count together

        def plan(dirs: HeldDirs, i: int) -> Step | Landing:
            return self._plan_file(ws, dirs, git_dirs, i, changes[i], actor, dry_run)

        def land(dirs: HeldDirs, steps: list[Step]) -> dict[int, Landing]:
            return self._land_files(ws, dirs, steps, source)

        def dry(i: int, step: Step) -> Landing:
            new = changes[i].new_sha256
            if new is not None and _source_digest(source(changes[i].path), changes[i].size) != new:
                return SOURCE_CHANGED
            return Landing("applied", plan_digest=step.digest)

        return self._chunks(ws, len(changes), plan, land, dry if dry_run else None, batch.CHUNK)

    def _plan_file(
        self,
        ws: Workspace,
        dirs: HeldDirs,
        git_dirs: discoverable.GitDirs,
        index: int,
        change: FileChange,
        actor: str,
        dry_run: bool,
    ) -> Step | Landing:
        try:
            parts = paths.split_relpath(change.path)
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        rel = "/".join(parts)
        where = ws.provenance(rel)
        # The target is read once: it says "unchanged" and binds the base.
        current: Current | None = None
        problem: Refusal | None = None
        try:
            parent = dirs.get(parts[:-1], where)
            # Only its digest is kept: a file over `STREAM_BYTES` is hashed as a stream.
            current = read_current(parent, parts[-1], where, self.max_file_bytes, STREAM_BYTES)
        except NotFound as exc:  # a directory on the way is missing: nothing stands there
            current, problem = Current(exists=False), exc
        except Refusal as exc:
            problem = exc
        target = None if change.mode is None else no_setid(change.mode)
        if current is not None and (
            (change.new_sha256 is None and not current.exists)
            or (
                change.new_sha256 is not None
                and current.sha256 == change.new_sha256
                and current.mode == target
            )
        ):
            return UNCHANGED
        try:
            check_not_reserved(parts, where)
            if not ws.policy.may_write(rel):
                raise PathDenied(f"{where}: denied by the workspace write policy")
            if problem is not None:
                raise problem
            assert current is not None
            if change.new_sha256 is None and not current.exists:
                raise NotFound(f"{where}: not found")
            made = () if current.exists else parts[-1:]
            discoverable.check_write(git_dirs, parts, where, made)
            if change.base != current.sha256:
                if change.base is None:
                    raise AlreadyExists(
                        f"{where}: exists; bind the write to its sha256 to replace it"
                    )
                raise StaleBase(
                    f"{where}: the file is not at the given base", current_sha256=current.sha256
                )
            op: Op
            if change.new_sha256 is None:
                op, mode = "delete", None
            else:
                op = "replace" if current.exists else "create"
                base_mode = current.mode if current.exists else DEFAULT_FILE_MODE
                mode = no_setid(base_mode if change.mode is None else change.mode)
            digest = plan_digest(ws.root_id, rel, op, current.sha256, change.new_sha256, mode)
            needs_approval = ws.policy.needs_approval(rel)
            if needs_approval and (
                dry_run or self._approvals.find(ws.id, digest, time.time()) is None
            ):
                raise ApprovalRequired(
                    f"{where}: needs an operator approval of this plan", plan_digest=digest
                )
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        if change.new_sha256 is None:
            git_dirs.remove(parts)
        else:
            git_dirs.add(parts)
        current.data = b""  # held for the chunk: only its digest and metadata are needed
        data = {
            "path": where,
            "op": op,
            "base_sha256": current.sha256,
            "new_sha256": change.new_sha256,
            "size": 0 if change.new_sha256 is None else change.size,
            "mode": mode,
            "plan_digest": digest,
            "approval_id": None,
        }
        return Step(
            index=index,
            parts=parts,
            where=where,
            digest=digest,
            needs_approval=needs_approval,
            intent=Intent(rel, FILE_KIND, actor, data),
            current=current,
            new_sha256=change.new_sha256,
        )

    def _land_files(
        self, ws: Workspace, dirs: HeldDirs, steps: list[Step], source: Source
    ) -> dict[int, Landing]:
        """Steps 2-4 of `batch`'s theory of operation for one chunk; the landings that are not
        `applied`."""
        out: dict[int, Landing] = {}
        if not steps:
            return out
        fresh = [s for s in steps if s.new_sha256 is not None]
        for step in fresh:
            step.temp = new_name()
        recorded: list[Temp] = [(s.dirs, s.temp) for s in fresh if s.temp is not None]
        with self._store.transaction() as db:
            self._temps.record_many_in(db, ws.id, recorded)
            token = self.intents.add_in(db, ws.id, [s.intent for s in steps])
        # A few temp files are fsynced each; more share one `syncfs` per file system,
        # which flushes whatever else is dirty there too (docs/performance.md).
        each = len(fresh) < SYNCFS_FROM
        try:
            for step in fresh:
                failed = self._write_temp(ws, dirs, step, source, recorded, fsync=each)
                if failed is not None:
                    out[step.index] = failed
            self._temps_durable(dirs, fresh, each)
        except BaseException:
            self._abandon(ws, dirs, steps, recorded, token)
            raise
        ready = [s for s in steps if s.index not in out]
        landed: list[Step] = []
        with ws.commit_lock:
            # Checkpoints are made under this lock: whether one is live holds until it goes.
            keeper = self._preimages
            if keeper is not None and not keeper.keep(Preimage(ws.id, "", None, b"", None)):
                keeper = None
            try:
                for step in ready:
                    failed = self._commit_file(ws, dirs, step, keeper)
                    if failed is None:
                        landed.append(step)
                    else:
                        out[step.index] = failed
            except BaseException:
                for step in ready:
                    self._drop_temp(dirs, step)
                raise
            finally:
                kept = self._journal_landed(ws, dirs, landed, recorded, token)
        if kept and self._preimages is not None:
            self._preimages.settle()
        return out

    @staticmethod
    def _temps_durable(dirs: HeldDirs, fresh: list[Step], each: bool) -> None:
        """The chunk's temp files durable (already, when fsynced `each`): else one
        `syncfs` per file system they are on. Raises the OSError of a failed flush."""
        if not each:
            make_durable([dirs.get(s.dirs, s.where) for s in fresh if s.temp is not None])

    def _write_temp(
        self,
        ws: Workspace,
        dirs: HeldDirs,
        step: Step,
        source: Source,
        recorded: list[Temp],
        *,
        fsync: bool = False,
    ) -> Landing | None:
        """The step's new bytes in its (recorded) temp file, fsynced only with `fsync`;
        a landing when they cannot be (the temp file then does not exist)."""
        assert step.temp is not None and step.current is not None
        data = source("/".join(step.parts))
        if isinstance(data, Streamed):
            try:
                return self._write_temp_from(ws, dirs, step, data, recorded, fsync)
            finally:
                data.close()
        if data is None or hashlib.sha256(data).hexdigest() != step.new_sha256:
            step.temp = None
            return SOURCE_CHANGED
        return self._write_temp_from(ws, dirs, step, data, recorded, fsync)

    def _write_temp_from(
        self,
        ws: Workspace,
        dirs: HeldDirs,
        step: Step,
        data: bytes | Streamed,
        recorded: list[Temp],
        fsync: bool,
    ) -> Landing | None:
        """`_write_temp` of bytes checked already, or of a stream copied and checked on
        the way (`streamed.copy_hashed`: a digest other than the step's, or a stream that
        is not its scanned size, is `source_changed` and the temp file goes)."""
        assert step.temp is not None and step.current is not None
        cur = step.current
        owner = (cur.uid, cur.gid) if cur.exists else (ws.owner_uid, ws.owner_gid)
        mode = step.intent.data["mode"]
        try:
            parent = dirs.get(step.dirs, step.where)
            for _ in range(8):
                try:
                    fd = fsops.create_exclusive(parent, step.temp, read=isinstance(data, Streamed))
                    break
                except FileExistsError:
                    # Not ours (planted since the name was drawn): another, recorded first.
                    step.temp = new_name()
                    self._temps.record(ws.id, step.dirs, step.temp)
                    recorded.append((step.dirs, step.temp))
            else:
                step.temp = None
                return Landing("refused", refusal=PathDenied(f"{step.where}: no temp file"))
            try:
                if isinstance(data, Streamed):
                    size = step.intent.data["size"]
                    if copy_hashed(data.fd, fd, size) != step.new_sha256:
                        os.close(fd)
                        fd = -1
                        self._drop_temp(dirs, step)
                        return SOURCE_CHANGED
                    data = b""
                fsops.fill(fd, data, mode=mode, owner=owner, fsync=fsync)
            finally:
                if fd >= 0:
                    os.close(fd)
        except Refusal as exc:
            self._drop_temp(dirs, step)
            return Landing("refused", refusal=exc)
        except OSError as exc:
            self._drop_temp(dirs, step)
            return Landing("failed", error=exc)
        return None

    def _commit_file(
        self, ws: Workspace, dirs: HeldDirs, step: Step, keeper: Checkpoints | None
    ) -> Landing | None:
        """Under the commit lock: the base re-checked, then the rename or unlink; a
        landing when it did not land (its temp file removed)."""
        assert step.current is not None
        name = step.parts[-1]
        held: int | None = None
        try:
            parent = dirs.get(step.dirs, step.where)
            # A live checkpoint keeps what is replaced: its bytes are held (up to the
            # pre-image bound); else only its digest, streamed past `STREAM_BYTES`.
            keep = MAX_PATCH_FILE if keeper is not None else STREAM_BYTES
            now, held = read_current_held(parent, name, step.where, self.max_file_bytes, keep)
            if now.sha256 != step.current.sha256:
                raise StaleBase(
                    f"{step.where}: changed while the write was prepared",
                    current_sha256=now.sha256,
                )
            self._find_approval(ws, step)
            if keeper is not None:
                if not now.whole:
                    raise TooLarge(
                        f"{step.where}: a live checkpoint keeps what a write replaces, up to"
                        f" {MAX_PATCH_FILE} bytes; this file has {now.size}",
                        limit=MAX_PATCH_FILE,
                    )
                rel, mode = step.intent.rel, now.mode if now.exists else None
                step.pre = Preimage(ws.id, rel, now.sha256, now.data, mode)
                keeper.keep(step.pre)
            if step.temp is None:
                os.unlink(name, dir_fd=parent)
            elif held is None:  # a new file: never over one the host made since the check
                rename_new(parent, step.temp, name)
                step.temp = None
            else:
                os.rename(step.temp, name, src_dir_fd=parent, dst_dir_fd=parent)
                step.temp = None
            if held is not None:
                RELEASER.release(held)  # the replaced file is freed off this path
                held = None
        except Refusal as exc:
            self._drop_temp(dirs, step)
            return Landing("refused", refusal=exc)
        except FileExistsError:
            self._drop_temp(dirs, step)
            return Landing("refused", refusal=AlreadyExists(f"{step.where}: made meanwhile"))
        except OSError as exc:
            self._drop_temp(dirs, step)
            return Landing("failed", error=exc)
        finally:
            if held is not None:
                os.close(held)
        return None
