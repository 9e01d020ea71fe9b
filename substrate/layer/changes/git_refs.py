"""What leaves a git layer when a generation concludes: new objects and ref moves
(docs/working-layer.md, "The git layer").

Theory of operation. The sandbox's `.git` is an overlay of the checkout's `.git` under
the checkout's git layer (`substrate.layer.mounts.git_layer`). At each conclusion:

1. the refs under `refs/` are read three times: in the sandbox's view (the merged
   `.git`, `merged`), in the checkout (`host`) and as the sandbox's view showed them at
   the last conclusion (the layer's `baseline`). A ref is the sandbox's change when its
   view differs from both the baseline (it moved since) and the host (a ref the host
   moved and the sandbox never touched shows the host's value in the sandbox's view:
   not a change; both at the same value: nothing to do), and the sandbox wrote
   evidence of it since the last conclusion (`git_evidence`: else its view is only
   stale). Each is one `ref` entry `{path: <ref name>, old_oid: baseline's, new_oid:
   the view's}` (None: absent);
2. unless the mode is "discard", every object the sandbox wrote since the last import
   (the layer's upper `objects/`: files made since, staged as hard links) is verified —
   its bytes hash to its id and it parses — and copied into the checkout's object
   store, never overwriting (`substrate.git.objects`); nothing else of the layer (HEAD,
   index, config, hooks, info/, logs) is ever copied;
3. in mode "apply", each entry whose ref matches the profile's `git_refs_allow` is
   applied by compare-and-swap on `old_oid` (`substrate.git.refs.update_ref`: a ref
   the host moved meanwhile is a conflict, `host_changed`); any other is blocked
   `ref_denied` (rule `git_refs_allow`) and waits in the set for `changes.apply`, where
   only the operator may apply it; one whose `.git/<ref name>` the workspace's
   `require_approval` matches is pending until the operator grants its `plan_digest`
   (`RefGate`). In "review" every entry is pending;
4. the baseline becomes the view's refs: an entry is reported once, by the conclusion
   after the command that moved it; a later move is a new entry from there.

The entries are kept with their change set (`RefSets`, the `changeset_refs` table) for
`changes.get` (with each entry's new commits' subjects, at most `MAX_SUBJECTS`) and
`changes.apply`. Journal: `changes.ref {changeset, ref, old_oid, new_oid, outcome}` per
entry applied, blocked or conflicting (names and ids, never bytes).

Blocking I/O and SQLite: call from worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec

from substrate.errors import Refusal
from substrate.fs import fsops
from substrate.git.objects import import_objects
from substrate.git.refs import commit_subjects, read_refs, update_ref, valid_ref_name
from substrate.layer import git_baseline
from substrate.layer.changes import git_evidence
from substrate.schema.changes import Change
from substrate.schema.proc import ChangeEntry, ChangesMode
from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.policy import GIT_NAME, GlobSet
from substrate.workspace.registry import Workspace

log = logging.getLogger("substrate.layer.changes.git_refs")

#: Subjects of a ref entry's new commits kept (newest first).
MAX_SUBJECTS = 20
#: At most this many ref entries per conclusion (the rest wait in the layer: the
#: baseline keeps their old value, so the next conclusion reports them).
MAX_REF_ENTRIES = 1000
#: Bounds of one conclusion's object import (past either the rest is refused by name).
MAX_IMPORT_BYTES = 4 << 30
MAX_IMPORT_OBJECTS = 1_000_000
#: Where a conclusion stages the objects to import, in the git layer's directory.
STAGING = "import"
_FANOUT = re.compile(r"[0-9a-f]{2}")
#: The reflog identity of a ref substrate moves in the checkout.
COMMITTER = b"substrate <substrate@localhost>"
#: What became of a ref entry.
RefState = Literal["pending", "applied", "unchanged", "blocked", "conflict"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS changeset_refs (
    changeset TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    refs BLOB NOT NULL
);
"""


