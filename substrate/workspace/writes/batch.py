"""Guarded writes in batches: the frame a change set's files and directories share.

The files and directories of a change set (docs/working-layer.md), each with the
guarantees of one guarded write (docs/protocol.md §4), at a fraction of the cost. This
module is the frame both kinds share: a change's `Landing`, the parent directories a
chunk holds (`HeldDirs`), the chunk loop, the background close of replaced files
(`RELEASER`), and the transaction that journals what landed (`BatchCore`). The one-step
durability of temp files (`make_durable`) and the no-replace rename of a new file
(`rename_new`) are `substrate.fs.fsops`'s.

Theory of operation. `apply_files` (`batch_files`) takes file changes - a path, the
base it is bound to, the digest of its new bytes (None: a delete), a mode - and a
`Source` that reads a change's new bytes. In chunks of at most `CHUNK` changes it:

1. plans each, touching nothing: the target is read once through its parent directory
   fd (held for the chunk); it is `unchanged` when it already holds the result; else
   the reserved temp names and the policy (`path_denied`), what host tools would find
   (`discoverable.check_write`, the pieces of the whole batch counted together), the
   base (`stale_base`, `already_exists`), the plan digest and `require_approval`
   (`approval_required` with the digest, unless a live approval of it exists) decide,
   exactly as `fs.write` does;
2. records, in ONE transaction, a temp file per new file (`temp_files`) and an intent
   per change (`intents`: the journal entry it will get);
3. writes each temp file beside its target - the new bytes read from the source and
   checked against the digest (else `source_changed`; a big file is copied from the
   source's fd and hashed from the temp file as it goes, `streamed`), with the old owner (the
   workspace owner's for a new file) and the plan's mode - fsynced each when they are
   few (under `SYNCFS_FROM`), else without an fsync each, then made durable at once: one
   `syncfs(2)` per file system they are on;
4. under the workspace's commit lock, change by change: the target is read and its base
   checked again right before the rename (a host edit since is `stale_base`, never
   overwritten; the temp file goes), the approval found again, the pre-image kept when
   a checkpoint is live, then the rename (the unlink for a delete; a new file with
   `RENAME_NOREPLACE`, so one the host made after the check is never replaced) - the
   file replaced was read through an fd kept open across the rename, which `RELEASER`
   closes in the background: freeing its inode is never waited for - then the parent
   directories are made durable (an fsync each, or from `SYNCFS_FROM` of them one
   `syncfs` per file system) and ONE transaction journals every change
   (`changes.apply`, one entry each, the chain intact), consumes the approvals,
   records the pre-images, forgets the temp files and drops the intents.

`apply_dirs` (`batch_dirs`) does the same for directory steps (`mkdir` with the
workspace owner's ownership, empty-only `rmdir`, `chmod`; `changes.apply_dir`): plan,
intents, then under the lock each step, the parents made durable, one transaction.

A crash before step 4 lands nothing and leaves recorded temp files (removed at the next
start); one during or after the renames leaves changes landed without their entries:
their intents are journaled at the next start, `recovered: true` (`intents`).

Each change gets its own `Landing`; one failing never stops the others. Blocking I/O
and SQLite throughout: call from a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from substrate.errors import ApprovalRequired, Refusal
from substrate.fs import fsops, paths
from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.journal import Draft, Journal
from substrate.workspace.adopted import Workspace
from substrate.workspace.checkpoints import Checkpoints, Preimage
from substrate.workspace.writes.base import Current
from substrate.workspace.writes.intents import Intent, Intents
from substrate.workspace.writes.temp_files import TempFiles

#: From this many temp files (or parent directories) on, a batch makes them durable with
#: one `syncfs(2)` per file system instead of an fsync each: on a quiet disk syncfs costs
#: about one fsync and a half, but it flushes every dirty page of the file system, so
#: beside a writer that keeps data dirty (a build, an image pull) it took 190 ms where an
#: fsync took 1-2 ms (docs/performance.md). A few files never pay that.
SYNCFS_FROM = 4
#: File changes per chunk: bounds the temp files in flight, the rows of one transaction
#: and how long the commit lock is held at a time.
CHUNK = 4096
#: Directories a chunk holds open (each until the chunk is done); also the directory
#: steps per chunk, as each may hold one (the parent a `mkdir` before it made).
MAX_DIRS = 256

#: What became of a change: `applied` (landed and journaled; in a dry run, would be),
#: `unchanged` (the checkout already held it), `refused` (the refusal says why:
#: `path_denied`, `approval_required`, `stale_base`, ...), `source_changed` (the new
#: bytes are not the ones digested), `failed` (an OSError: ENOTEMPTY, EEXIST, ...).
Status = Literal["applied", "unchanged", "refused", "source_changed", "failed"]


@dataclass(frozen=True)
class Landing:
    status: Status
    plan_digest: str | None = None
    refusal: Refusal | None = None
    error: OSError | None = None


UNCHANGED = Landing("unchanged")
SOURCE_CHANGED = Landing("source_changed")

#: A temp file recorded for a chunk: its directory beneath the root, its name.
Temp = tuple[tuple[str, ...], str]


class HeldDirs:
    """The parent directories of one chunk, each opened beneath the root once (never
    following a symlink) and held until `close`."""

    def __init__(self, root_fd: int) -> None:
        self._root = root_fd
        self._fds: dict[tuple[str, ...], int] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def get(self, dirs: tuple[str, ...], where: str) -> int:
        """The held fd of `dirs`, opened now if it is not held yet. Refuses as
        `paths.open_dir` does (`not_found`, `symlink_refused`, ...)."""
        fd = self._fds.get(dirs)
        if fd is None:
            fd = self._fds[dirs] = paths.open_dir(self._root, dirs, where)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class Step:
    """One planned change of a chunk."""

    index: int
    parts: tuple[str, ...]
    where: str
    digest: str
    needs_approval: bool
    intent: Intent
    current: Current | None = None  # a file's target as planned (its bytes dropped)
    new_sha256: str | None = None
    temp: str | None = None  # the temp file, while it exists
    approval: str | None = None
    pre: Preimage | None = None

    @property
    def dirs(self) -> tuple[str, ...]:
        return self.parts[:-1]


class Releaser:
    """Closes the fds of files a batch replaced or deleted, in a background thread.

    The last close of an unlinked file frees its inode and blocks, which on a busy
    file-system journal can take milliseconds per file; the batch holds each replaced
    file open across its rename (it read and hashed it through that fd) and hands the
    fd here, so it never waits for the freeing. At most `bound` fds wait; past that a
    release closes at once. A crash frees them anyway (the kernel's orphan cleanup)."""

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread: threading.Thread | None = None

    def release(self, fd: int) -> None:
        with self._lock:
            if self._waiting >= self._bound:
                os.close(fd)
                return
            self._waiting += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="substrate-release", daemon=True
                )
                self._thread.start()
        self._queue.put(fd)

    def _run(self) -> None:
        while True:
            fd = self._queue.get()
            with contextlib.suppress(OSError):
                os.close(fd)
            with self._lock:
                self._waiting -= 1


