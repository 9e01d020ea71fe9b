"""A change set's directory steps in batches: mkdir, empty-only rmdir, chmod.

Directory steps of a change set in batches: `mkdir` (the workspace owner's), empty-only
`rmdir` and `chmod`, journaled `changes.apply_dir` (theory of operation: `batch`). Set-id
bits are never given.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

from substrate.errors import ApprovalRequired, NotFound, PathDenied, Refusal
from substrate.fs import fsops, paths
from substrate.workspace import discoverable
from substrate.workspace.adopted import Workspace
from substrate.workspace.writes import batch
from substrate.workspace.writes.batch import UNCHANGED, BatchCore, HeldDirs, Landing, Step
from substrate.workspace.writes.intents import DIR_KIND, Intent
from substrate.workspace.writes.plan import DEFAULT_DIR_MODE, DirOp, dir_digest, no_setid
from substrate.workspace.writes.temp_files import check_not_reserved


@dataclass(frozen=True)
class DirChange:
    """A directory step: `mkdir` (with `mode`, or 0755), `rmdir` (empty only), `chmod`."""

    path: str
    op: DirOp
    mode: int | None = None


class DirBatches(BatchCore):
    """`apply_dirs`; the files are `batch_files.FileBatches`'s (`writer.BatchWriter` is
    both)."""

    def apply_dirs(
        self, ws: Workspace, changes: Sequence[DirChange], actor: str, *, dry_run: bool = False
    ) -> list[Landing]:
        """Apply directory steps in order; their landings, in order. Each is `unchanged`
        when the checkout already holds its result. Refusals are a guarded write's
        (`path_invalid`, `path_denied`, `approval_required` with the plan digest,
        `symlink_refused`, `not_found`, ...), failures an OSError's (EEXIST, ENOTEMPTY).
        `dry_run`: the policy checked, nothing done (`approval_required` whenever the
        policy asks for one). Costs per step an lstat and the step; per chunk two
        transactions and an fsync per parent (from `batch.SYNCFS_FROM` of them one
        `syncfs` per file system)."""

        git_dirs = discoverable.GitDirs(ws.root_fd)  # the pieces of this batch count together

        def plan(dirs: HeldDirs, i: int) -> Step | Landing:
            return self._plan_dir(ws, dirs, git_dirs, i, changes[i], actor, dry_run)

        def land(dirs: HeldDirs, steps: list[Step]) -> dict[int, Landing]:
            return self._land_dirs(ws, dirs, steps)

        dry = (lambda _, step: Landing("applied", plan_digest=step.digest)) if dry_run else None
        return self._chunks(ws, len(changes), plan, land, dry, batch.MAX_DIRS)

    def _plan_dir(
        self,
        ws: Workspace,
        dirs: HeldDirs,
        git_dirs: discoverable.GitDirs,
        index: int,
        change: DirChange,
        actor: str,
        dry_run: bool,
    ) -> Step | Landing:
        try:
            parts = paths.split_relpath(change.path)
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        rel = "/".join(parts)
        where = ws.provenance(rel)
        mode = None if change.mode is None else no_setid(change.mode)
        st: os.stat_result | None = None
        absent = False
        try:
            st = paths.lstat_at(dirs.get(parts[:-1], where), parts[-1])
            absent = st is None
        except NotFound:
            absent = True
        except Refusal:
            pass
        if change.op == "rmdir" and absent:
            return UNCHANGED
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        same_mode = st is not None and stat.S_IMODE(st.st_mode) == mode
        if is_dir and (change.op == "mkdir" or (change.op == "chmod" and same_mode)):
            return UNCHANGED
        digest = dir_digest(ws.root_id, rel, change.op, mode)
        try:
            check_not_reserved(parts, where)
            if not ws.policy.may_write(rel):
                raise PathDenied(f"{where}: denied by the workspace write policy")
            made = parts[-1:] if change.op == "mkdir" and absent else ()
            discoverable.check_write(git_dirs, parts, where, made)
            needs_approval = ws.policy.needs_approval(rel)
            if needs_approval and (
                dry_run or self._approvals.find(ws.id, digest, time.time()) is None
            ):
                raise ApprovalRequired(
                    f"{where}: needs an operator approval of this plan", plan_digest=digest
                )
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        if change.op == "rmdir":
            git_dirs.remove(parts)
        else:
            git_dirs.add(parts)
        data = {
            "path": where,
            "op": change.op,
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
            intent=Intent(rel, DIR_KIND, actor, data),
        )

    def _land_dirs(self, ws: Workspace, dirs: HeldDirs, steps: list[Step]) -> dict[int, Landing]:
        """The chunk's intents recorded, then under the commit lock each step, one fsync
        per parent and one transaction; the landings of the steps that did not land."""
        out: dict[int, Landing] = {}
        with self._store.transaction() as db:
            token = self.intents.add_in(db, ws.id, [s.intent for s in steps])
        landed: list[Step] = []
        with ws.commit_lock:
            try:
                for step in steps:
                    failed = self._dir_step(ws, dirs, step)
                    if failed is None:
                        landed.append(step)
                    else:
                        out[step.index] = failed
            finally:
                self._journal_landed(ws, dirs, landed, [], token)
        return out

    def _dir_step(self, ws: Workspace, dirs: HeldDirs, step: Step) -> Landing | None:
        name = step.parts[-1]
        op, mode = step.intent.data["op"], step.intent.data["mode"]
        try:
            self._find_approval(ws, step)
            parent = dirs.get(step.dirs, step.where)
            if op == "mkdir":
                owner = (ws.owner_uid, ws.owner_gid)
                fsops.make_dir(
                    parent, name, mode=DEFAULT_DIR_MODE if mode is None else mode, owner=owner
                )
            elif op == "rmdir":
                os.rmdir(name, dir_fd=parent)
            else:
                assert mode is not None
                with paths.opened_dir(parent, (name,), step.where) as fd:
                    os.fchmod(fd, mode)
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        except OSError as exc:
            return Landing("failed", error=exc)
        return None