class RefChange(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One ref the sandbox created (`old_oid` None), moved or deleted (`new_oid` None)."""

    name: str
    old_oid: str | None = None
    new_oid: str | None = None
    subjects: tuple[str, ...] = ()
    allowed: bool = False  # matches `git_refs_allow` (else only the operator applies it)
    state: RefState = "pending"
    reason: str | None = None  # ref_denied, host_changed, missing_object, ...
    current: str | None = None  # the checkout's value when it conflicted
    plan_digest: str | None = None  # pending under `require_approval`: what to grant


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[RefChange, ...])
_DIR_FLAGS = fsops.DIR_FLAGS


class RefSets:
    """The ref entries of kept change sets (one SQLite table beside `changesets`)."""

    def __init__(self, store: Store, journal: Journal) -> None:
        self._store = store
        self._journal = journal
        self.lock = threading.Lock()  # applies of one set's refs, one at a time
        self._approvals = Approvals(store)
        store.ensure_schema(SCHEMA)

    def gate(self, ws: Workspace) -> RefGate:
        """`ws`'s `require_approval` over its refs, with the approvals store."""
        return RefGate(ws.id, ws.policy.needs_approval, self._store, self._approvals)

    def record(self, cs_id: str, workspace: str, refs: Iterable[RefChange]) -> None:
        """Keep (or replace) the ref entries of set `cs_id`."""
        with self._store.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO changeset_refs(changeset, workspace, refs) VALUES (?, ?, ?)",
                (cs_id, workspace, _encoder.encode(tuple(refs))),
            )

    def get(self, cs_id: str) -> tuple[RefChange, ...]:
        """The ref entries of set `cs_id` (none: it has none). One query."""
        rows = self._store.query("SELECT refs FROM changeset_refs WHERE changeset = ?", (cs_id,))
        return _decoder.decode(rows[0]["refs"]) if rows else ()

    def journal(self, cs_id: str, workspace: str, refs: Iterable[RefChange], actor: str) -> None:
        """`changes.ref` per entry that was applied, blocked or conflicted (ids only)."""
        for ref in refs:
            if ref.state == "pending" or ref.state == "unchanged":
                continue
            data: dict[str, object] = {"changeset": cs_id, "ref": ref.name, "outcome": ref.state}
            data |= {"old_oid": ref.old_oid, "new_oid": ref.new_oid}
            if ref.reason is not None:
                data["reason"] = ref.reason
            self._journal.append("changes.ref", data, workspace=workspace, actor=actor)


def compare(
    baseline: dict[str, str], merged: dict[str, str], host: dict[str, str]
) -> list[tuple[str, str | None, str | None]]:
    """(name, old, new) of each ref the sandbox created, moved or deleted under `refs/`
    since `baseline` (pure; see the module doc, step 1), sorted by name."""
    found = []
    for name in sorted(set(baseline) | set(merged)):
        seen = merged.get(name)
        if seen == baseline.get(name) or seen == host.get(name):
            continue
        if name.startswith("refs/") and valid_ref_name(name):
            found.append((name, baseline.get(name), seen))
    return found


