"""One search's files shared by two processes: the split walk and the merge of its halves.

Both processes walk the same tree with `search._Scan`'s code (the same skips: `.git`,
temp files, symlinks never followed, `read_deny`, `glob`, `exclude`, `gitignore`) and
number the files it would read in walk order. The parent reads and matches every file
before the hand-off (`HAND_OFF_FILES` files or `HAND_OFF_BYTES` bytes scanned: a small
search never pays the second process) and from there the even ones; the worker the odd
ones (`search_worker`). `merge` puts the halves back in walk order and counts
`files_scanned`/`bytes_scanned` up to the file where `max_matches` was reached, as the
serial walk would; it answers None when the two walks disagree (the tree changed
between them), and the caller then searches serially.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from substrate.schema.fs import SearchMatch, SearchParams, SearchResult
from substrate.workspace.ignore import Pruner
from substrate.workspace.policy import GlobSet
from substrate.workspace.search import Plan, _Scan

#: The parent hands the rest of the walk's files off once this many were met...
HAND_OFF_FILES = 64
#: ... or once it has scanned this many bytes, whichever comes first.
HAND_OFF_BYTES = 2 << 20
#: A request's bound (its pattern, globs and `read_deny` globs); a larger one is searched
#: serially.
MAX_REQUEST_BYTES = 1 << 20
#: What a reply may hold beyond its matches: the per-file arrays and the paths of the
#: worker's files (~1 M files of 40-byte paths). Past it, the search is serial.
MAX_REPLY_FILES_BYTES = 64 << 20
_NEVER = 1 << 62


class Search(msgspec.Struct, frozen=True):
    """`SearchParams` without its workspace and its bounds' checks (the parent's
    params were checked at the edge; the worker takes them as they are)."""

    pattern: str
    path: str
    glob: str | None
    fixed: bool
    ignore_case: bool
    max_matches: int
    max_line_bytes: int
    exclude: list[str]
    gitignore: bool

    @classmethod
    def of(cls, p: SearchParams) -> Search:
        return cls(
            p.pattern,
            p.path,
            p.glob,
            p.fixed,
            p.ignore_case,
            p.max_matches,
            p.max_line_bytes,
            list(p.exclude),
            p.gitignore,
        )

    def params(self) -> SearchParams:
        return SearchParams(
            workspace="",
            pattern=self.pattern,
            path=self.path,
            glob=self.glob,
            fixed=self.fixed,
            ignore_case=self.ignore_case,
            max_matches=self.max_matches,
            max_line_bytes=self.max_line_bytes,
            exclude=self.exclude,
            gitignore=self.gitignore,
        )


class Request(msgspec.Struct, frozen=True):
    """What the worker needs besides the two fds sent with it (the root and the start)."""

    search: Search
    #: The workspace policy's `read_deny` globs (`GlobSet.patterns`).
    read_deny: list[str]
    #: The workspace's root id, for `where` in messages (`Workspace.provenance`).
    root_id: str
    #: The index of the first file shared: the worker searches `hand_off + 1`, `+ 3`, ...
    hand_off: int


class Reply(msgspec.Struct, frozen=True):
    """The worker's half. `error`: the exception's class name (then nothing else)."""

    error: str | None = None
    #: Files the walk met (the next index), and whether `max_matches` stopped it.
    count: int = 0
    truncated: bool = False
    #: Per scanned file (a text file read), in walk order: its index, its size, and the
    #: number of `matches` up to and with it.
    idx: list[int] = []
    sizes: list[int] = []
    ends: list[int] = []
    matches: list[SearchMatch] = []
    #: The path at each index the worker searched (scanned or not), surrogate-escaped.
    rels: list[bytes] = []


def max_reply_bytes(p: SearchParams) -> int:
    """The bound of a reply to a search of `p`: its matches (a line's text decoded with
    U+FFFD for bad bytes is up to 3 times `max_line_bytes`; a path up to twice 4 KiB with its
    `path_b64`) plus `MAX_REPLY_FILES_BYTES`."""
    return p.max_matches * (3 * p.max_line_bytes + 2 * 4096 + 64) + MAX_REPLY_FILES_BYTES


class SplitScan(_Scan):
    """`_Scan` reading only its side's files (0: the parent, 1: the worker) and keeping,
    per scanned file, what `merge` needs. The parent calls `begin(index)` once past
    the hand-off bound; True: the worker has the rest's odd files from `index` on."""

    def __init__(
        self,
        plan: Plan,
        read_deny: GlobSet,
        prune: Pruner | None,
        *,
        side: int,
        hand_off: int = _NEVER,
        begin: Callable[[int], bool] | None = None,
    ) -> None:
        super().__init__(
            plan.matching,
            plan.prefilter,
            plan.p,
            plan.globs,
            read_deny,
            prune,
        )
        self.side = side
        self.hand_off = hand_off
        self.begin = begin
        self.index = 0
        #: The parent: every index's path; the worker: its own indices' paths.
        self.rels: list[str] = []
        self.idx: list[int] = []
        self.sizes: list[int] = []
        self.ends: list[int] = []

    def _file(self, dir_fd: int, name: str, rel: str) -> None:
        i = self.index
        self.index = i + 1
        h = self.hand_off
        if self.side:
            if i < h or not (i - h) & 1:
                return
            self.rels.append(rel)
        else:
            self.rels.append(rel)
            if i >= h:
                if (i - h) & 1:
                    return
            elif self.begin is not None and (i >= HAND_OFF_FILES or self.scanned >= HAND_OFF_BYTES):
                begin, self.begin = self.begin, None
                if begin(i):
                    self.hand_off = i
        super()._file(dir_fd, name, rel)

    def _match(self, data: bytes, rel: str) -> None:
        self.idx.append(self.index - 1)
        self.sizes.append(len(data))
        try:
            super()._match(data, rel)
        finally:
            self.ends.append(len(self.matches))

    def reply(self) -> Reply:
        """The worker's half, as `merge` takes it."""
        return Reply(
            count=self.index,
            truncated=self.truncated,
            idx=self.idx,
            sizes=self.sizes,
            ends=self.ends,
            matches=self.matches,
            rels=[r.encode("utf-8", "surrogateescape") for r in self.rels],
        )


