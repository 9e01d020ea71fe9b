"""Bounded, symlink-refusing reads of a workspace (SPEC §3).

Every function is blocking (call it from a worker thread) and reaches files only through
the workspace's root fd (`substrate.workspace.paths`), held against release (`Workspace.use`) while
it opens them. Symlinks are reported as such and never followed; `read_deny` paths are
refused for content and skipped by search. Names that are not UTF-8 are listed escaped
(`paths.wire_name`), never refused.

Whole-file digests (`fs.stat`, `fs.read`) cost a pass over the file, so they are bounded:
a caller passes `hash_up_to`, and a file over it that `Digests` does not know yet gets no
digest (`sha256_deferred`) unless the caller asks for any size (`None`), which the API
does only on request and on threads of its own.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from substrate.errors import InvalidParams, PathDenied, TooLarge
from substrate.schema.fs import (
    MAX_READ,
    ListEntry,
    ListParams,
    ListResult,
    ReadParams,
    ReadResult,
    SearchMatch,
    SearchParams,
    SearchResult,
    StatParams,
    StatResult,
    WalkEntry,
    WalkParams,
    WalkResult,
)
from substrate.workspace import paths
from substrate.workspace.policy import GlobSet
from substrate.workspace.registry import Workspace
from substrate.workspace.temp_files import TEMP_PREFIX

#: The stdlib's own regex parser (private, stable since 3.11): see `_Prefilter`.
_sre: Any = importlib.import_module("re._constants")
_sre_parser: Any = importlib.import_module("re._parser")

CHUNK = 1 << 20
#: Files up to this size get their digest with every stat and read (`inline_hash_bytes`).
INLINE_HASH_BYTES = 64 << 20
#: Digests kept by `Digests` (about 200 bytes each).
DIGEST_CACHE_ENTRIES = 4096
#: A digest is cached only for a file whose ctime is this much older than the hash: a
#: change within one tick of the file system's clock would keep the same times.
RACY_NS = 2_000_000_000
#: Hashes of files over this size are shared by concurrent askers of the same version
#: (below it a second hash costs less than waiting for the first).
SHARED_HASH_BYTES = 1 << 20
#: Files larger than this are skipped by search (reported in files_scanned only when read).
SEARCH_MAX_FILE = 64 << 20
_BINARY_SNIFF = 8192
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_readable(ws: Workspace, rel: str) -> None:
    if not ws.policy.may_read(rel):
        raise PathDenied(f"{ws.provenance(rel)}: denied by the workspace read policy")


def hash_fd(fd: int) -> str:
    """SHA-256 of a whole open file, from offset 0."""
    digest = hashlib.sha256()
    offset = 0
    while True:
        block = os.pread(fd, CHUNK, offset)
        if not block:
            return digest.hexdigest()
        digest.update(block)
        offset += len(block)


#: What names one version of one file: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns).
Version = tuple[int, int, int, int, int]


def version_of(st: os.stat_result) -> Version:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Digests:
    """Whole-file SHA-256s, cached by file version; one computation per version at a time.

    A version is `version_of(fstat)`: any change to a file's bytes through the file system
    sets its mtime and ctime, and ctime cannot be set back, so a digest stays valid while
    the version is the same. Within one tick of the file system's clock a change can keep
    the times (git's "racily clean" case), so a digest is kept only when the file's ctime
    is `racy_ns` older than the start of its hash. At most `entries` are kept, least
    recently used dropped first. Thread-safe; callers that ask for a version of more than
    `SHARED_HASH_BYTES` being hashed wait for that hash instead of starting another.
    """

    def __init__(self, entries: int = DIGEST_CACHE_ENTRIES, racy_ns: int = RACY_NS) -> None:
        self._entries = entries
        self._racy_ns = racy_ns
        self._lock = threading.Lock()
        self._known: OrderedDict[Version, str] = OrderedDict()
        self._running: dict[Version, Future[tuple[str, bool]]] = {}

    def known(self, st: os.stat_result) -> str | None:
        """The digest of this version if it is cached. Costs nothing."""
        key = version_of(st)
        with self._lock:
            found = self._known.get(key)
            if found is not None:
                self._known.move_to_end(key)
            return found

    def of(self, fd: int, up_to: int | None) -> tuple[os.stat_result, str | None]:
        """fstat and digest of the file open as `fd`, both of one version.

        The digest is the cached one, or computed when the file is at most `up_to` bytes
        (`None`: any size), else None. A file that changes while it is hashed is hashed
        again, at most three times (then the last digest is returned, not kept). Costs a
        pass over the file for each computation.
        """
        for _attempt in range(3):
            st = os.fstat(fd)
            found = self.known(st)
            if found is not None or (up_to is not None and st.st_size > up_to):
                return st, found
            digest, unchanged = self._compute(fd, st)
            if unchanged:
                break
        return st, digest

    def _compute(self, fd: int, st: os.stat_result) -> tuple[str, bool]:
        key = version_of(st)
        if st.st_size <= SHARED_HASH_BYTES:
            return self._hash(fd, st)
        mine: Future[tuple[str, bool]] = Future()
        with self._lock:
            running = self._running.setdefault(key, mine)
        if running is not mine:
            return running.result()
        try:
            outcome = self._hash(fd, st)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._running[key]
        mine.set_result(outcome)
        return outcome

    def _hash(self, fd: int, st: os.stat_result) -> tuple[str, bool]:
        """(digest, whether the file stayed at version `st`); kept when it did, unless racy."""
        started = time.time_ns()
        digest = hash_fd(fd)
        key = version_of(st)
        unchanged = version_of(os.fstat(fd)) == key
        if unchanged and st.st_ctime_ns < started - self._racy_ns:
            with self._lock:
                self._known[key] = digest
                while len(self._known) > self._entries:
                    self._known.popitem(last=False)
        return digest, unchanged


def _open_file(ws: Workspace, parts: tuple[str, ...], rel: str) -> int:
    """Open the regular file `parts` beneath the root fd, which is held only for the open."""
    with ws.use(), paths.opened_dir(ws.root_fd, parts[:-1], ws.provenance(rel)) as parent:
        return paths.open_regular(parent, parts[-1], ws.provenance(rel))


def stat_path(
    ws: Workspace, p: StatParams, digests: Digests, hash_up_to: int | None = INLINE_HASH_BYTES
) -> StatResult:
    """`fs.stat`. Refuses path, symlink-on-the-way and read_deny problems.

    A file's `sha256` is given when `digests` knows it or the file is at most
    `hash_up_to` bytes (`None`: any size); else it is null with `sha256_deferred`. Costs
    a pass over a file whose digest is computed, nothing more for any other.
    """
    parts = paths.split_relpath(p.path, allow_root=True)
    rel = "/".join(parts) or "."
    fd = None
    with ws.use():
        if parts:
            _check_readable(ws, rel)
        with paths.opened_dir(ws.root_fd, parts[:-1], ws.provenance(rel)) as parent:
            if not parts:
                st = os.fstat(parent)
            else:
                found = paths.lstat_at(parent, parts[-1])
                if found is None:
                    raise paths.refusal_for(FileNotFoundError(2, "absent"), ws.provenance(rel))
                st = found
                if stat.S_ISREG(st.st_mode):
                    fd = paths.open_regular(parent, parts[-1], ws.provenance(rel))
    sha = None
    if fd is not None:
        try:
            st, sha = digests.of(fd, hash_up_to)
        finally:
            os.close(fd)
    return StatResult(
        path=rel,
        kind=paths.kind_of(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime_ns=st.st_mtime_ns,
        sha256=sha,
        sha256_deferred=fd is not None and sha is None,
    )


def _pread_range(fd: int, offset: int, length: int) -> bytes:
    chunks: list[bytes] = []
    while length > 0:
        block = os.pread(fd, min(length, CHUNK), offset)
        if not block:
            break
        chunks.append(block)
        offset += len(block)
        length -= len(block)
    return b"".join(chunks)


def read_file(
    ws: Workspace, p: ReadParams, digests: Digests, hash_up_to: int | None = INLINE_HASH_BYTES
) -> ReadResult:
    """`fs.read`: a slice plus the whole file's SHA-256 (so a write can bind to it).

    The digest follows `stat_path`'s rule (`hash_up_to`, `sha256_deferred`); slice and
    digest are of the same version (re-read while the file changes under them, at most
    three times). Refuses `too_large` for length > 4 MiB; `not_a_file` for FIFOs, devices
    and directories (a FIFO is opened non-blocking, so it never hangs). Costs the slice,
    plus a pass over the whole file when its digest is computed.
    """
    if p.length > MAX_READ:
        raise TooLarge(f"length {p.length} exceeds {MAX_READ}", limit=MAX_READ)
    parts = paths.split_relpath(p.path)
    rel = "/".join(parts)
    _check_readable(ws, rel)
    fd = _open_file(ws, parts, rel)
    try:
        for _attempt in range(3):
            st, digest = digests.of(fd, hash_up_to)
            data = _pread_range(fd, p.offset, p.length)
            if version_of(os.fstat(fd)) == version_of(st):
                break
    finally:
        os.close(fd)
    try:
        text, encoding = data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(data).decode("ascii"), "base64"
    return ReadResult(
        path=rel,
        size=st.st_size,
        sha256=digest,
        sha256_deferred=digest is None,
        offset=p.offset,
        eof=p.offset + len(data) >= st.st_size,
        encoding=encoding,  # type: ignore[arg-type]
        data=text,
    )


def _name_key(name: str) -> bytes:
    return os.fsencode(name)


def _scan_sorted(dir_fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(dir_fd) as it:
        return sorted(it, key=lambda e: _name_key(e.name))


def _entry_kind_size(entry: os.DirEntry[str]) -> tuple[paths.Kind, int]:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return "other", 0
    return paths.kind_of(st.st_mode), st.st_size


def list_dir(ws: Workspace, p: ListParams) -> ListResult:
    """`fs.list`: one directory's entries sorted by name bytes, at most `limit`.

    A name that is not UTF-8 is listed escaped, with its bytes in `name_b64`.
    """
    parts = paths.split_relpath(p.path, allow_root=True)
    rel = "/".join(parts) or "."
    out = []
    with ws.use(), paths.opened_dir(ws.root_fd, parts, ws.provenance(rel)) as fd:
        entries = _scan_sorted(fd)
        # Inside the block: a DirEntry of scandir(fd) stats lazily, relative to that fd.
        for entry in entries[: p.limit]:
            kind, size = _entry_kind_size(entry)
            name, raw = paths.wire_name(entry.name)
            out.append(ListEntry(name=name, kind=kind, size=size, name_b64=raw))
    return ListResult(entries=out, truncated=len(entries) > p.limit)


@dataclass
class _Found:
    rel: str
    kind: paths.Kind
    size: int
    parent_fd: int
    name: str


def _kind_from_dirent(entry: os.DirEntry[str]) -> paths.Kind:
    """The kind from the directory entry's d_type: no syscall (size unknown: 0)."""
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


def _walk(
    ws: Workspace,
    parts: tuple[str, ...],
    max_depth: int | None,
    include_git: bool,
    *,
    sizes: bool = True,
) -> Iterator[_Found]:
    """Pre-order, name-byte-sorted walk. Directories are opened with O_NOFOLLOW.

    With `sizes=False` entries are classified from d_type and reported with size 0,
    saving an lstat per entry; callers then check what they open with fstat.
    """
    base = "/".join(parts)
    with ws.use():
        top = paths.open_dir(ws.root_fd, parts, ws.provenance(base or "."))
    stack: list[tuple[int, str, int, Iterator[os.DirEntry[str]]]] = [
        (top, base, 1, iter(_scan_sorted(top)))
    ]
    try:
        while stack:
            dir_fd, dir_rel, depth, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(dir_fd)
                stack.pop()
                continue
            if entry.name.startswith(TEMP_PREFIX):
                continue
            if entry.name == ".git" and not include_git:
                continue
            rel = f"{dir_rel}/{entry.name}" if dir_rel else entry.name
            if sizes:
                kind, size = _entry_kind_size(entry)
            else:
                kind, size = _kind_from_dirent(entry), 0
            yield _Found(rel, kind, size, dir_fd, entry.name)
            if kind == "dir" and (max_depth is None or depth < max_depth):
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # swapped or vanished meanwhile: never followed
                stack.append((child, rel, depth + 1, iter(_scan_sorted(child))))
    finally:
        for dir_fd, *_ in stack:
            os.close(dir_fd)


def walk(ws: Workspace, p: WalkParams) -> WalkResult:
    """`fs.walk`: contained, deterministic, never follows a symlink, skips `.git` unless asked.

    A path that is not UTF-8 is listed escaped, with its bytes in `path_b64`.
    """
    parts = paths.split_relpath(p.path, allow_root=True)
    if p.max_depth == 0:
        return WalkResult(paths=[], truncated=False)
    out: list[WalkEntry] = []
    truncated = False
    for found in _walk(ws, parts, p.max_depth, p.include_git):
        if len(out) >= p.max_entries:
            truncated = True
            break
        path, raw = paths.wire_name(found.rel)
        out.append(WalkEntry(path=path, kind=found.kind, size=found.size, path_b64=raw))
    return WalkResult(paths=out, truncated=truncated)


def _compile_search(p: SearchParams) -> re.Pattern[bytes]:
    flags = re.MULTILINE | (re.IGNORECASE if p.ignore_case else 0)
    source = re.escape(p.pattern) if p.fixed else p.pattern
    try:
        return re.compile(source.encode("utf-8", "surrogateescape"), flags)
    except re.error as exc:
        raise InvalidParams(f"pattern: {exc}", path="$.pattern") from None


def search(ws: Workspace, p: SearchParams) -> SearchResult:
    """`fs.search`: regex (or fixed string) over the tree's text files, bounded.

    Skips symlinks, binary files (a NUL in the first 8 KiB), files over 64 MiB, `.git`,
    and `read_deny` paths. A path that is not UTF-8 is reported as `fs.walk` does. `column` is the 1-based byte column. Costs one read of every
    scanned file, plus regex work only where a literal every match must contain occurs
    (see `_Prefilter`); stops at `max_matches`.
    """
    regex = _compile_search(p)
    prefilter = _Prefilter.of(regex)
    try:
        globs = GlobSet.of([p.glob]) if p.glob else None
    except InvalidParams as exc:
        raise InvalidParams(exc.message, path="$.glob") from None
    parts = paths.split_relpath(p.path, allow_root=True)
    matches: list[SearchMatch] = []
    files = 0
    scanned = 0
    for found in _walk(ws, parts, None, include_git=False, sizes=False):
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
            data = os.read(fd, st.st_size + 1)
            if len(data) > st.st_size:  # it grew meanwhile: read the rest
                data += _read_all(fd)
        finally:
            os.close(fd)
        if data.find(b"\x00", 0, _BINARY_SNIFF) >= 0:
            continue
        files += 1
        scanned += len(data)
        if _collect(regex, prefilter, data, found.rel, p.max_line_bytes, matches, p.max_matches):
            return SearchResult(
                matches=matches, truncated=True, files_scanned=files, bytes_scanned=scanned
            )
    return SearchResult(
        matches=matches, truncated=False, files_scanned=files, bytes_scanned=scanned
    )


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        block = os.read(fd, CHUNK)
        if not block:
            return b"".join(chunks)
        chunks.append(block)


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
            line_bound=bool(literal) and not dotall and _line_bound(parsed.data),
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
    regex: re.Pattern[bytes],
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

    if prefilter.line_bound:
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
    pos = 0
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
