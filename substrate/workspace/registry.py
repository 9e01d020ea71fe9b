"""Adopted workspaces: where they are (held as open dir fds), who owns them, their policy.

A workspace is adopted only beneath a configured adopt root, reached from the root's fd
one `O_NOFOLLOW` component at a time, so a symlink on the way is refused. From then on
the daemon uses the held root fd, never the path string; the path is kept only to
re-adopt after a restart and to bind-mount into sandboxes, and never leaves the daemon.

VCS state is read from `.git/HEAD` and refs as plain files (`substrate.workspace.vcs`):
git itself is never run on a workspace. One adopted workspace and the guard of its root
fd are `substrate.workspace.adopted`.

A workspace's policy is its checkout's, remembered across release and restarts, with the
rules of the checkouts nested in it or enclosing it (`substrate.workspace.checkouts`); it is
recomputed for every adopted workspace a change reaches.
"""

from __future__ import annotations

import os
import re
import secrets
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from substrate.errors import (
    AlreadyExists,
    LimitExceeded,
    NotADirectory,
    PathDenied,
    PathInvalid,
    Refusal,
    UnknownWorkspace,
)
from substrate.fs import paths
from substrate.schema.workspace import MAX_GLOBS, Policy, WorkspaceInfo
from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.adopted import FdUsers as FdUsers
from substrate.workspace.adopted import Workspace as Workspace
from substrate.workspace.checkouts import (
    NOTHING,
    CheckoutPolicies,
    glob_count,
    nested,
    summary,
)
from substrate.workspace.homes import Homes
from substrate.workspace.identity import CheckoutId, checkout_identity
from substrate.workspace.policy import (
    DENY_LISTS,
    GIT_NAME,
    CompiledPolicy,
    compile_policy,
    merge,
    subtract,
)
from substrate.workspace.vcs import is_git_dir
from substrate.workspace.vcs import read_vcs as read_vcs
from substrate.workspace.writes.temp_files import TEMP_PREFIX as TEMP_PREFIX
from substrate.workspace.writes.temp_files import TempFiles, remove_recorded

if TYPE_CHECKING:
    # Only the type: substrate.config imports substrate.workspace.policy at its top.
    from substrate.config import Config

SCHEMA = """
CREATE TABLE IF NOT EXISTS workspaces (
    id TEXT PRIMARY KEY,
    root_id TEXT NOT NULL UNIQUE,
    path TEXT NOT NULL,
    policy TEXT NOT NULL,
    adopted REAL NOT NULL
);
"""

#: Added since: the checkout's identity (`CheckoutId.key`) the workspace was adopted
#: with. NULL in a row an older release made (migrated once at start, see `_reload`).
ADDED_COLUMNS = {"checkout": "TEXT"}

#: How long `release` waits for operations using the root fd before returning anyway
#: (the fd is then closed by the last of them to finish, never under one).
RELEASE_DRAIN_S = 30.0


def derive_root_id(name: str) -> str:
    """A public id from a directory name: lowercase, `[a-z0-9-]`, at most 64 chars."""
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    slug = re.sub(r"-{2,}", "-", slug)[:64].strip("-")
    return slug or "workspace"


