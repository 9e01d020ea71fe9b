"""`fs.search`: a regex (or fixed string) over a workspace's text files, bounded.

Files are reached through the walk of `substrate.workspace.reads` (dir fds, never a
symlink, `.git` and temp files skipped) and read whole, at most `SEARCH_MAX_FILE` bytes
each. `_Prefilter` derives from the stdlib's own parse of the pattern a literal every
match must contain (grep's "must" string): files without it are rejected by
`bytes.find`, and where no match can leave its line only the lines holding it are
searched. A pattern with no such literal is screened by RE2 instead
(`substrate.matching.re2_translate`): a file where a pattern matching a superset of the
original's finds nothing is skipped, and `re` starts at the line of its first hit. The
results are those of `regex.search` over every file, whatever is skipped.
"""

from __future__ import annotations

import importlib
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from substrate.errors import InvalidParams
from substrate.fs import fsops, paths
from substrate.matching.agent_regex import Matcher, matcher_for
from substrate.matching.re2_translate import exact_of, superset_of
from substrate.schema.fs import SearchMatch, SearchParams, SearchResult
from substrate.workspace.policy import GlobSet
from substrate.workspace.reads import pruner_for, walk_entries
from substrate.workspace.registry import Workspace

#: The stdlib's own regex parser (private, stable since 3.11): see `_Prefilter`.
_sre: Any = importlib.import_module("re._constants")
_sre_parser: Any = importlib.import_module("re._parser")

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


def search(ws: Workspace, p: SearchParams, found_by: Matcher | None = None) -> SearchResult:
    """`fs.search`: regex (or fixed string) over the tree's text files, bounded.

    Skips symlinks, binary files (a NUL in the first 8 KiB), files over 64 MiB, `.git`,
    `read_deny` paths, and what `exclude` or `gitignore` leave out (`reads.pruner_for`).
    A path that is not UTF-8 is reported as `fs.walk` does. `column` is the 1-based
    byte column. Refuses `invalid_params` for a bad pattern, glob or exclude glob; `too_large`/`limit_exceeded` for ignore files over their
    bounds. Costs one read of every scanned file, plus regex work only where a literal
    every match must contain occurs (see `_Prefilter`), or else where RE2 finds a match
    of the pattern's superset (`re2_translate`); stops at `max_matches`.
    """
    regex = _compile_search(p)
    matching = found_by or matcher_for(regex)
    prefilter = _Prefilter.for_search(regex, matching.exact)
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
            # One read of the expected size (+1 to see the end): a 1 MiB read buffer per
            # file costs more than the search itself (an mmap and page faults each time).
            data = fsops.read_fd(fd, SEARCH_MAX_FILE, expected=st.st_size)
        finally:
            os.close(fd)
        if data is None:
            continue  # it grew past the bound while read
        if data.find(b"\x00", 0, _BINARY_SNIFF) >= 0:
            continue
        files += 1
        scanned += len(data)
        if _collect(matching, prefilter, data, found.rel, p.max_line_bytes, matches, p.max_matches):
            return SearchResult(
                matches=matches, truncated=True, files_scanned=files, bytes_scanned=scanned
            )
    return SearchResult(
        matches=matches, truncated=False, files_scanned=files, bytes_scanned=scanned
    )


#: `_Prefilter.for_search` without the matcher's exact pattern: translate it there.
_LOOK: Any = object()