def conclude(
    ws: Workspace,
    merged_git: str,
    upper: str,
    mode: ChangesMode,
    allow: GlobSet,
    gate: RefGate | None = None,
    keep: Callable[[tuple[RefChange, ...]], None] | None = None,
    settled: Callable[[git_baseline.Baseline], None] | None = None,
) -> tuple[RefChange, ...]:
    """Steps 1-4 of the module doc for the git layer whose upper dir is `upper`, mounted
    (its merged view, the sandbox's `.git`, at `merged_git`) over `ws`'s `.git`; the
    entries, applied or not by `mode`. `keep` is given them (when there are any) to keep
    with the set (`RefSets.record`) before the baseline is saved past them; `settled`
    the baseline as it stands after, when nothing waits for a later conclusion (for
    `quiet`). Costs a read of the refs three times, a hash per object the sandbox
    wrote, a copy per new one, a CAS per allowed entry."""
    layer_dir = upper.rsplit("/", 1)[0]
    with ws.use():
        host_fd = os.open(GIT_NAME, _DIR_FLAGS, dir_fd=ws.root_fd)
    try:
        merged_fd = os.open(merged_git, _DIR_FLAGS)
        try:
            merged = read_refs(merged_fd, max_refs=git_baseline.MAX_REFS)
            host = read_refs(host_fd, max_refs=git_baseline.MAX_REFS)
            loaded = git_baseline.load(layer_dir)
            baseline = loaded.refs
            evidence = git_evidence.read(upper, loaded.concluded_ns)
            found = [
                (name, old, new)
                for name, old, new in compare(baseline, merged, host)
                if evidence.covers(name, git_evidence.loose_in(host_fd, name))
            ]
            taken, left = found[:MAX_REF_ENTRIES], found[MAX_REF_ENTRIES:]
            refs: list[RefChange] = []
            # "discard": what the generation wrote never lands, objects included.
            imported: int | None = None if mode == "discard" else loaded.imported_ns
            if mode != "discard":
                refs = _entries(merged_fd, taken, allow)
                imported = import_from(layer_dir, upper, host_fd, loaded.imported_ns)
            if mode == "apply":
                refs = list(apply(host_fd, refs, operator=False, gate=gate))
            # An entry past the bound keeps its old value: the next conclusion has it.
            for name, old, _new in left:
                if old is None:
                    merged.pop(name, None)
                else:
                    merged[name] = old
            if refs and keep is not None:
                keep(tuple(refs))
            if unchanged(loaded, merged, found, evidence, imported):
                if settled is not None:
                    settled(loaded)
                return ()
            # After everything the sandbox wrote and this conclusion linked; before what
            # the next command writes.
            now = git_baseline.mark(layer_dir)
            if imported is None:
                imported = now
            # What the bound left keeps its evidence for the next conclusion.
            concluded = loaded.concluded_ns if left else now
            saved = git_baseline.Baseline(refs=merged, imported_ns=imported, concluded_ns=concluded)
            git_baseline.save(
                layer_dir, saved, durable=merged != baseline or imported != loaded.imported_ns
            )
            if settled is not None and not left:
                settled(saved)
            return tuple(refs)
        finally:
            os.close(merged_fd)
    finally:
        os.close(host_fd)


def _entries(
    merged_fd: int, taken: list[tuple[str, str | None, str | None]], allow: GlobSet
) -> list[RefChange]:
    """The entries of the ref moves `taken`, each with its new commits' subjects read
    from the sandbox's view (`merged_fd`); none opens nothing (a `.git` with no
    `objects/` yet has no ref to move either)."""
    if not taken:
        return []
    refs = []
    objects_fd = os.open("objects", _DIR_FLAGS, dir_fd=merged_fd)
    try:
        for name, old, new in taken:
            subjects: tuple[str, ...] = ()
            if new is not None:
                subjects = commit_subjects(objects_fd, new, old, limit=MAX_SUBJECTS)
            refs.append(
                RefChange(
                    name=name,
                    old_oid=old,
                    new_oid=new,
                    subjects=tuple(subjects),
                    allowed=allow.matches(name),
                )
            )
    finally:
        os.close(objects_fd)
    return refs


def unchanged(
    loaded: git_baseline.Baseline,
    merged: dict[str, str],
    found: list[tuple[str, str | None, str | None]],
    evidence: git_evidence.Evidence,
    imported: int | None,
) -> bool:
    """May a conclusion leave the baseline `loaded` as it is (no mark, no write)? When
    no ref moved (`found`), the view's refs are the baseline's, nothing was imported
    (`imported` is the baseline's own: no new object, not mode "discard") and the sandbox
    wrote no evidence since the last conclusion. Then the baseline it would save differs
    from `loaded` only in `concluded_ns`, moved forward over a span in which no evidence
    was written: the evidence a later conclusion reads since either time is the same,
    and so is everything it reports (docs/working-layer.md, "The git layer"). Pure."""
    return (
        not found
        and not evidence.any()
        and imported == loaded.imported_ns
        and merged == loaded.refs
    )


