"""The `fs.search` loop before the fused walk of `substrate.workspace.search._Scan`: the
reference the differential tests compare it with. It walks with `reads.walk_entries`
(which `fs.walk` uses), checks `read_deny` and `glob` per file on every parent, and reads
each file until a read returns nothing, and matches with the per-file loop of then
(`collect`: `bytes.find` for the literal, `Matcher.search` per candidate line), under
the prefilter of then (`Prefilter`: the literal, without its RE2 finder)."""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from substrate.errors import InvalidParams
from substrate.fs import fsops, paths
from substrate.matching.agent_regex import Matcher, matcher_for
from substrate.matching.re2_translate import superset_of
from substrate.schema.fs import SearchMatch, SearchParams, SearchResult
from substrate.workspace.policy import GlobSet
from substrate.workspace.reads import pruner_for, walk_entries
from substrate.workspace.registry import Workspace
from substrate.workspace.search import (
    _BINARY_SNIFF,
    SEARCH_MAX_FILE,
    _compile_search,
)
from substrate.workspace.search_prefilter import Prefilter as _Prefilter


def reference_search(
    ws: Workspace, p: SearchParams, found_by: Matcher | None = None
) -> SearchResult:
    regex = _compile_search(p)
    matching = found_by or matcher_for(regex)
    prefilter = Prefilter.for_search(regex, matching.exact)
    try:
        globs = GlobSet.of([p.glob]) if p.glob else None
    except InvalidParams as exc:
        raise InvalidParams(exc.message, path="$.glob") from None
    parts = paths.split_relpath(p.path, allow_root=True)
    prune = pruner_for(ws, p.exclude, p.gitignore)
    matches: list[SearchMatch] = []
    files = 0
    scanned = 0
    walk = walk_entries(ws, parts, None, include_git=False, sizes=False, prune=prune)
    for found in walk:
        if found.kind != "file" or found.size > SEARCH_MAX_FILE:
            continue
        if not ws.policy.may_read(found.rel):
            continue
        if globs is not None and not globs.matches(found.rel):
            continue
        try:
            fd = os.open(
                found.name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=found.parent_fd,
            )
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > SEARCH_MAX_FILE:
                continue
            data = fsops.read_fd(fd, SEARCH_MAX_FILE, expected=st.st_size)
        finally:
            os.close(fd)
        if data is None:
            continue
        if data.find(b"\x00", 0, _BINARY_SNIFF) >= 0:
            continue
        files += 1
        scanned += len(data)
        if collect(matching, prefilter, data, found.rel, p.max_line_bytes, matches, p.max_matches):
            return SearchResult(
                matches=matches, truncated=True, files_scanned=files, bytes_scanned=scanned
            )
    return SearchResult(
        matches=matches, truncated=False, files_scanned=files, bytes_scanned=scanned
    )


class Prefilter(_Prefilter):
    """`_Prefilter` as it was: a literal is looked for by `bytes.find` alone."""

    @classmethod
    def for_search(cls, regex: re.Pattern[bytes], exact: Any = None) -> _Prefilter:
        literal = cls.of(regex)
        if literal.literal:
            return literal
        if exact is not None:
            return cls(screen=exact, exact=True, line_bound=literal.line_bound)
        return cls(screen=superset_of(regex), line_bound=literal.line_bound)


def collect(
    regex: Matcher,
    prefilter: _Prefilter,
    data: bytes,
    rel: str,
    max_line_bytes: int,
    out: list[SearchMatch],
    limit: int,
) -> bool:
    """Append one match per matching line; True when `limit` was reached.

    The result is the same as `regex.search` over the whole file from each line's start;
    the prefilter only skips work that cannot find anything.
    """
    literal = prefilter.literal
    hay = data.lower() if literal and prefilter.fold else data
    if literal and hay.find(literal) < 0:
        return False
    screen = prefilter.screen
    pos = 0
    if screen is not None:
        hit = screen.search(data)
        if hit is None:
            return False
        # `re`'s first match starts at or after RE2's first (a superset): start at its line.
        pos = data.rfind(b"\n", 0, hit.start()) + 1
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
        while hit is not None:
            start = data.rfind(b"\n", 0, hit.start()) + 1
            end = data.find(b"\n", hit.start())
            end = len(data) if end < 0 else end
            # Up to and with the newline: an empty line is not an empty string (`\B`); a
            # match there starting past the newline is the next line's. An exact screen's
            # hit is that match already: it was searched for from this line's start (or
            # the file's), with the same context before it.
            # (`re` alone answers for an empty file: its `\B` never matches one.)
            exact = prefilter.exact and data
            m = hit if exact else regex.search(data, start, min(end + 1, len(data)))
            if m is not None and m.start() > end:
                m = None
            if m is not None and add(start, end, m.start() - start + 1):
                return True
            hit = screen.search(data, end + 1) if end < len(data) else None
        return False
    if literal and prefilter.line_bound:
        # Only lines holding the literal can match; a match never leaves its line.
        at = hay.find(literal)
        while at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end
            m = regex.search(data, start, end)
            if m is not None and add(start, end, m.start() - start + 1):
                return True
            at = hay.find(literal, end + 1)
        return False
    while pos <= len(data):
        m = regex.search(data, pos)
        if m is None:
            return False
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.start())
        end = len(data) if end < 0 else end
        if add(start, end, m.start() - start + 1):
            return True
        pos = end + 1
    return False
