"""`fs.search`: a regex (or fixed string) over a workspace's text files, bounded.

Files are reached by a walk of its own (`_Scan`: the order and skips of
`reads.walk_entries`, which `fs.walk` uses, fused with the reads: dir fds held, never a
symlink, `.git` and temp files skipped) and read whole with one `pread` of their fstat
size + 1, at most `SEARCH_MAX_FILE` bytes each. `_Prefilter` derives from the stdlib's
own parse of the pattern a literal every match must contain (grep's "must" string):
files without it are rejected by RE2 looking for that literal (`memchr` on its first
byte: faster than `bytes.find`, and no lowered copy of the file for `ignore_case`), and
where no match can leave its line only the lines holding it are searched. A pattern
with no such literal is screened by RE2 instead (`substrate.matching.re2_translate`): a
file where a pattern matching a superset of the original's finds nothing is skipped,
and the matcher starts at the line of its first hit. RE2 is called directly
(`re2_translate.first_start`: a start offset, no match object). The results are those
of `regex.search` over every file, whatever is skipped; `tests/harness/search_reference.py`
keeps the loop this replaced, and a differential test on random trees holds the two equal.

One thread: RE2's Python binding keeps the GIL while it matches, so threads only
contend (measured: two threads took as long as one, or longer). A second process is
what helps: `search_pool` gives half of a big search's files to a worker process.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass

from substrate.errors import InvalidParams
from substrate.fs import fsops, paths
from substrate.matching.agent_regex import Matcher, matcher_for
from substrate.matching.re2_translate import first_start
from substrate.matching.strided import strided
from substrate.schema.fs import SearchMatch, SearchParams, SearchResult
from substrate.workspace.ignore import Pruner
from substrate.workspace.policy import GlobSet
from substrate.workspace.reads import entered, kind_from_dirent, pruner_for
from substrate.workspace.registry import Workspace
from substrate.workspace.search_prefilter import Prefilter as _Prefilter
from substrate.workspace.writes.temp_files import TEMP_PREFIX

#: Files larger than this are skipped by search (reported in files_scanned only when read).
SEARCH_MAX_FILE = 64 << 20
_BINARY_SNIFF = 8192


def matcher(p: SearchParams) -> Matcher:
    """The bounded matcher of `fs.search` `p`'s pattern (`agent_regex.matcher_for`):
    the caller picks its thread by `exact`, then hands it to `search`. Refuses
    `invalid_params` for a bad pattern. Costs a compile and a translation."""
    return matcher_for(_compile_search(p))


def _compile_search(p: SearchParams) -> re.Pattern[bytes]:
    flags = re.MULTILINE | (re.IGNORECASE if p.ignore_case else 0)
    source = re.escape(p.pattern) if p.fixed else p.pattern
    try:
        return re.compile(source.encode("utf-8", "surrogateescape"), flags)
    except re.error as exc:
        raise InvalidParams(f"pattern: {exc}", path="$.pattern") from None
    except RecursionError:  # groups nested deeper than the parser's stack
        raise InvalidParams("pattern: nested too deeply", path="$.pattern") from None


def search(ws: Workspace, p: SearchParams, found_by: Matcher | None = None) -> SearchResult:
    """`fs.search`: regex (or fixed string) over the tree's text files, bounded.

    Skips symlinks, binary files (a NUL in the first 8 KiB), files over 64 MiB, `.git`,
    `read_deny` paths, and what `exclude` or `gitignore` leave out (`reads.pruner_for`).
    A path that is not UTF-8 is reported as `fs.walk` does. `column` is the 1-based
    byte column. Refuses `invalid_params` for a bad pattern, glob or exclude glob;
    `too_large`/`limit_exceeded` for ignore files over their bounds. Costs one read of
    every scanned file, plus regex work only where a literal every match must contain
    occurs (see `_Prefilter`), or else where RE2 finds a match of the pattern's
    superset (`re2_translate`); stops at `max_matches`. One thread: `search_pool`
    shares the same work with a second process.
    """
    return serially(ws, Plan.of(p, found_by))


def serially(ws: Workspace, plan: Plan) -> SearchResult:
    """`search` of `plan` (made for `ws`) on this thread alone."""
    started = plan.start(ws)
    if started is None:
        return nothing()
    top, prune = started
    scan = _Scan(plan.matching, plan.prefilter, plan.p, plan.globs, ws.policy.read_deny, prune)
    scan.run(top, plan.base)
    return scan.result()


def nothing() -> SearchResult:
    """The result of a search whose start is left out (`exclude`, `gitignore`)."""
    return SearchResult(matches=[], truncated=False, files_scanned=0, bytes_scanned=0)


@dataclass(frozen=True)
class Plan:
    """What one search needs before its walk: the matcher, the prefilter, the glob and
    the start; made alike by `search`, by `search_pool` and by its worker process."""

    p: SearchParams
    matching: Matcher
    prefilter: _Prefilter
    globs: GlobSet | None
    parts: tuple[str, ...]
    base: str

    @classmethod
    def of(cls, p: SearchParams, found_by: Matcher | None = None) -> Plan:
        """Refuses `invalid_params` for a bad pattern, glob or path."""
        regex = _compile_search(p)
        matching = found_by or matcher_for(regex)
        prefilter = _Prefilter.for_search(regex, matching.exact)
        try:
            globs = GlobSet.of([p.glob]) if p.glob else None
        except InvalidParams as exc:
            raise InvalidParams(exc.message, path="$.glob") from None
        parts = tuple(paths.split_relpath(p.path, allow_root=True))
        return cls(p, matching, prefilter, globs, parts, "/".join(parts))

    def open(self, root_fd: int, prune: Pruner | None, where: Callable[[str], str]) -> int | None:
        """The walk's start opened beneath `root_fd` (the caller holds it), or None when
        `prune` leaves it out. Refuses what opening it refuses."""
        if prune is not None and not prune.start(root_fd, self.parts):
            return None
        return paths.open_dir(root_fd, self.parts, where(self.base or "."))

    def start(self, ws: Workspace) -> tuple[int, Pruner | None] | None:
        """The walk's start in `ws` (`open`, under `ws.use()`) and its pruner, or None
        when the pruner leaves the start out; the caller owns the fd."""
        prune = pruner_for(ws, self.p.exclude, self.p.gitignore)
        with ws.use():
            top = self.open(ws.root_fd, prune, ws.provenance)
        return None if top is None else (top, prune)


_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class _Truncated(Exception):
    """`max_matches` was reached: the walk stops where it is."""


class _Scan:
    """One search's walk and reads, fused (the order and the skips of
    `reads.walk_entries` with `sizes=False`, which `fs.walk` keeps).

    Directories are held open, one fd per level, each entered beneath its parent's fd
    with O_NOFOLLOW | O_DIRECTORY; files are opened beneath theirs with O_NOFOLLOW and
    checked by fstat. A path is never resolved. `read_deny` and `glob` hold when the
    path or one of its parents matches: a directory's answer is worked out once, on
    entry, so each file costs one exact match instead of one per parent. A file is read
    with one `pread` of its fstat size + 1: a short read is its end (a second read
    only for a file that grew meanwhile).
    """

    def __init__(
        self,
        matching: Matcher,
        prefilter: _Prefilter,
        p: SearchParams,
        globs: GlobSet | None,
        read_deny: GlobSet,
        prune: Pruner | None,
    ) -> None:
        self.matching = matching
        self.prefilter = prefilter
        self.starts = _starts(matching)
        self.screen_starts = (
            None
            if prefilter.screen is None
            else strided(prefilter.stride, first_start(prefilter.screen))
        )
        self.literal_starts = None if prefilter.finder is None else first_start(prefilter.finder)
        self.max_line_bytes = p.max_line_bytes
        self.limit = p.max_matches
        self.globs = globs
        self.read_deny = read_deny if read_deny else None
        self.prune = prune
        self.matches: list[SearchMatch] = []
        self.files = 0
        self.scanned = 0
        self.truncated = False
        self._held: list[int] = []

    def close(self) -> None:
        while self._held:
            os.close(self._held.pop())

    def run(self, top: int, base: str) -> None:
        """`tree`, then `close`, whatever is raised."""
        try:
            self.tree(top, base)
        finally:
            self.close()

    def result(self) -> SearchResult:
        return SearchResult(
            matches=self.matches,
            truncated=self.truncated,
            files_scanned=self.files,
            bytes_scanned=self.scanned,
        )

    def tree(self, top: int, base: str) -> None:
        """Search beneath the open directory `top` (the walk's start, `base`); owns it.
        Depth-first with a stack of its own (a tree deeper than Python's recursion limit
        is walked as any other)."""
        self._held.append(top)
        prune, read_deny, globs = self.prune, self.read_deny, self.globs
        denied = read_deny is not None and bool(base) and read_deny.matches(base)
        chosen = globs is None or (bool(base) and globs.matches(base))
        levels = [(top, base, iter(entered(top, base, prune)), denied, chosen)]
        try:
            while levels:
                dir_fd, dir_rel, entries, denied, chosen = levels[-1]
                for entry in entries:
                    name = entry.name
                    if name.startswith(TEMP_PREFIX) or name == ".git":
                        continue
                    rel = f"{dir_rel}/{name}" if dir_rel else name
                    if prune is not None:
                        kind = kind_from_dirent(entry)
                        if prune.leaves_out(rel, name, kind):
                            continue
                        is_dir, is_file = kind == "dir", kind == "file"
                    else:
                        is_dir = entry.is_dir(follow_symlinks=False)
                        is_file = not is_dir and entry.is_file(follow_symlinks=False)
                    if is_file:
                        if denied or (read_deny is not None and read_deny.matches_exactly(rel)):
                            continue
                        if not chosen and globs is not None and not globs.matches_exactly(rel):
                            continue
                        self._file(dir_fd, name, rel)
                    elif is_dir:
                        try:
                            child = os.open(name, fsops.DIR_FLAGS, dir_fd=dir_fd)
                        except OSError:
                            continue  # swapped or vanished meanwhile: never followed
                        self._held.append(child)
                        levels.append(
                            (
                                child,
                                rel,
                                iter(entered(child, rel, prune)),
                                denied
                                or (read_deny is not None and read_deny.matches_exactly(rel)),
                                chosen or (globs is not None and globs.matches_exactly(rel)),
                            )
                        )
                        break  # into the child; this level's iterator resumes after it
                else:
                    levels.pop()
                    os.close(self._held.pop())
                    if prune is not None:
                        prune.leave()
        except _Truncated:
            self.truncated = True

    def _file(self, dir_fd: int, name: str, rel: str) -> None:
        data = self._read(dir_fd, name)
        if data is None or data.find(b"\x00", 0, _BINARY_SNIFF) >= 0:
            return  # not a regular file, gone, over the bound, or binary
        self._match(data, rel)

    @staticmethod
    def _read(dir_fd: int, name: str) -> bytes | None:
        """The bytes of the regular file `name` beneath `dir_fd` (never a link), or None."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode) or size > SEARCH_MAX_FILE:
                return None
            data: bytes | None = os.pread(fd, size + 1, 0)
            if data is not None and len(data) > size:
                data = fsops.read_fd(fd, SEARCH_MAX_FILE, expected=size)  # it grew
        finally:
            os.close(fd)
        return data  # None: it grew past the bound while read

    def _match(self, data: bytes, rel: str) -> None:
        """Count the text file `data` at `rel` as scanned and collect its matches."""
        self.files += 1
        size = len(data)
        self.scanned += size
        # Most files hold no hit: rejected here by one RE2 call, without `_collect`'s
        # setup; a hit found is handed on, not looked for again.
        first = -1
        if self.literal_starts is not None:
            first = self.literal_starts(data, 0, size)
            if first < 0:
                return
        elif self.screen_starts is not None:
            first = self.screen_starts(data, 0, size)
            if first < 0:
                return
        if _collect(
            self.matching,
            self.prefilter,
            data,
            rel,
            self.max_line_bytes,
            self.matches,
            self.limit,
            self.starts,
            self.screen_starts,
            self.literal_starts,
            first,
        ):
            raise _Truncated


def _starts(regex: Matcher) -> Callable[[bytes, int, int], int]:
    """`regex.search(data, pos, endpos)`'s match start, or -1 (`endpos <= len(data)`):
    RE2's own call for an exact matcher (`re2_translate.first_start`); a plain
    `re.Pattern` (the prefilter's tests) is searched as itself."""
    exact = getattr(regex, "exact", None)

    def by_search(data: bytes, pos: int, endpos: int) -> int:
        m = regex.search(data, pos, endpos)
        return -1 if m is None else m.start()

    if exact is None:
        return by_search
    first = first_start(exact)

    def by_re2(data: bytes, pos: int, endpos: int) -> int:
        if endpos <= 0:
            return by_search(data, pos, endpos)  # `_Linear.search`: `re`'s answer for b""
        return first(data, pos, endpos)

    return by_re2


def _collect(
    regex: Matcher,
    prefilter: _Prefilter,
    data: bytes,
    rel: str,
    max_line_bytes: int,
    out: list[SearchMatch],
    limit: int,
    starts: Callable[[bytes, int, int], int] | None = None,
    screen_starts: Callable[[bytes, int, int], int] | None = None,
    literal_starts: Callable[[bytes, int, int], int] | None = None,
    first: int = -1,
) -> bool:
    """Append one match per matching line; True when `limit` was reached.

    The result is the same as `regex.search` over the whole file from each line's start;
    the prefilter only skips work that cannot find anything. `starts`/`screen_starts`:
    `_starts(regex)`, `first_start(prefilter.screen)` and `first_start(prefilter.finder)`,
    made once per search; `first`: where the caller found the first hit of the finder
    (`literal_starts`) or else of the screen (`screen_starts`) in `data`, or -1 when it
    did not look. The literal is looked for with the finder when there is one
    (it may also stop on a Latin-1 case variant: that line is then searched for nothing),
    else by `bytes.find` (in the lowered file when `fold`).
    """
    literal = prefilter.literal
    size = len(data)
    if literal:
        if literal_starts is None and prefilter.finder is not None:
            literal_starts = first_start(prefilter.finder)
        if literal_starts is not None:
            lit_at = literal_starts
        else:
            hay = data.lower() if prefilter.fold else data

            def lit_at(_: bytes, pos: int, endpos: int) -> int:
                return hay.find(literal, pos, endpos)

        found = first if first >= 0 and literal_starts is not None else lit_at(data, 0, size)
        if found < 0:
            return False
    search = starts or _starts(regex)
    screen = prefilter.screen
    pos = 0
    hit = -1
    if screen is not None:
        screen_at = screen_starts or first_start(screen)
        hit = first if first >= 0 and screen_starts is not None else screen_at(data, 0, size)
        if hit < 0:
            return False
        # `re`'s first match starts at or after RE2's first (a superset): start at its line.
        pos = data.rfind(b"\n", 0, hit) + 1
    path, path_b64 = paths.wire_name(rel)
    line_no = 1
    counted_to = 0

    def add(start: int, end: int, column: int) -> bool:
        nonlocal line_no, counted_to
        line_no += data.count(b"\n", counted_to, start)
        counted_to = start
        text = data[start : min(end, start + max_line_bytes)].decode("utf-8", "replace")
        out.append(
            SearchMatch(path=path, line=line_no, column=column, text=text, path_b64=path_b64)
        )
        return len(out) >= limit

    if screen is not None and prefilter.line_bound:
        # Only lines where RE2 finds the superset can match; a match never leaves its line.
        # An exact screen's hit is that match already: it was searched for from this
        # line's start (or the file's), with the same context before it. (`re` alone
        # answers for an empty file: its `\B` never matches one.)
        exact = prefilter.exact and size > 0
        while hit >= 0:
            start = data.rfind(b"\n", 0, hit) + 1
            end = data.find(b"\n", hit)
            end = size if end < 0 else end
            # Up to and with the newline: an empty line is not an empty string (`\B`); a
            # match there starting past the newline is the next line's.
            at = hit if exact else search(data, start, min(end + 1, size))
            if at > end:
                at = -1
            if at >= 0 and add(start, end, at - start + 1):
                return True
            hit = screen_at(data, end + 1, size) if end < size else -1
        return False
    if literal and prefilter.line_bound:
        # Only lines holding the literal can match; a match never leaves its line.
        whole = prefilter.whole
        while found >= 0:
            start = data.rfind(b"\n", 0, found) + 1
            end = data.find(b"\n", found)
            end = size if end < 0 else end
            # The leftmost occurrence at or after this line's start is on this line.
            at = found if whole else search(data, start, end)
            if at >= 0 and add(start, end, at - start + 1):
                return True
            found = lit_at(data, end + 1, size) if end < size else -1
        return False
    while pos <= size:
        at = search(data, pos, size)
        if at < 0:
            return False
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        end = size if end < 0 else end
        if add(start, end, at - start + 1):
            return True
        pos = end + 1
    return False