@dataclass(frozen=True)
class _Prefilter:
    """What a search may skip without changing its result (grep's "must" literal).

    `literal`: bytes every match contains (lowercased when `fold`, for IGNORECASE, whose
    bytes folding is ASCII-only like `bytes.lower`); a file without it has no match, and
    `bytes.find` rejects it far faster than the regex engine. `line_bound`: no match can
    contain a newline or look past its line's end, so the regex needs to run only on the
    lines where the literal occurs. Both are derived from the stdlib's own parse of the
    pattern; anything unrecognised makes them empty/False (search every byte).
    """

    literal: bytes = b""
    fold: bool = False
    line_bound: bool = False
    #: Without a literal: an RE2 pattern matching wherever the regex can, or None.
    screen: Any = None
    #: The screen matches exactly where the regex does (`re2_translate.exact_of`): its hit
    #: from a line's start is that line's match, with no second search.
    exact: bool = False

    @classmethod
    def for_search(cls, regex: re.Pattern[bytes], exact: Any = _LOOK) -> _Prefilter:
        """The literal prefilter, or else the RE2 screen (`re2_translate`): `exact` when
        given (the matcher's, or None), else looked up."""
        literal = cls.of(regex)
        if literal.literal:
            return literal
        if exact is _LOOK:
            exact = exact_of(regex)
        if exact is not None:
            return cls(screen=exact, exact=True, line_bound=literal.line_bound)
        return cls(screen=superset_of(regex), line_bound=literal.line_bound)

    @classmethod
    def of(cls, regex: re.Pattern[bytes]) -> _Prefilter:
        try:
            parsed = _sre_parser.parse(regex.pattern, regex.flags)
        except Exception:  # a parser this code does not know: no shortcut
            return cls()
        flags = parsed.state.flags
        if flags & _sre.SRE_FLAG_LOCALE or _scoped_flags(parsed.data):
            return cls()
        fold = bool(flags & _sre.SRE_FLAG_IGNORECASE)
        literal = max(_literals(parsed.data), key=len, default=b"")
        # With DOTALL, `.` matches a newline: the literal still filters files, not lines.
        dotall = bool(flags & _sre.SRE_FLAG_DOTALL)
        return cls(
            literal=literal.lower() if fold else literal,
            fold=fold,
            line_bound=not dotall and _line_bound(parsed.data),
        )


def _scoped_flags(items: Any) -> bool:
    """True when any `(?flags:...)` group changes the flags of part of the pattern."""
    for op, av in items:
        if op is _sre.SUBPATTERN and (av[1] or av[2]):
            return True
        for sub in _children(op, av):
            if _scoped_flags(sub):
                return True
    return False


def _children(op: Any, av: Any) -> list[Any]:
    if op is _sre.SUBPATTERN:
        return [av[3]]
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
        return [av[2]]
    if op is _sre.ATOMIC_GROUP:
        return [av]
    if op is _sre.BRANCH:
        return list(av[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op is _sre.GROUPREF_EXISTS:
        return [x for x in av[1:] if x is not None]
    return []


def _literals(items: Any) -> list[bytes]:
    """Byte strings that every match of the sequence `items` contains."""
    found: list[bytes] = []
    run: list[int] = []
    for op, av in items:
        if op is _sre.LITERAL:
            run.append(av)
            continue
        found.append(bytes(run))
        run = []
        if op is _sre.SUBPATTERN:
            found += _literals(av[3])
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT) and av[0] >= 1:
            found += _literals(av[2])
        elif op is _sre.ATOMIC_GROUP:
            found += _literals(av)
    found.append(bytes(run))
    return [f for f in found if f]


#: Classes that never match a newline: \d, \S, \w.
_LINE_CATEGORIES = {_sre.CATEGORY_DIGIT, _sre.CATEGORY_NOT_SPACE, _sre.CATEGORY_WORD}
_NL = 10


def _set_matches_newline(items: Any) -> bool:
    hit = False
    negate = False
    for op, av in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            hit = hit or av == _NL
        elif op is _sre.RANGE:
            hit = hit or av[0] <= _NL <= av[1]
        elif op is _sre.CATEGORY:
            hit = hit or av not in _LINE_CATEGORIES
        else:
            return True
    return hit != negate


def _line_bound(items: Any) -> bool:
    """True when no match of `items` can hold a newline or depend on the text past its line.

    Lookarounds and `\\Z` are refused: searching a line with `endpos` at its end would
    change what they see.
    """
    for op, av in items:
        if op is _sre.LITERAL:
            ok = av != _NL
        elif op is _sre.NOT_LITERAL:
            ok = av == _NL
        elif op is _sre.ANY:
            ok = True  # without DOTALL (checked by the caller), `.` never matches a newline
        elif op is _sre.IN:
            ok = not _set_matches_newline(av)
        elif op is _sre.AT:
            ok = av is not _sre.AT_END_STRING
        elif op is _sre.GROUPREF:
            ok = True  # repeats text of this match, which is on this line
        elif op in (_sre.SUBPATTERN, _sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            ok = _line_bound(_children(op, av)[0])
        elif op in (_sre.ATOMIC_GROUP, _sre.BRANCH, _sre.GROUPREF_EXISTS):
            ok = all(_line_bound(sub) for sub in _children(op, av))
        else:
            ok = False
        if not ok:
            return False
    return True


def _collect(
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
