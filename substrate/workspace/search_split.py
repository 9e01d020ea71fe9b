"""One search's files shared by two processes: the split walk, the batches, the merge.

The parent walks the tree alone, with `search._Scan`'s code (every skip: `.git`, temp
files, symlinks never followed, `read_deny`, `glob`, `exclude`, `gitignore`), and
numbers the files it would read in walk order. It reads and matches every file before
the hand-off (`HAND_OFF_FILES` files met or `HAND_OFF_BYTES` bytes scanned: a small
search never pays the second process); from there the worker (`search_worker`) is
kept fed: whenever it has taken every batch sent (`idle()`: it works on the last one,
or waits), the next `BATCH_FILES` files the walk meets go to it in a `Batch` (the held
fd of each file's directory, sent by SCM_RIGHTS, its name, path and index), and the
parent reads and matches the files it meets meanwhile. So each process takes files as
fast as it gets through them, whatever else the machine runs; at the walk's end the
worker holds at most two batches. The worker opens each name beneath its
directory's fd as the parent would (O_NOFOLLOW, fstat, one `pread`, the binary sniff)
and matches it. `merge` puts the halves back in walk order and counts
`files_scanned`/`bytes_scanned` up to the file where `max_matches` was reached, as the
serial walk would. One walk: the two processes cannot disagree about the tree; a file
gone before the worker opens it is skipped, as the serial walk skips a file gone
between its directory's read and its open.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from substrate.schema.fs import SearchMatch, SearchParams, SearchResult
from substrate.workspace.ignore import Pruner
from substrate.workspace.policy import GlobSet
from substrate.workspace.search import Plan, _Scan

#: The parent hands files off once this many were met...
HAND_OFF_FILES = 256
#: ... or once it has scanned this many bytes, whichever comes first.
HAND_OFF_BYTES = 2 << 20
#: Files per batch, and directory fds per batch (SCM_RIGHTS carries at most 253).
BATCH_FILES = 32
BATCH_FDS = 64
#: A request's or a batch's bound (the pattern and globs; 32 paths of up to 4 KiB).
MAX_REQUEST_BYTES = 1 << 20
#: What a reply may hold beyond its matches: the per-file arrays (~1 M files).
MAX_REPLY_FILES_BYTES = 32 << 20
_NEVER = 1 << 62


class Abandoned(Exception):
    """The parent cannot hand a file off (no fd left to copy its directory's): the
    search is run again serially."""


class Search(msgspec.Struct, frozen=True):
    """What the worker needs of `SearchParams` to match (it walks nothing): taken as
    they are (the parent's params were checked at the edge)."""

    pattern: str
    fixed: bool
    ignore_case: bool
    max_matches: int
    max_line_bytes: int

    @classmethod
    def of(cls, p: SearchParams) -> Search:
        return cls(p.pattern, p.fixed, p.ignore_case, p.max_matches, p.max_line_bytes)

    def params(self) -> SearchParams:
        return SearchParams(
            workspace="",
            pattern=self.pattern,
            fixed=self.fixed,
            ignore_case=self.ignore_case,
            max_matches=self.max_matches,
            max_line_bytes=self.max_line_bytes,
        )


class Batch(msgspec.Struct, frozen=True):
    """Files for the worker, each beneath one of the directory fds sent with the batch
    (`dirs[k]`: which fd, in the order sent); `rels`: their workspace-relative paths,
    surrogate-escaped; `idx`: their indices in walk order. The first batch carries the
    search; `last`: the walk is over (or stopped), reply now."""

    dirs: list[int]
    rels: list[bytes]
    idx: list[int]
    search: Search | None = None
    last: bool = False


class Reply(msgspec.Struct, frozen=True):
    """The worker's half. `error`: the exception's class name (then nothing else)."""

    error: str | None = None
    #: `max_matches` stopped the worker's half.
    truncated: bool = False
    #: Per scanned file (a text file read), in walk order: its index, its size, and the
    #: number of `matches` up to and with it.
    idx: list[int] = []
    sizes: list[int] = []
    ends: list[int] = []
    matches: list[SearchMatch] = []


def max_reply_bytes(p: SearchParams) -> int:
    """The bound of a reply to a search of `p`: its matches (a line's text decoded with
    U+FFFD for bad bytes is up to 3 times `max_line_bytes`; a path up to twice 4 KiB
    with its `path_b64`) plus `MAX_REPLY_FILES_BYTES`."""
    return p.max_matches * (3 * p.max_line_bytes + 2 * 4096 + 64) + MAX_REPLY_FILES_BYTES


class SplitScan(_Scan):
    """`_Scan` keeping, per scanned file, what `merge` needs. The parent's (with
    `send`) walks, and past the hand-off gives `send` each batch of the worker's files:
    `send(batch, fds)` raises to abandon the search; `spare()`, asked at the hand-off,
    False: no CPU is free, the search stays serial for now (asked again after each
    `HAND_OFF_FILES` more files: a CPU busy for a moment does not keep a long search
    on one); `idle()`, asked before
    each file the parent would search itself: True when the worker has taken every
    batch sent, so the next batch begins with this file. The worker's `take`s the files
    it is sent."""

    def __init__(
        self,
        plan: Plan,
        read_deny: GlobSet,
        prune: Pruner | None,
        send: Callable[[Batch, list[int]], None] | None = None,
        spare: Callable[[], bool] | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(plan.matching, plan.prefilter, plan.p, plan.globs, read_deny, prune)
        self.p = plan.p
        self.send = send
        self.spare = spare
        self.idle = idle
        #: At the hand-off, `spare()` said no CPU was free (the search stays serial
        #: unless it says otherwise at a later asking, from `_ask_at` files on).
        self.declined = False
        self._ask_at = 0
        self.search = Search.of(plan.p)
        self.hand_off = _NEVER
        self.index = 0
        self.current = 0
        #: The indices sent to the worker, in order.
        self.sent: list[int] = []
        self.idx: list[int] = []
        self.sizes: list[int] = []
        self.ends: list[int] = []
        self._fds: dict[str, int] = {}
        self._dups: list[int] = []
        self._dirs: list[int] = []
        self._rels: list[bytes] = []
        self._idx: list[int] = []

    def _file(self, dir_fd: int, name: str, rel: str) -> None:
        i = self.index
        self.index = i + 1
        h = self.hand_off
        if i >= h:
            if self._idx or self.idle is None or self.idle():
                self._give(dir_fd, rel, i)  # a batch begun is filled; `flush` sends it
                return
        elif (
            self.send is not None
            and i >= self._ask_at
            and (i >= HAND_OFF_FILES or self.scanned >= HAND_OFF_BYTES)
        ):
            if self.spare is None or self.spare():
                self.hand_off = i
            else:  # both CPUs busy: a second process would only take turns with this one
                self.declined = True
                self._ask_at = i + HAND_OFF_FILES
        self.current = i
        super()._file(dir_fd, name, rel)

    def _give(self, dir_fd: int, rel: str, i: int) -> None:
        # By its path: the walk closes a directory's fd when it leaves it, and the next
        # one opened may get its number; the batch sends a copy.
        parent = rel.rpartition("/")[0]
        slot = self._fds.get(parent)
        if slot is None:
            try:
                self._dups.append(os.dup(dir_fd))
            except OSError as exc:
                raise Abandoned(exc.strerror) from None
            slot = self._fds[parent] = len(self._fds)
        self._dirs.append(slot)
        self._rels.append(rel.encode("utf-8", "surrogateescape"))
        self._idx.append(i)
        self.sent.append(i)
        if len(self._idx) >= BATCH_FILES or len(self._fds) >= BATCH_FDS:
            self.flush(last=False)

    def flush(self, *, last: bool) -> None:
        """Send the batch gathered so far (`last`: and tell the worker to reply)."""
        assert self.send is not None
        if not self._idx and not last:
            return
        first = len(self.sent) == len(self._idx)
        batch = Batch(
            dirs=self._dirs,
            rels=self._rels,
            idx=self._idx,
            search=self.search if first else None,
            last=last,
        )
        fds = self._dups
        self._fds, self._dups, self._dirs, self._rels, self._idx = {}, [], [], [], []
        try:
            self.send(batch, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def take(self, dir_fd: int, rel: str, index: int) -> None:
        """The worker: search the file `rel` (named by its last component beneath
        `dir_fd`), of walk index `index`. Raises `_Truncated` at `max_matches`."""
        self.current = index
        super()._file(dir_fd, rel.rpartition("/")[2], rel)

    def _match(self, data: bytes, rel: str) -> None:
        self.idx.append(self.current)
        self.sizes.append(len(data))
        try:
            super()._match(data, rel)
        finally:
            self.ends.append(len(self.matches))

    def reply(self) -> Reply:
        """The worker's half, as `merge` takes it."""
        return Reply(
            truncated=self.truncated,
            idx=self.idx,
            sizes=self.sizes,
            ends=self.ends,
            matches=self.matches,
        )


def merge(mine: SplitScan, theirs: Reply, limit: int) -> SearchResult | None:
    """The serial walk's result from the parent's half `mine` and the worker's
    `theirs`, or None when the worker's half is not of the files it was sent."""
    out: list[SearchMatch] = []
    files = scanned = 0
    truncated = False
    pi, ps, pe, pm = mine.idx, mine.sizes, mine.ends, mine.matches
    wi, ws, we, wm = theirs.idx, theirs.sizes, theirs.ends, theirs.matches
    if not (len(wi) == len(ws) == len(we)) or (we and we[-1] != len(wm)):
        return None
    sent = set(mine.sent)
    a = b = a_at = b_at = 0
    na, nb = len(pi), len(wi)
    last = -1
    while a < na or b < nb:
        ia = pi[a] if a < na else _NEVER
        ib = wi[b] if b < nb else _NEVER
        if ia < ib:
            end = pe[a]
            files += 1
            scanned += ps[a]
            out += pm[a_at:end]
            a_at = end
            a += 1
        else:
            end = we[b]
            if ib <= last or ib not in sent or end < b_at:
                return None  # not a file it was sent, or out of order
            last = ib
            files += 1
            scanned += ws[b]
            out += wm[b_at:end]
            b_at = end
            b += 1
        if len(out) >= limit:
            del out[limit:]
            truncated = True
            break
    if not truncated and (mine.truncated or theirs.truncated):
        return None  # a half stopped at `max_matches` that the whole did not reach
    return SearchResult(
        matches=out, truncated=truncated, files_scanned=files, bytes_scanned=scanned
    )