def import_from(layer_dir: str, upper: str, host_fd: int, since_ns: int) -> int | None:
    """Copy the objects the sandbox wrote since `since_ns` (the layer's upper
    `objects/`: loose objects and packs whose file's ctime is at or after it) into the
    checkout's store, verified (`import_objects`); a refused one is logged by name.
    Returns the time to import from next time: None for "now" (`git_baseline.mark`,
    after the links made here), or `since_ns` again when nothing was new or the
    import's bounds left some for the next conclusion. Those files are staged as hard links in
    `<layer>/import/` first, so an object imported once is not read again at every
    later conclusion. Costs a stat per fan-out directory of the layer and per file in
    those changed since, and the import of what is new."""
    try:
        source = os.open(f"{upper}/objects", _DIR_FLAGS)
    except FileNotFoundError:
        return since_ns  # the sandbox wrote no object
    try:
        found = _new_files(source, since_ns)
        if not found:
            return since_ns
        _remove(layer_dir, STAGING)  # a crash's leftover
        os.mkdir(f"{layer_dir}/{STAGING}", 0o700)
        try:
            stage_fd = os.open(f"{layer_dir}/{STAGING}", _DIR_FLAGS)
            try:
                _stage(source, stage_fd, found)
                dest = os.open("objects", _DIR_FLAGS, dir_fd=host_fd)
                try:
                    st = os.fstat(dest)
                    report = import_objects(
                        stage_fd,
                        dest,
                        owner=(st.st_uid, st.st_gid),
                        max_bytes=MAX_IMPORT_BYTES,
                        max_objects=MAX_IMPORT_OBJECTS,
                    )
                finally:
                    os.close(dest)
            finally:
                os.close(stage_fd)
        finally:
            _remove(layer_dir, STAGING)
    finally:
        os.close(source)
    for refusal in report.refused[:16]:
        log.warning("git layer object %s refused: %s", refusal.name, refusal.reason)
    if any(r.reason in ("too_large", "too_many") for r in report.refused):
        return since_ns  # what the bounds left waits for the next conclusion
    return None


def _new_files(source_fd: int, since_ns: int) -> list[tuple[str, list[str]]]:
    """(directory, names) of the regular files of the store `source_fd` (`xx/<38
    hex>`, `pack/<name>`) made at or after `since_ns`; a fan-out directory not changed
    since is not read. Never follows a symlink."""
    with os.scandir(source_fd) as top:
        dirs = [
            e.name
            for e in top
            if (_FANOUT.fullmatch(e.name) or e.name == "pack")
            # A directory not changed since holds nothing made since (the open below
            # checks again that it is one, no symlink followed).
            and e.stat(follow_symlinks=False).st_mtime_ns >= since_ns
        ]
    found = []
    for name in sorted(dirs):
        try:
            sub = os.open(name, _DIR_FLAGS, dir_fd=source_fd)
        except OSError:
            continue  # a symlink or gone: never followed
        try:
            with os.scandir(sub) as listing:
                names = [
                    e.name
                    for e in listing
                    if stat.S_ISREG((st := e.stat(follow_symlinks=False)).st_mode)
                    and st.st_ctime_ns >= since_ns
                ]
        finally:
            os.close(sub)
        if names:
            found.append((name, sorted(names)))
    return found


def _stage(source_fd: int, stage_fd: int, found: list[tuple[str, list[str]]]) -> None:
    """Hard-link each of `found` (`_new_files`) into `stage_fd` in the same place,
    never following a symlink (one that replaced a file since is not linked)."""
    for name, names in found:
        sub = os.open(name, _DIR_FLAGS, dir_fd=source_fd)
        try:
            os.mkdir(name, 0o700, dir_fd=stage_fd)
            for leaf in names:
                with contextlib.suppress(FileNotFoundError):
                    os.link(
                        leaf,
                        f"{name}/{leaf}",
                        src_dir_fd=sub,
                        dst_dir_fd=stage_fd,
                        follow_symlinks=False,
                    )
        finally:
            os.close(sub)


def _remove(parent: str, name: str) -> None:
    fd = os.open(parent, _DIR_FLAGS)
    try:
        fsops.remove_tree(fd, name)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def ref_digest(workspace: str, ref: RefChange) -> str:
    """The plan digest an operator grants (`approval.grant`) for one ref entry: its
    workspace, name and both ids."""
    plan = f"git-ref\0{workspace}\0{ref.name}\0{ref.old_oid or ''}\0{ref.new_oid or ''}"
    return hashlib.sha256(plan.encode()).hexdigest()


@dataclass
class RefGate:
    """The workspace's `require_approval` over refs — a glob matching `.git/<ref name>`,
    the ref's path in the checkout — and the approvals that let such an entry apply."""

    workspace: str
    needs: Callable[[str], bool]
    store: Store
    approvals: Approvals

    def find(self, digest: str) -> str | None:
        return self.approvals.find(self.workspace, digest, time.time())

    def consume(self, approval_id: str) -> None:
        with self.store.transaction() as db:
            self.approvals.consume_in(db, approval_id, time.time())