def merge(mine: SplitScan, theirs: Reply, limit: int) -> SearchResult | None:
    """The serial walk's result from the parent's half `mine` and the worker's
    `theirs`, or None when their walks disagree at an index that counts."""
    out: list[SearchMatch] = []
    files = scanned = 0
    truncated = False
    stop = _NEVER
    pi, ps, pe, pm = mine.idx, mine.sizes, mine.ends, mine.matches
    wi, ws, we, wm = theirs.idx, theirs.sizes, theirs.ends, theirs.matches
    if not (len(wi) == len(ws) == len(we)) or (we and we[-1] != len(wm)):
        return None
    h = mine.hand_off
    a = b = a_at = b_at = 0
    na, nb = len(pi), len(wi)
    last = h
    while a < na or b < nb:
        ia = pi[a] if a < na else _NEVER
        ib = wi[b] if b < nb else _NEVER
        if ia < ib:
            at, end = ia, pe[a]
            files += 1
            scanned += ps[a]
            out += pm[a_at:end]
            a_at = end
            a += 1
        else:
            at, end = ib, we[b]
            if at <= last or not (at - h) & 1 or end < b_at:
                return None  # not the worker's index, or out of order
            last = at
            files += 1
            scanned += ws[b]
            out += wm[b_at:end]
            b_at = end
            b += 1
        if len(out) >= limit:
            del out[limit:]
            truncated = True
            stop = at
            break
    shared = mine.rels[h + 1 :: 2]
    if truncated:
        shared = shared[: max(0, (stop - h + 1) // 2)]
        if len(theirs.rels) < len(shared):
            return None
    elif (
        mine.truncated
        or theirs.truncated
        or theirs.count != mine.index
        or len(theirs.rels) != len(shared)
    ):
        return None
    for ours, seen in zip(shared, theirs.rels, strict=False):
        if ours.encode("utf-8", "surrogateescape") != seen:
            return None
    return SearchResult(
        matches=out, truncated=truncated, files_scanned=files, bytes_scanned=scanned
    )