class WorkspaceRegistry:
    """Adopted workspaces, persisted in the store, each holding its root dir fd."""

    def __init__(self, config: Config, store: Store, journal: Journal, state_dir: Path) -> None:
        self._config = config
        self._store = store
        self._journal = journal
        self._state_dir = state_dir
        self._lock = threading.Lock()
        self._by_id: dict[str, Workspace] = {}
        store.ensure_schema(SCHEMA)
        store.ensure_columns("workspaces", ADDED_COLUMNS)
        self._approvals = Approvals(store)
        self._checkouts = CheckoutPolicies(store, config.policy)
        #: The checkouts' persistent homes (the sandboxes' `$HOME`): kept by the same
        #: identity, so an older release's are migrated here with their checkout.
        self.homes = Homes(state_dir, quota_bytes=config.home_quota_bytes)
        self._reload()

    # -- adoption ------------------------------------------------------------------------

    def _open_under_adopt_root(self, path: str) -> tuple[int, str]:
        """Open `path` beneath its adopt root: (dir fd, its checkout path).

        The checkout path is the adopt root resolved (operator configuration, trusted)
        plus the components walked: one spelling per directory, used to find the
        checkouts nested in or enclosing another. Refuses `path_denied` for a `.git`
        directory or anything inside one, and for a git directory by content (a bare
        repository, a submodule's or worktree's git dir): adopting one would let guarded
        writes reach hooks and config that git runs.
        """
        if "\x00" in path or not path.startswith("/"):
            raise PathInvalid("workspace path must be an absolute host path")
        norm = os.path.normpath(path)
        for root in self._config.adopt_roots:
            root_norm = os.path.normpath(os.path.abspath(root))
            if norm == root_norm:
                rel: tuple[str, ...] = ()
            elif norm.startswith(root_norm.rstrip("/") + "/"):
                rel = tuple(norm[len(root_norm.rstrip("/")) + 1 :].split("/"))
            else:
                continue
            if GIT_NAME in norm.split("/"):
                raise PathDenied("a .git directory, or anything inside one, is never a workspace")
            try:
                # The adopt root itself is operator configuration: trusted to resolve.
                root_fd = os.open(root_norm, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise paths.refusal_for(exc, "adopt root") from None
            fd = root_fd
            try:
                for name in rel:
                    nxt = paths.open_dir(fd, (name,), "workspace path")
                    os.close(fd)
                    fd = nxt
                    if is_git_dir(fd):
                        raise PathDenied(
                            "a git directory, or anything inside one, is never a workspace"
                        )
            except BaseException:
                os.close(fd)
                raise
            real_root = os.path.realpath(root_norm)
            return fd, "/".join([real_root.rstrip("/"), *rel]) if rel else real_root
        raise PathDenied("path is not under any configured adopt root")

    def _check_state_dir_outside(self, root_fd: int) -> None:
        root = os.fstat(root_fd)
        probe = self._state_dir
        while True:
            st = os.stat(probe)
            if (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino):
                raise PathDenied("the workspace would contain the daemon's state dir")
            if probe.parent == probe:
                return
            probe = probe.parent

    def adopt(self, path: str, root_id: str | None, policy: Policy | None, actor: str) -> Workspace:
        """Adopt `path` (or return the workspace that already holds it).

        The workspace's policy is the checkout's (the operator's default, what the
        operator set for it and what agents added, remembered across release and
        restarts) plus the rules of every checkout nested in it or enclosing it. A given
        `policy` may only add to the checkout's; it is remembered with it.

        Refuses: `path_invalid`, `path_denied` (outside adopt roots, containing the state
        dir, a `.git` or git directory or inside one), `symlink_refused`, `not_found`,
        `not_a_directory`, `already_exists` (root_id taken by another workspace),
        `invalid_params` (bad policy glob), `policy_locked` (the policy would loosen the
        checkout's), `limit_exceeded` (too many globs in an effective policy).
        """
        if policy is not None:
            compile_policy(policy)
        root_fd, checkout_path = self._open_under_adopt_root(path)
        try:
            st = os.fstat(root_fd)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectory("workspace path is not a directory")
            self._check_state_dir_outside(root_fd)
            ident = checkout_identity(root_fd)
            with self._lock:
                for ws in self._by_id.values():
                    if ws.checkout == ident.key:
                        if policy is not None:
                            self._add_policy(ws, policy, actor)
                        os.close(root_fd)
                        return ws
                taken = {ws.root_id for ws in self._by_id.values()}
                if root_id is not None and root_id in taken:
                    raise AlreadyExists(f"root_id {root_id!r} is taken by another workspace")
                chosen = root_id or self._free_root_id(
                    derive_root_id(os.path.basename(os.path.normpath(path))), taken
                )
                key = ident.key
                legacy = self._checkouts.legacy_at(ident, checkout_path)
                own = self._checkouts.own(key, checkout_path)
                added = NOTHING
                if policy is not None:
                    added = self._checkouts.additions(own, policy)
                    own = merge(own, added)
                ws = Workspace(
                    id="ws_" + secrets.token_hex(8),
                    root_id=chosen,
                    host_path=os.path.normpath(path),
                    root_fd=root_fd,
                    policy=compile_policy(None),
                    owner_uid=st.st_uid,
                    owner_gid=st.st_gid,
                    adopted=round(time.time(), 6),
                    dev_ino=ident.dev_ino,
                    checkout=key,
                    checkout_path=checkout_path,
                )
                with self._store.transaction() as db:
                    if legacy:
                        self._migrate_in(db, ident, ws.root_id, ws.id)
                    self._checkouts.save(db, key, checkout_path, own)
                    policies = self._recompute([ws, *self._related_live(checkout_path)])
                    db.execute(
                        "INSERT INTO workspaces(id, root_id, path, policy, adopted, checkout)"
                        " VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            ws.id,
                            ws.root_id,
                            ws.host_path,
                            msgspec.json.encode(policies[ws.id].policy).decode(),
                            ws.adopted,
                            key,
                        ),
                    )
                    vcs = read_vcs(root_fd)
                    self._journal.append_in(
                        db,
                        "workspace.adopted",
                        {"root_id": ws.root_id, "vcs_head": vcs.head if vcs else None},
                        workspace=ws.id,
                        actor=actor,
                    )
                    if glob_count(added):
                        self._journal.append_in(
                            db,
                            "workspace.policy_added",
                            {"root_id": ws.root_id, **summary(added)},
                            workspace=ws.id,
                            actor=actor,
                        )
                self._apply(policies, ws)
                self._by_id[ws.id] = ws
                return ws
        except BaseException:
            if root_fd not in {w.root_fd for w in self._by_id.values()}:
                os.close(root_fd)
            raise

    @staticmethod
    def _free_root_id(base: str, taken: set[str]) -> str:
        if base not in taken:
            return base
        n = 2
        while f"{base[:60]}-{n}" in taken:
            n += 1
        return f"{base[:60]}-{n}"

    def _reload(self) -> None:
        """Re-adopt persisted workspaces at start. One that cannot be reopened, or whose
        path now holds another directory than the one adopted (another identity, even
        with the old inode), is dropped (`workspace.unavailable`): its handle and journal
        history are never given to that directory, which is adopted anew when asked.

        A workspace persisted before checkouts had remembered policies gets its stored
        policy remembered as its checkout's, so an upgrade loosens nothing. One persisted
        by a release that kept no identity is migrated once, when the checkout remembered
        at its path has the st_dev:st_ino it has now (`_migrate_in`); else dropped.
        """
        for row in self._store.query("SELECT * FROM workspaces ORDER BY adopted"):
            try:
                root_fd, checkout_path = self._open_under_adopt_root(row["path"])
            except Refusal as refusal:
                self._drop_row(row, {"refusal": refusal.name})
                continue
            try:
                ident = checkout_identity(root_fd)
            except Refusal as refusal:
                os.close(root_fd)
                self._drop_row(row, {"refusal": refusal.name})
                continue
            recorded: str | None = row["checkout"]
            legacy = recorded is None and self._checkouts.legacy_at(ident, checkout_path)
            if not self._same_checkout(recorded, legacy, ident, checkout_path):
                os.close(root_fd)
                self._drop_row(row, {"refusal": "not_found", "reason": "replaced"})
                continue
            key = ident.key
            known = self._checkouts.known(key, checkout_path)
            if legacy or recorded is None or not known:
                with self._store.transaction() as db:
                    if legacy:
                        self._migrate_in(db, ident, row["root_id"], row["id"])
                    db.execute("UPDATE workspaces SET checkout = ? WHERE id = ?", (key, row["id"]))
                    if not known:
                        stored = msgspec.json.decode(row["policy"], type=Policy)
                        own = subtract(stored, self._config.policy)
                    else:
                        own = self._checkouts.own(key, checkout_path)
                    self._checkouts.save(db, key, checkout_path, own)
            st = os.fstat(root_fd)
            self._by_id[row["id"]] = Workspace(
                id=row["id"],
                root_id=row["root_id"],
                host_path=row["path"],
                root_fd=root_fd,
                policy=compile_policy(None),
                owner_uid=st.st_uid,
                owner_gid=st.st_gid,
                adopted=row["adopted"],
                dev_ino=ident.dev_ino,
                checkout=key,
                checkout_path=checkout_path,
            )
        # No cap here: what was adopted stays adopted; the cap applies to changes.
        live = list(self._by_id.values())
        self._apply(self._recompute(live, capped=False), None)

    def _same_checkout(
        self, recorded: str | None, legacy: bool, ident: CheckoutId, path: str
    ) -> bool:
        """Is the directory now at a persisted workspace's path the checkout it adopted?
        Its recorded identity says; a row of an older release (none recorded) passes when
        the checkout remembered at that path has this st_dev:st_ino (`legacy`), or when
        no checkout was remembered there at all (a database older than remembered
        policies: the path is all it ever kept)."""
        if recorded is not None:
            return recorded == ident.key
        return legacy or not self._checkouts.recorded_at(path)

    def _drop_row(self, row: sqlite3.Row, why: dict[str, str]) -> None:
        """A persisted workspace that is not there any more: journaled and forgotten."""
        self._journal.append(
            "workspace.unavailable", {"root_id": row["root_id"], **why}, workspace=row["id"]
        )
        with self._store.transaction() as db:
            db.execute("DELETE FROM workspaces WHERE id = ?", (row["id"],))

    def _migrate_in(
        self, db: sqlite3.Connection, ident: CheckoutId, root_id: str, workspace: str
    ) -> None:
        """An older release kept this checkout by st_dev:st_ino only, at the same path:
        its homes become this identity's (`Homes.claim_legacy`; its policy row is taken
        over by path in `CheckoutPolicies.save`), once, journaled
        `workspace.identity_migrated`. That old key cannot prove the directory is the
        same (an inode reused at the same path passes too): the path matching as well
        is the most an old row holds, and it is trusted this one time only."""
        home = self.homes.claim_legacy(ident.legacy, ident.key)
        self._journal.append_in(
            db,
            "workspace.identity_migrated",
            {"root_id": root_id, "home": home},
            workspace=workspace,
        )

    # -- policy of checkouts ----------------------------------------------------------------

    def set_policy(self, workspace: str, policy: Policy, actor: str) -> Workspace:
        """`workspace.set_policy` (operator): the policy of this checkout becomes `policy`
        (beside the operator's default `[policy]`, which always applies), replacing what
        was set or added before; remembered across release and restarts. May loosen.

        Refuses: `unknown_workspace`, `invalid_params` (bad glob), `limit_exceeded`.
        """
        compile_policy(policy)
        with self._lock:
            ws = self.get(workspace)
            own = subtract(policy, NOTHING)
            self._save_own(ws, own, "workspace.policy_set", own, actor)
            return ws

    def _add_policy(self, ws: Workspace, policy: Policy, actor: str) -> None:
        """An agent's policy for an adopted checkout: add what it adds (caller holds the lock)."""
        key = ws.checkout
        own = self._checkouts.own(key, ws.checkout_path)
        added = self._checkouts.additions(own, policy)
        if not glob_count(added):
            return
        self._save_own(ws, merge(own, added), "workspace.policy_added", added, actor)

    def _save_own(self, ws: Workspace, own: Policy, kind: str, told: Policy, actor: str) -> None:
        """Store a checkout's own policy, recompute every live workspace it bears on and
        journal `kind` with a summary of `told` (counts and a digest, never the globs),
        in one transaction; then swap the compiled policies in (caller holds the lock)."""
        with self._store.transaction() as db:
            self._checkouts.save(db, ws.checkout, ws.checkout_path, own)
            policies = self._recompute([ws, *self._related_live(ws.checkout_path)])
            self._journal.append_in(
                db, kind, {"root_id": ws.root_id, **summary(told)}, workspace=ws.id, actor=actor
            )
        self._apply(policies, None)

    def _related_live(self, checkout_path: str) -> list[Workspace]:
        """Adopted workspaces nested in or enclosing `checkout_path` (not at it)."""
        return [
            ws
            for ws in self._by_id.values()
            if nested(ws.checkout_path, checkout_path) or nested(checkout_path, ws.checkout_path)
        ]

    def _recompute(
        self, spaces: list[Workspace], *, capped: bool = True
    ) -> dict[str, CompiledPolicy]:
        """The effective policy of each of `spaces`; `limit_exceeded` when one would hold
        more than MAX_GLOBS globs in a list (checked before anything is applied)."""
        out: dict[str, CompiledPolicy] = {}
        for ws in spaces:
            effective = self._checkouts.effective(ws.checkout, ws.checkout_path)
            compiled = compile_policy(effective)
            for name in ("write_allow", *DENY_LISTS):
                if capped and len(getattr(compiled.policy, name)) > MAX_GLOBS:
                    raise LimitExceeded(
                        f"the policy of {ws.root_id} would hold more than {MAX_GLOBS} {name}"
                        " globs (with those of the checkouts nested in it or enclosing it)"
                    )
            out[ws.id] = compiled
        return out

    def _apply(self, policies: dict[str, CompiledPolicy], new: Workspace | None) -> None:
        for ws_id, compiled in policies.items():
            target = new if new is not None and new.id == ws_id else self._by_id.get(ws_id)
            if target is not None:
                target.policy = compiled

    # -- lookup and release ----------------------------------------------------------------

    def get(self, workspace: str) -> Workspace:
        """The workspace with this handle. Refuses `unknown_workspace`.

        A released workspace is gone from here at once; an operation that got it before
        holds its root fd with `Workspace.use`, which refuses once it is released.
        """
        found = self._by_id.get(workspace)
        if found is None:
            raise UnknownWorkspace(f"no workspace {workspace!r}")
        return found

    def all(self) -> list[Workspace]:
        """The adopted workspaces, oldest first."""
        return sorted(self._by_id.values(), key=lambda w: w.adopted)

    def infos(self) -> list[WorkspaceInfo]:
        """`workspace.list`: the `info` of each adopted workspace, oldest first; one
        released meanwhile is left out. Blocking (reads `.git` of each)."""
        found: list[WorkspaceInfo] = []
        for ws in self.all():
            try:
                found.append(ws.info())
            except UnknownWorkspace:
                continue
        return found

    def release(self, workspace: str, actor: str, drain_s: float = RELEASE_DRAIN_S) -> None:
        """Forget the workspace and close its root fd once no operation uses it.

        New operations are refused (`unknown_workspace`) from the start; this waits up to
        `drain_s` for those in flight (a started write finishes and is journaled before
        the release), and if some are still running then, the last of them closes the fd.
        Refuses `unknown_workspace`.
        """
        with self._lock:
            ws = self.get(workspace)
            del self._by_id[ws.id]
        try:
            # Writes in flight finish (and are journaled) before the release is.
            ws.fd_users.drain(drain_s)
            with self._store.transaction() as db:
                db.execute("DELETE FROM workspaces WHERE id = ?", (ws.id,))
                self._journal.append_in(
                    db, "workspace.released", {"root_id": ws.root_id}, workspace=ws.id, actor=actor
                )
        finally:
            ws.fd_users.close(ws.root_fd)

    def close(self) -> None:
        """At shutdown: every root fd is closed now, or by the last operation using it."""
        with self._lock:
            spaces = list(self._by_id.values())
            self._by_id.clear()
        for ws in spaces:
            ws.fd_users.close(ws.root_fd)

    # -- approvals ---------------------------------------------------------------------------

    def grant_approval(
        self, ws: Workspace, plan_digest: str, ttl_s: float, actor: str
    ) -> tuple[str, float]:
        expires = round(time.time() + ttl_s, 6)
        with self._store.transaction() as db:
            approval_id = self._approvals.grant_in(db, ws.id, plan_digest, expires)
            self._journal.append_in(
                db,
                "approval.granted",
                {"approval_id": approval_id, "plan_digest": plan_digest, "expires": expires},
                workspace=ws.id,
                actor=actor,
            )
        return approval_id, expires

    # -- start-up hygiene --------------------------------------------------------------------

    def clean_stale_temp_files(self) -> int:
        """Remove the temp files earlier runs recorded and left behind. Returns the count.

        Exactly the files substrate recorded before creating them (`writes.temp_files`)
        in an earlier run (epoch): never a write in flight in this one, and never a file
        substrate did not make, whatever its name or age. Each is unlinked only if it is
        still a regular file in its directory, reached beneath the root fd without
        following a symlink. Costs one database read and one open per record.
        """
        records = TempFiles(self._store, self._journal.epoch)
        removed = 0
        for workspace, dirs, name in records.stale():
            ws = self._by_id.get(workspace)
            outcome: bool | None = False
            if ws is not None:
                try:
                    with ws.use():
                        outcome = remove_recorded(ws.root_fd, dirs, name)
                except UnknownWorkspace:
                    outcome = False  # released meanwhile: nothing of it can be reached
            if outcome is None:
                continue  # undecided (an I/O error): kept for the next start
            removed += outcome
            records.forget(workspace, dirs, name)
        if removed:
            self._journal.append("workspace.temp_cleaned", {"files": removed})
        return removed
