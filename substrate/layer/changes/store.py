"""Change sets kept by id (`changeset`: `cs_` + 16 hex) for `changes.get/apply/discard`
(docs/working-layer.md).

Theory of operation. When a command on a `workspace = "layer"` sandbox ends, its
generation's upper dir (under `<state>/layers/`, unmounted by then) is scanned into a
`ChangeSet`. In mode "apply" it is applied at once and recorded here as `applied`; in
mode "review" nothing lands and it is recorded as `pending`; mode "discard" records
nothing and removes the upper dir (`remove_layer`). A row remembers the workspace, the
generation, the upper and work dir paths and the scanned set (msgpack), so a later
`changes.apply` reads the command's bytes from the very upper dir, checked against the
digests scanned, and applies them through the guarded path (bases re-checked: a file
changed since is a conflict, never overwritten). Applying a set again applies nothing
twice (what landed is `unchanged`). `changes.discard` removes the upper dir (iteratively,
never following a symlink) and marks the row `discarded`.

Conflicts: the command's version of each file that conflicted (at the command's end,
`host_changed`, or at any later apply) is copied into the artifact store
(`layer.versions`, through the `FileKeeper` given) and listed in the row's `versions`;
the host's edits' are recorded with the set (`unkept`) before anything is applied, so a
crash never lets the layer go without them.

Cleanup: a set is *settled* once applied whole with nothing `pending`, every
conflict's version kept (`versions.settled`) and nothing blocked by a scan bound
(`scan.BOUND_REASONS`: those files are only in the layer); then its upper and work dirs
are removed (`layer: "removed"`) and a later apply has nothing left to do. A set kept
for review, one with pending (require_approval) changes, with a version only its layer
holds or with a part past a scan bound keeps its layer until it settles or
`changes.discard`. `count_kept` counts those per
workspace (the execution layer refuses new commands past a cap). Rows whose layer is
gone (settled or discarded) are pruned to `MAX_SETTLED` per workspace, oldest first.

Release: rows and layers outlive their workspace; `reattach` hands them to the
workspace that adopts the same checkout (its identity, `Workspace.checkout`) again.

`apply` and `discard` of kept sets take one lock, so a discard never removes a layer an
apply is reading.

Blocking I/O and SQLite throughout: call from worker threads.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from substrate.errors import ChangesetUnknown
from substrate.fs import fsops
from substrate.layer.changes import blocked
from substrate.layer.changes import versions as kept_versions
from substrate.layer.changes.apply import ApplyResult, Outcomes, apply
from substrate.layer.changes.changeset import ChangeSet
from substrate.layer.changes.git_refs import RefSets
from substrate.layer.changes.reclaim import RECLAIMER
from substrate.layer.changes.scan import BOUND_REASONS
from substrate.layer.changes.versions import FileKeeper, Versions
from substrate.schema.changes import ChangesetState, LayerState
from substrate.store.db import Store
from substrate.store.journal import Draft, Journal
from substrate.workspace.registry import Workspace
from substrate.workspace.writes import Writer

SCHEMA = """
CREATE TABLE IF NOT EXISTS changesets (
    id TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    generation INTEGER NOT NULL,
    upper TEXT NOT NULL,
    work TEXT NOT NULL,
    changeset BLOB NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS changesets_workspace ON changesets(workspace, state, updated);
"""
#: Columns a database made by an older release lacks: the checkout's identity (to
#: reattach after a release), the kept versions (msgpack `Versions`), the layer's state.
ADDED_COLUMNS = {"checkout": "TEXT", "versions": "BLOB", "layer": "TEXT NOT NULL DEFAULT 'kept'"}

#: `applying`: being applied by a command's conclusion, or by a whole `changes.apply`;
#: a row left so by a crash is finished, whole, at the next start (`finish_applying`).
State = ChangesetState
#: Settled or discarded change sets (their layer gone) remembered per workspace, to
#: answer `changes.get` and `discarded: true`.
MAX_SETTLED = 256
#: At most this many `paths` in one `changes.apply`.
MAX_PATHS = 10_000

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LISTS = ("applied", "unchanged", "blocked", "pending", "conflicts")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ChangeSet)
_versions_decoder = msgspec.msgpack.Decoder(Versions)


_COUNT_KEPT = (
    "SELECT COUNT(*) FROM changesets WHERE workspace = ? AND layer = 'kept'"
    " AND state != 'discarded'"
)


@dataclass(frozen=True)
class Kept:
    """One recorded change set."""

    id: str
    workspace: str
    generation: int
    upper: str
    work: str
    changeset: ChangeSet
    state: State
    created: float
    updated: float
    layer: LayerState = "kept"
    versions: Versions = dataclasses.field(default_factory=Versions)
    checkout: str | None = None


def remove_layer(upper: str, work: str) -> None:
    """Remove a generation's upper and work dirs (absent ones are fine). Never follows a
    symlink (`fsops.remove_tree`). Call only for an unmounted generation."""
    for path in (upper, work):
        parent, name = os.path.split(path)
        try:
            parent_fd = os.open(parent, _DIR_FLAGS)
        except FileNotFoundError:
            continue
        try:
            fsops.remove_tree(parent_fd, name)
        except FileNotFoundError:
            pass
        finally:
            os.close(parent_fd)


class Changesets:
    """The kept change sets of every workspace (one SQLite table)."""

    def __init__(self, store: Store, journal: Journal, keeper: FileKeeper | None = None) -> None:
        self._store = store
        self._journal = journal
        self._keeper = keeper  # where conflicts' versions go; None: they stay in the layer
        self._lock = threading.Lock()  # apply and discard of kept sets, one at a time
        store.ensure_schema(SCHEMA)
        store.ensure_columns("changesets", ADDED_COLUMNS)
        #: The sets' git ref entries (docs/working-layer.md, "The git layer").
        self.refs = RefSets(store, journal)

    def record(
        self,
        ws: Workspace,
        generation: int,
        upper: str,
        work: str,
        changeset: ChangeSet,
        state: State,
        held: Iterable[str] = (),
        actor: str = "daemon",
    ) -> str:
        """Keep `changeset` (scanned from `upper`) as `state`; return its new id. `held`:
        files whose command's version must be kept before the layer may go (the host
        changed them meanwhile), recorded as not kept yet (`keep_versions` copies them).
        A `pending` one is journaled `changes.kept` (counts only) and a `changes.blocked`
        per path of its `blocked` (`blocked.drafts`, as `actor`), in the transaction
        that records it. A denied path's diff preview is not recorded
        (`blocked.without_denied_previews`)."""
        cs_id = "cs_" + secrets.token_hex(8)
        now = time.time()
        versions = kept_versions.placeholders(held)
        changeset = blocked.without_denied_previews(changeset, ws.policy)
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO changesets(id, workspace, generation, upper, work, changeset,"
                " state, created, updated, checkout, versions)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    cs_id,
                    ws.id,
                    generation,
                    upper,
                    work,
                    _encoder.encode(changeset),
                    state,
                    now,
                    now,
                    ws.checkout,
                    _encoder.encode(versions) if versions.items else None,
                ),
            )
            if state == "pending":
                summary = {
                    "changeset": cs_id,
                    "generation": generation,
                    "changes": len(changeset.changes),
                    "blocked": len(changeset.blocked),
                }
                named = blocked.drafts(
                    ws.root_id, ws.id, actor, cs_id, generation, ApplyResult(), changeset.blocked
                )
                self._journal.append_many_in(db, [Draft("changes.kept", summary, ws.id), *named])
        return cs_id

    def get(self, cs_id: str) -> Kept:
        """The change set `cs_id`. Refuses `changeset_unknown` (`discarded: true` when it
        was discarded). Costs one query and the set's decoding."""
        rows = self._store.query("SELECT * FROM changesets WHERE id = ?", (cs_id,))
        if not rows:
            raise ChangesetUnknown(f"no change set {cs_id!r}")
        row = rows[0]
        return Kept(
            id=row["id"],
            workspace=row["workspace"],
            generation=row["generation"],
            upper=row["upper"],
            work=row["work"],
            changeset=_decoder.decode(row["changeset"]),
            state=row["state"],
            created=row["created"],
            updated=row["updated"],
            layer=row["layer"],
            versions=_versions_decoder.decode(row["versions"]) if row["versions"] else Versions(),
            checkout=row["checkout"],
        )

    def apply(
        self,
        writer: Writer,
        ws: Workspace,
        cs_id: str,
        only: list[str] | None,
        dry_run: bool,
        actor: str,
    ) -> tuple[Kept, ApplyResult, list[str]]:
        """Apply the kept set `cs_id` to `ws` (its workspace), all of it or the changes at
        or beneath the paths `only` names, through the guarded path (`layer.apply`);
        return the set, the outcomes and the paths of `only` that matched no change. A
        whole, real apply marks it `applied`, and removes its layer when that settles it
        (`_settle`); the versions of conflicts found (any real apply) are kept. A set
        whose layer was removed has nothing left: empty outcomes. Refuses
        `changeset_unknown` (unknown, of another workspace, or discarded). Costs what
        `layer.apply` costs for the changes, plus a copy per conflict's version."""
        with self._lock:
            kept = self._live(ws, cs_id)
            changeset = kept.changeset
            unmatched: list[str] = []
            if only is not None:
                wanted = set(only)
                matched: set[str] = set()

                def named(path: str) -> bool:
                    for prefix in _prefixes(path):
                        if prefix in wanted:
                            matched.add(prefix)
                            return True
                    return False

                changeset = msgspec.structs.replace(
                    changeset, changes=tuple(c for c in changeset.changes if named(c.path))
                )
                unmatched = sorted(wanted - matched)
            if kept.layer == "removed":
                return kept, ApplyResult(), unmatched
            try:
                upper_fd = os.open(kept.upper, _DIR_FLAGS)
            except FileNotFoundError:  # gone already (a crash after `_settle` removed it)
                return self._mark(kept, kept.state, "removed"), ApplyResult(), unmatched
            whole = only is None and not dry_run
            first = whole and kept.state != "applied"
            if first:  # a crash from here on: the next start applies it whole
                kept = self._mark(kept, "applying")
            try:
                result = apply(writer, ws, upper_fd, changeset, actor, dry_run=dry_run)
                if not dry_run:
                    kept = self._keep_versions(kept, upper_fd, result.conflicts)
            finally:
                os.close(upper_fd)
            if first:
                kept = self.finish(
                    kept.id, ws, kept.generation, result, "changes.applied", actor=actor
                )
                return kept, result, unmatched
            if not dry_run:  # what still did not land is named again (`blocked.drafts`)
                scanned = kept.changeset.blocked if whole else ()
                left = blocked.drafts(
                    ws.root_id, ws.id, actor, kept.id, kept.generation, result, scanned
                )
                self.append_named(left)
            if whole:  # applied before; pending changes may have been approved since
                kept = self._settle(kept, result)
            return kept, result, unmatched

    def finish(
        self,
        cs_id: str,
        ws: Workspace,
        generation: int,
        result: ApplyResult,
        kind: str,
        extra: dict[str, str] | None = None,
        actor: str = "daemon",
    ) -> Kept:
        """Mark the set `applied` in the same transaction as its journal summary `kind`
        (`changes.applied`, or `changes.recovered` at start: counts only) and the
        `changes.blocked` entries naming each path of it that did not land (`result`'s
        and the set's own `blocked`: `blocked.drafts`, as `actor`). Then remove its layer
        if that settles it (`_settle`). Call after its conflicts' versions were kept.
        Costs one transaction (and the removal)."""
        kept = self.get(cs_id)
        now = time.time()
        summary = {
            "changeset": cs_id,
            "generation": generation,
            **(extra or {}),
            **{name: len(getattr(result, name)) for name in _LISTS},
        }
        named = blocked.drafts(
            ws.root_id, ws.id, actor, cs_id, generation, result, kept.changeset.blocked
        )
        with self._store.transaction() as db:
            db.execute(
                "UPDATE changesets SET state = 'applied', updated = ? WHERE id = ?", (now, cs_id)
            )
            self._journal.append_many_in(db, [Draft(kind, summary, ws.id), *named])
        return self._settle(dataclasses.replace(kept, state="applied", updated=now), result)

    def append_named(self, drafts: list[Draft]) -> None:
        """Append `changes.blocked` entries (`blocked.drafts`) in one transaction (none:
        nothing). Costs one transaction."""
        if drafts:
            with self._store.transaction() as db:
                self._journal.append_many_in(db, drafts)

    def keep_versions(self, cs_id: str, upper_fd: int, conflicts: Iterable[Outcomes]) -> Kept:
        """Keep the command's version of each of `conflicts` (read from `upper_fd`, the
        set's upper dir) as an artifact, unless the set has it already; record them.
        Costs a copy and a commit per new version, one transaction to record them."""
        return self._keep_versions(self.get(cs_id), upper_fd, conflicts)

    def _keep_versions(self, kept: Kept, upper_fd: int, conflicts: Iterable[Outcomes]) -> Kept:
        wanted = [o.path for o in conflicts if kept_versions.needs_version(o)]
        if self._keeper is None or not (wanted or kept.versions.items):
            return kept
        found = kept_versions.keep(self._keeper, upper_fd, kept.id, wanted, kept.versions)
        if found == kept.versions:
            return kept
        with self._store.transaction() as db:
            db.execute(
                "UPDATE changesets SET versions = ? WHERE id = ?", (_encoder.encode(found), kept.id)
            )
        return dataclasses.replace(kept, versions=found)

    def _settle(self, kept: Kept, result: ApplyResult) -> Kept:
        """After a whole apply with `result`: when nothing is pending, every conflict's
        version is kept elsewhere and no scan bound blocked anything, remove the set's upper and work dirs (first, so a
        crash between leaves a row whose dir is gone, never a dir no row explains) and
        mark its layer `removed`; prune old rows. Otherwise nothing changes."""
        if kept.layer == "removed" or result.pending:
            return kept
        if not kept_versions.settled(result.conflicts, kept.versions):
            return kept
        if any(b.reason in BOUND_REASONS for b in kept.changeset.blocked):
            return kept  # what a scan bound blocked is only in the layer
        RECLAIMER.remove(kept.upper, kept.work)  # gone now, its files removed off this path
        kept = self._mark(kept, kept.state, "removed")
        self._prune(kept.workspace)
        return kept

    def applying(self) -> list[Kept]:
        """The sets a crash left `applying`, oldest first (at start, before any command)."""
        rows = self._store.query(
            "SELECT id FROM changesets WHERE state = 'applying' ORDER BY created"
        )
        return [self.get(row["id"]) for row in rows]

    def finish_applying(self, writer: Writer, ws: Workspace, kept: Kept) -> ApplyResult | None:
        """Apply a set a crash left `applying` whole again (what landed is `unchanged`,
        bases re-checked: a host edit since is a conflict) and mark it `applied`, journaled
        `changes.recovered {outcome: "applied"}`. None when its upper dir is gone (removed
        by hand): nothing can be applied, the set is marked `discarded` and journaled
        `changes.recovered {outcome: "failed", reason: "layer_missing"}`. Costs what
        `layer.apply` costs for the set."""
        with self._lock:
            try:
                upper_fd = os.open(kept.upper, _DIR_FLAGS)
            except FileNotFoundError:
                self._mark(kept, "discarded")
                self._journal.append(
                    "changes.recovered",
                    {
                        "changeset": kept.id,
                        "generation": kept.generation,
                        "outcome": "failed",
                        "reason": "layer_missing",
                    },
                    workspace=ws.id,
                )
                return None
            try:
                result = apply(writer, ws, upper_fd, kept.changeset, "daemon")
                kept = self._keep_versions(kept, upper_fd, result.conflicts)
            finally:
                os.close(upper_fd)
            self.finish(
                kept.id, ws, kept.generation, result, "changes.recovered", {"outcome": "applied"}
            )
            return result

    def uppers(self) -> set[str]:
        """The upper dir of every set recorded: a generation whose command concluded."""
        return {row["upper"] for row in self._store.query("SELECT upper FROM changesets")}

    def count_kept(self, workspace: str) -> int:
        """How many sets of `workspace` keep their layer on disk: kept for review, or
        applied with pending changes or a version only the layer holds. One query."""
        rows = self._store.query(_COUNT_KEPT, (workspace,))
        return int(rows[0][0])

    def count_kept_now(self, workspace: str) -> int | None:
        """`count_kept` without waiting for the database (`Store.query_now`): None when
        another thread holds it (ask `count_kept` from a worker thread then)."""
        rows = self._store.query_now(_COUNT_KEPT, (workspace,))
        return None if rows is None else int(rows[0][0])

    def reattach(self, ws: Workspace) -> int:
        """Hand the sets of an earlier workspace of the same checkout (released, or
        adopted before a restart under another id) to `ws`; return how many, journaled
        `changes.reattached` (a count) when any. One transaction."""
        with self._store.transaction() as db:
            moved = db.execute(
                "UPDATE changesets SET workspace = ? WHERE checkout = ? AND workspace != ?",
                (ws.id, ws.checkout, ws.id),
            ).rowcount
            if moved:
                self._journal.append_in(
                    db, "changes.reattached", {"changesets": moved}, workspace=ws.id
                )
        return moved

    def discard(self, ws: Workspace, cs_id: str, actor: str) -> Kept:
        """Remove what is left of the set's layer (for an applied set: versions of its
        conflicts not kept as artifacts, pending changes) and mark it `discarded`;
        journaled `changes.discarded`. Artifacts already kept stay (artifact collection
        takes them). Discarding it again answers the same. Refuses `changeset_unknown`
        (unknown or of another workspace). Costs an unlink per file of the layer."""
        with self._lock:
            kept = self.get(cs_id)
            if kept.workspace != ws.id:
                raise ChangesetUnknown(f"no change set {cs_id!r} in this workspace")
            if kept.state == "discarded":
                return kept
            remove_layer(kept.upper, kept.work)
            kept = self._mark(kept, "discarded", "removed")
            self._journal.append(
                "changes.discarded",
                {"changeset": cs_id, "generation": kept.generation},
                workspace=ws.id,
                actor=actor,
            )
            self._prune(ws.id)
            return kept

    def _live(self, ws: Workspace, cs_id: str) -> Kept:
        kept = self.get(cs_id)
        if kept.workspace != ws.id:
            raise ChangesetUnknown(f"no change set {cs_id!r} in this workspace")
        if kept.state == "discarded":
            raise ChangesetUnknown(f"change set {cs_id!r} was discarded", discarded=True)
        return kept

    def _mark(self, kept: Kept, state: State, layer: LayerState | None = None) -> Kept:
        now = time.time()
        layer = layer or kept.layer
        with self._store.transaction() as db:
            db.execute(
                "UPDATE changesets SET state = ?, layer = ?, updated = ? WHERE id = ?",
                (state, layer, now, kept.id),
            )
        return dataclasses.replace(kept, state=state, layer=layer, updated=now)

    def _prune(self, workspace: str) -> None:
        with self._store.transaction() as db:
            db.execute(
                "DELETE FROM changesets WHERE id IN (SELECT id FROM changesets"
                " WHERE workspace = ? AND layer = 'removed' AND state != 'applying'"
                " ORDER BY updated DESC LIMIT -1 OFFSET ?)",
                (workspace, MAX_SETTLED),
            )


def _prefixes(path: str) -> list[str]:
    """`a/b/c` → `a/b/c`, `a/b`, `a`: a named directory takes the changes beneath it."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]
