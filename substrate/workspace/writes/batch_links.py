"""A change set's symlinks in batches, each bound to its base (`changes.apply_link`).

A change set's symlinks (docs/working-layer.md, "Symlinks") take the steps of `batch`'s
theory of operation as its files do, with a link's target for its bytes:

1. plan: the link's path is read once through its held parent fd (`lstat`, and
   `readlinkat` for a link; nothing is ever followed); `unchanged` when it is the link
   the change makes; else the reserved temp names and the policy on the link's own
   path (`path_denied`: a link named `.env` is denied as a file of that name is),
   `discoverable.check_write`, the base (`stale_base`, `already_exists`), the plan
   digest (`link_digest`) and `require_approval` decide;
2. record the temp names and the intents in one transaction;
3. make each link beneath its held parent fd: `symlinkat` into a recorded temp name in
   the same directory (`EEXIST`: another name), given the old link's owner (the
   workspace owner's for a new one, `fchownat(AT_SYMLINK_NOFOLLOW)`), then one `syncfs`;
4. under the commit lock: the path read again and its base checked right before the
   rename (a host edit since is `stale_base`, never overwritten), the approval found
   again, then the rename over the target (`RENAME_NOREPLACE` for a new link) or the
   unlink of a deleted one; the parents made durable and one transaction journals them.

A link's base is the digest of the link standing there (`link_digest`: the SHA-256 of
its target's bytes, as git digests a link); anything else standing there (a file, a
directory) is not a base a link change may replace: the change set deletes it first,
as a separate change. The target is written verbatim and never resolved. The journal
entry holds the path, the digests, the target's length (`target_bytes`) and `escapes`,
never the target itself: it is agent-chosen text, and the change set (`changes.get`)
and the checkout show it. A live checkpoint keeps no pre-image of a link (a restore
leaves links as they are: docs/working-layer.md).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

from substrate.errors import (
    AlreadyExists,
    ApprovalRequired,
    NotFound,
    PathDenied,
    Refusal,
    StaleBase,
)
from substrate.fs import paths
from substrate.fs.fsops import make_durable, rename_new
from substrate.store.journal import canonical
from substrate.workspace import discoverable
from substrate.workspace.adopted import Workspace
from substrate.workspace.writes import batch
from substrate.workspace.writes.batch import UNCHANGED, BatchCore, HeldDirs, Landing, Step, Temp
from substrate.workspace.writes.intents import LINK_KIND, Intent
from substrate.workspace.writes.temp_files import check_not_reserved, new_name


@dataclass(frozen=True)
class LinkChange:
    """A symlink to make at `path` pointing to `target` (None: delete the link there),
    bound to `base` (the digest of the link there, None: nothing stands there)."""

    path: str
    base: str | None
    target: str | None
    escapes: bool = False


def link_digest(target: bytes) -> str:
    """A link's digest: the SHA-256 of its target's bytes. Pure."""
    return hashlib.sha256(target).hexdigest()


def link_plan_digest(root_id: str, path: str, op: str, base: str | None, new: str | None) -> str:
    """The plan digest of a link step: `[root_id, path, "symlink", op, base, new]` (never
    the digest of a file's plan with the same bytes)."""
    return hashlib.sha256(canonical([root_id, path, "symlink", op, base, new])).hexdigest()


@dataclass(frozen=True)
class _Now:
    """What stands at a link step's path now: `kind` None (absent), "symlink" (with
    its digest and owner) or another kind."""

    kind: str | None
    sha256: str | None = None
    owner: tuple[int, int] = (-1, -1)


def _now(parent: int, name: str) -> _Now:
    st = paths.lstat_at(parent, name)
    if st is None:
        return _Now(None)
    if not stat.S_ISLNK(st.st_mode):
        return _Now(paths.kind_of(st.st_mode))
    try:
        target = os.readlink(os.fsencode(name), dir_fd=parent)
    except FileNotFoundError:
        return _Now(None)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # replaced by something else since the lstat
            return _Now("file")
        raise
    return _Now("symlink", link_digest(target), (st.st_uid, st.st_gid))


@dataclass
class _LinkStep(Step):
    target: bytes | None = None
    base: str | None = None  # the digest planned against (None: nothing there)
    owner: tuple[int, int] = (-1, -1)


class LinkBatches(BatchCore):
    """`apply_links`; files and directories are `batch_files`'/`batch_dirs`'
    (`writer.BatchWriter` is all three)."""

    def apply_links(
        self,
        ws: Workspace,
        changes: Sequence[LinkChange],
        actor: str,
        *,
        dry_run: bool = False,
    ) -> list[Landing]:
        """Apply the link changes in order (the module doc); their landings, in order.
        `dry_run`: every check, nothing made. Costs per change an lstat and a readlink
        (twice: planned and under the lock), a `symlinkat` and a rename; per chunk two
        transactions, a `syncfs` for the temp links and one for the parents."""
        git_dirs = discoverable.GitDirs(ws.root_fd)

        def plan(dirs: HeldDirs, i: int) -> Step | Landing:
            return self._plan_link(ws, dirs, git_dirs, i, changes[i], actor, dry_run)

        def land(dirs: HeldDirs, steps: list[Step]) -> dict[int, Landing]:
            return self._land_links(ws, dirs, [s for s in steps if isinstance(s, _LinkStep)])

        dry = (lambda _, step: Landing("applied", plan_digest=step.digest)) if dry_run else None
        return self._chunks(ws, len(changes), plan, land, dry, batch.CHUNK)

    def _plan_link(
        self,
        ws: Workspace,
        dirs: HeldDirs,
        git_dirs: discoverable.GitDirs,
        index: int,
        change: LinkChange,
        actor: str,
        dry_run: bool,
    ) -> Step | Landing:
        try:
            parts = paths.split_relpath(change.path)
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        rel = "/".join(parts)
        where = ws.provenance(rel)
        target = None if change.target is None else os.fsencode(change.target)
        new = None if target is None else link_digest(target)
        now: _Now | None = None
        problem: Refusal | None = None
        try:
            now = _now(dirs.get(parts[:-1], where), parts[-1])
        except NotFound as exc:  # a directory on the way is missing: nothing stands there
            now, problem = _Now(None), exc
        except Refusal as exc:
            problem = exc
        except OSError as exc:
            return Landing("failed", error=exc)
        if now is not None and (
            (new is None and now.kind is None) or (new is not None and now.sha256 == new)
        ):
            return UNCHANGED
        try:
            check_not_reserved(parts, where)
            if not ws.policy.may_write(rel):
                raise PathDenied(f"{where}: denied by the workspace write policy")
            if problem is not None:
                raise problem
            assert now is not None
            if new is None and now.kind is None:
                raise NotFound(f"{where}: not found")
            discoverable.check_write(git_dirs, parts, where, parts[-1:] if now.kind is None else ())
            if now.kind not in (None, "symlink") or change.base != now.sha256:
                if change.base is None:
                    raise AlreadyExists(f"{where}: exists; a link is made only where none is")
                raise StaleBase(
                    f"{where}: the link is not at the given base", current_sha256=now.sha256
                )
            op = "delete" if new is None else ("replace" if now.kind is not None else "create")
            digest = link_plan_digest(ws.root_id, rel, op, now.sha256, new)
            needs_approval = ws.policy.needs_approval(rel)
            if needs_approval and (
                dry_run or self._approvals.find(ws.id, digest, time.time()) is None
            ):
                raise ApprovalRequired(
                    f"{where}: needs an operator approval of this plan", plan_digest=digest
                )
        except Refusal as exc:
            return Landing("refused", refusal=exc)
        if new is None:
            git_dirs.remove(parts)
        else:
            git_dirs.add(parts)
        data = {
            "path": where,
            "op": op,
            "kind": "symlink",
            "base_sha256": now.sha256,
            "new_sha256": new,
            "target_bytes": None if target is None else len(target),
            "escapes": None if target is None else change.escapes,
            "mode": None,
            "plan_digest": digest,
            "approval_id": None,
        }
        owner = now.owner if now.kind == "symlink" else (ws.owner_uid, ws.owner_gid)
        return _LinkStep(
            index=index,
            parts=parts,
            where=where,
            digest=digest,
            needs_approval=needs_approval,
            intent=Intent(rel, LINK_KIND, actor, data),
            new_sha256=new,
            target=target,
            base=now.sha256,
            owner=owner,
        )

    def _land_links(
        self, ws: Workspace, dirs: HeldDirs, steps: list[_LinkStep]
    ) -> dict[int, Landing]:
        """Steps 2-4 of the module doc for one chunk; the landings that are not
        `applied`."""
        out: dict[int, Landing] = {}
        if not steps:
            return out
        fresh = [s for s in steps if s.target is not None]
        for step in fresh:
            step.temp = new_name()
        recorded: list[Temp] = [(s.dirs, s.temp) for s in fresh if s.temp is not None]
        with self._store.transaction() as db:
            self._temps.record_many_in(db, ws.id, recorded)
            token = self.intents.add_in(db, ws.id, [s.intent for s in steps])
        try:
            for step in fresh:
                failed = self._make_temp(ws, dirs, step, recorded)
                if failed is not None:
                    out[step.index] = failed
            make_durable([dirs.get(s.dirs, s.where) for s in fresh if s.temp is not None])
        except BaseException:
            self._abandon(ws, dirs, list(steps), recorded, token)
            raise
        landed: list[Step] = []
        with ws.commit_lock:
            try:
                for step in steps:
                    if step.index in out:
                        continue
                    failed = self._commit_link(ws, dirs, step)
                    if failed is None:
                        landed.append(step)
                    else:
                        out[step.index] = failed
            except BaseException:
                for step in steps:
                    self._drop_temp(dirs, step)
                raise
            finally:
                self._journal_landed(ws, dirs, landed, recorded, token)
        return out

    def _make_temp(
        self, ws: Workspace, dirs: HeldDirs, step: _LinkStep, recorded: list[Temp]
    ) -> Landing | None:
        """The step's link under its (recorded) temp name, with its owner; a landing
        when it cannot be made (no temp link then)."""
        assert step.temp is not None and step.target is not None
        try:
            parent = dirs.get(step.dirs, step.where)
            for _ in range(8):
                try:
                    os.symlink(step.target, os.fsencode(step.temp), dir_fd=parent)
                    break
                except FileExistsError:
                    # Not ours (planted since the name was drawn): another, recorded first.
                    step.temp = new_name()
                    self._temps.record(ws.id, step.dirs, step.temp)
                    recorded.append((step.dirs, step.temp))
            else:
                step.temp = None
                return Landing("refused", refusal=PathDenied(f"{step.where}: no temp link"))
            os.chown(step.temp, *step.owner, dir_fd=parent, follow_symlinks=False)
        except Refusal as exc:
            self._drop_temp(dirs, step)
            return Landing("refused", refusal=exc)
        except OSError as exc:
            self._drop_temp(dirs, step)
            return Landing("failed", error=exc)
        return None

    def _commit_link(self, ws: Workspace, dirs: HeldDirs, step: _LinkStep) -> Landing | None:
        """Under the commit lock: the base re-checked, then the rename or unlink; a
        landing when it did not land (its temp link removed)."""
        name = step.parts[-1]
        try:
            parent = dirs.get(step.dirs, step.where)
            now = _now(parent, name)
            if now.kind not in (None, "symlink") or now.sha256 != step.base:
                raise StaleBase(
                    f"{step.where}: changed while the link was prepared",
                    current_sha256=now.sha256,
                )
            self._find_approval(ws, step)
            if step.temp is None:
                os.unlink(name, dir_fd=parent)
            elif step.base is None:  # a new link: never over a name the host made since
                rename_new(parent, step.temp, name)
                step.temp = None
            else:
                os.rename(step.temp, name, src_dir_fd=parent, dst_dir_fd=parent)
                step.temp = None
        except Refusal as exc:
            self._drop_temp(dirs, step)
            return Landing("refused", refusal=exc)
        except FileExistsError:
            self._drop_temp(dirs, step)
            return Landing("refused", refusal=AlreadyExists(f"{step.where}: made meanwhile"))
        except OSError as exc:
            self._drop_temp(dirs, step)
            return Landing("failed", error=exc)
        return None