def _release_bound() -> int:
    # A quarter of the soft fd limit (the daemon raises it to the hard one), 64 to 4096.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(4096, soft // 4))


#: The process's one releaser.
RELEASER = Releaser(_release_bound())

#: Plans change `index` with the chunk's held dirs: a Step to land, or its Landing now.
Planner = Callable[[HeldDirs, int], "Step | Landing"]
#: Lands a chunk's steps; returns the landings of those that are not `applied`.
Lander = Callable[[HeldDirs, list[Step]], dict[int, Landing]]


class BatchCore:
    """The state and steps every batch shares."""

    def __init__(
        self,
        store: Store,
        journal: Journal,
        temps: TempFiles,
        approvals: Approvals,
        preimages: Checkpoints | None,
    ) -> None:
        self._store = store
        self._journal = journal
        self._temps = temps
        self._approvals = approvals
        self._preimages = preimages
        #: The journal entries of batches in flight (crash recovery: `intents`).
        self.intents = Intents(store, journal)

    def _chunks(
        self,
        ws: Workspace,
        count: int,
        plan: Planner,
        land: Lander,
        dry: Callable[[int, Step], Landing] | None,
        chunk: int,
    ) -> list[Landing]:
        """Plan and land changes `0..count` chunk by chunk (at most `chunk` changes and
        `MAX_DIRS` held directories each); with `dry`, nothing lands: `dry` says what
        would. The landings, in order (`applied` unless `land` says otherwise)."""
        out: list[Landing] = [UNCHANGED] * count
        with ws.use():
            at = 0
            while at < count:
                dirs = HeldDirs(ws.root_fd)
                try:
                    steps: list[Step] = []
                    while at < count and len(steps) < chunk and len(dirs) < MAX_DIRS:
                        planned = plan(dirs, at)
                        if isinstance(planned, Landing):
                            out[at] = planned
                        elif dry is not None:
                            out[at] = dry(at, planned)
                        else:
                            out[at] = Landing("applied", plan_digest=planned.digest)
                            steps.append(planned)
                        at += 1
                    if steps:
                        for index, landing in land(dirs, steps).items():
                            out[index] = landing
                finally:
                    dirs.close()
        return out

    def _find_approval(self, ws: Workspace, step: Step) -> None:
        """Under the commit lock: the live approval a step needs, or `approval_required`."""
        if step.needs_approval:
            step.approval = self._approvals.find(ws.id, step.digest, time.time())
            if step.approval is None:
                raise ApprovalRequired(
                    f"{step.where}: needs an operator approval of this plan",
                    plan_digest=step.digest,
                )

    def _drop_temp(self, dirs: HeldDirs, step: Step) -> None:
        if step.temp is not None:
            with contextlib.suppress(Refusal):
                fsops.unlink_quietly(dirs.get(step.dirs, step.where), step.temp)
            step.temp = None

    def _journal_landed(
        self,
        ws: Workspace,
        dirs: HeldDirs,
        landed: list[Step],
        recorded: list[Temp],
        batch: str,
    ) -> bool:
        """Under the commit lock: the landed steps made durable and journaled in one
        transaction with their approvals and pre-images; every temp record and intent
        of the chunk goes with it. True when pre-images were recorded (the caller
        `settle`s the quota once out of the lock).

        Durable: each parent directory fsynced, or from `SYNCFS_FROM` of them one
        `syncfs` per file system (one journal commit instead of one per directory)."""
        parents = [dirs.get(s.dirs, s.where) for s in {s.dirs: s for s in landed}.values()]
        if len(parents) < SYNCFS_FROM:
            for parent in parents:
                os.fsync(parent)
        else:
            fsops.make_durable(parents)
        drafts = []
        for step in landed:
            data = step.intent.data
            if step.approval is not None:
                data = {**data, "approval_id": step.approval}
            drafts.append(Draft(step.intent.kind, data, ws.id, step.intent.actor))
        with self._store.transaction() as db:
            now = time.time()
            entries = self._journal.append_many_in(db, drafts)
            for step, entry in zip(landed, entries, strict=True):
                if step.approval is not None:
                    self._approvals.consume_in(db, step.approval, now)
                if step.pre is not None and self._preimages is not None:
                    self._preimages.record_in(db, step.pre, entry.seq, step.new_sha256)
            self._temps.forget_many_in(db, ws.id, recorded)
            self.intents.drop_in(db, batch)
        return any(s.pre is not None for s in landed)

    def _abandon(
        self, ws: Workspace, dirs: HeldDirs, steps: list[Step], recorded: list[Temp], batch: str
    ) -> None:
        """A chunk failed before anything landed: its temp files and rows go (what
        cannot go now is left for the next start's cleanup)."""
        for step in steps:
            self._drop_temp(dirs, step)
        with contextlib.suppress(Exception), self._store.transaction() as db:
            self._temps.forget_many_in(db, ws.id, recorded)
            self.intents.drop_in(db, batch)