def apply(
    host_fd: int,
    refs: Iterable[RefChange],
    *,
    operator: bool,
    only: set[str] | None = None,
    gate: RefGate | None = None,
) -> tuple[RefChange, ...]:
    """Apply each entry not applied yet (and named in `only`, when given) to the
    checkout's git dir `host_fd` by compare-and-swap on its `old_oid`. One whose ref
    `gate` says needs approval is `pending` (its `plan_digest` to grant) until a live
    approval of that digest exists (consumed when it applies); any other outside
    `git_refs_allow` is blocked `ref_denied` unless `operator`. Returns every entry
    with its new state. Costs a ref read and a locked write per entry."""
    out = []
    owner = os.fstat(host_fd)
    for ref in refs:
        if ref.state in ("applied", "unchanged") or (only is not None and ref.name not in only):
            out.append(ref)
            continue
        approval = None
        if gate is not None and gate.needs(f"{GIT_NAME}/{ref.name}"):
            digest = ref_digest(gate.workspace, ref)
            approval = gate.find(digest)
            if approval is None:
                out.append(
                    msgspec.structs.replace(
                        ref, state="pending", reason="approval_required", plan_digest=digest
                    )
                )
                continue
        elif not (ref.allowed or operator):
            out.append(msgspec.structs.replace(ref, state="blocked", reason="ref_denied"))
            continue
        try:
            done = update_ref(
                host_fd,
                ref.name,
                ref.old_oid,
                ref.new_oid,
                committer=COMMITTER,
                message=b"substrate: the agent's ref",
                owner=(owner.st_uid, owner.st_gid),
            )
        except Refusal as exc:  # a symlink on the way, an id that is not one: never moved
            out.append(msgspec.structs.replace(ref, state="blocked", reason=exc.name))
            continue
        match done.outcome:
            case "applied" | "unchanged":
                state: RefState = done.outcome
                if approval is not None and gate is not None and state == "applied":
                    gate.consume(approval)
                out.append(
                    msgspec.structs.replace(
                        ref, state=state, reason=None, current=None, plan_digest=None
                    )
                )
            case "host_changed" | "locked":
                out.append(
                    msgspec.structs.replace(
                        ref, state="conflict", reason=done.outcome, current=done.current
                    )
                )
            case reason:
                out.append(msgspec.structs.replace(ref, state="blocked", reason=reason))
    return tuple(out)


def apply_kept(
    ws: Workspace,
    refs: tuple[RefChange, ...],
    *,
    operator: bool,
    only: set[str] | None,
    gate: RefGate | None = None,
) -> tuple[RefChange, ...]:
    """`apply` of a kept set's entries to `ws`'s checkout (`changes.apply`)."""
    with ws.use():
        host_fd = os.open(GIT_NAME, _DIR_FLAGS, dir_fd=ws.root_fd)
    try:
        return apply(host_fd, refs, operator=operator, only=only, gate=gate)
    finally:
        os.close(host_fd)


def entry(ref: RefChange) -> ChangeEntry:
    """The wire entry of a ref outcome (`op: "ref"`, `path`: the ref's name)."""
    return ChangeEntry(
        path=ref.name,
        op="ref",
        old_oid=ref.old_oid,
        new_oid=ref.new_oid,
        reason=ref.reason,
        rule="git_refs_allow" if ref.reason == "ref_denied" else None,
        plan_digest=ref.plan_digest,
        current_sha256=None,
        current_oid=ref.current,
    )


def ref_change(ref: RefChange) -> Change:
    """The kept set's view of a ref entry (`changes.get`)."""
    return Change(
        path=ref.name,
        op="ref",
        old_oid=ref.old_oid,
        new_oid=ref.new_oid,
        subjects=ref.subjects,
    )


def ref_lists(refs: Iterable[RefChange]) -> dict[str, list[ChangeEntry]]:
    """The entries by list: applied, unchanged, blocked, pending, conflicts."""
    lists: dict[str, list[ChangeEntry]] = {
        "applied": [],
        "unchanged": [],
        "blocked": [],
        "pending": [],
        "conflicts": [],
    }
    names = {"conflict": "conflicts"}
    for ref in refs:
        lists[names.get(ref.state, ref.state)].append(entry(ref))
    return lists
