"""What `fs.walk` and `fs.search` leave out: `exclude` globs and, with `gitignore: true`,
what git would ignore (docs/protocol.md §3).

Theory of operation
-------------------
`IgnoreFile.parse` turns one ignore file (`.gitignore`, `.git/info/exclude`) into rules,
following git's `dir.c` and `wildmatch.c` (git 2.39): a UTF-8 BOM is skipped, a `\\r`
before a line's end is dropped, `#` starts a comment, unescaped trailing spaces go, `!`
negates, a trailing `/` matches directories only, a pattern with no other `/` matches a
name at any depth below the file's directory, and one with a `/` (a leading one
included) matches the path relative to that directory. `*` and `?` never match `/`;
`**` between slashes (or at either end) matches any number of directories; `[...]`
classes take ranges, `!`/`^` negation and the POSIX classes (`[:alpha:]`); `\\` escapes
the next byte. A pattern git would abort on (an unclosed `[`, a trailing `\\`, an
unknown `[:class:]`) matches nothing.

Matching is on bytes (paths as the kernel gives them, `os.fsencode`). Literal names
(`__pycache__`), suffixes (`*.pyc`) and literal paths (`/build`) are set and
`bytes.endswith` look-ups; every other pattern is translated to an RE2 pattern
(Latin-1, so one byte is one character) and matched in linear time: a pattern file is
workspace content, which an agent may write, and a backtracking engine would let
`*a*a*a*a*b` take exponential time on a long name.

`IgnoreStack` orders the files as git does: the deepest directory's file first, within
a file the last matching line, `.git/info/exclude` after every `.gitignore` of its
repository; the first decision found is the answer (ignored, or re-included by `!`). A
directory that holds `.git` starts a new repository: the rules of the directories
above it do not reach into it (git treats it as another repository). The walk never
descends into an ignored directory, so, as in git, nothing beneath it can be
re-included.

`Pruner` is the edge: it reads the files through the walk's directory fds (never
following a symlink, as git since 2.32 does not; a `.gitignore` that is not a regular
file is not read), skips files under `read_deny`, and keeps the totals bounded
(`MAX_IGNORE_FILE_BYTES` per file: `too_large`; `MAX_IGNORE_PATTERNS` and
`MAX_IGNORE_BYTES` per call: `limit_exceeded`). Files outside the workspace (a parent
repository's, `core.excludesFile`) are never read.

Decision: pathspec (1.1.1, evaluated) is not used. Its gitignore translation reads
`[[:alpha:]]` as a literal class, cannot know whether a path is a directory unless it is
written with a trailing `/`, matches with Python's backtracking `re`, and checks every
pattern of a file per path where this checks a few sets and one combined RE2 pattern.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from substrate.errors import (
    InvalidParams,
    LimitExceeded,
    NotADirectory,
    NotAFile,
    NotFound,
    PathDenied,
    SymlinkRefused,
)
from substrate.fs import fsops, paths
from substrate.workspace.policy import GlobSet

#: google-re2 ships no type information.
re2: Any = importlib.import_module("re2")

__all__ = [
    "MAX_EXCLUDE_GLOBS",
    "MAX_IGNORE_BYTES",
    "MAX_IGNORE_FILE_BYTES",
    "MAX_IGNORE_PATTERNS",
    "IgnoreFile",
    "IgnoreStack",
    "Pruner",
]

#: The largest ignore file read (git's own bound is 100 MiB; real ones are a few KiB).
MAX_IGNORE_FILE_BYTES = 1 << 20
#: Ignore-file bytes and patterns one walk or search may read and compile, in total.
MAX_IGNORE_BYTES = 16 << 20
MAX_IGNORE_PATTERNS = 100_000
#: `exclude` globs per call (the schema bounds the list too).
MAX_EXCLUDE_GLOBS = 256
#: Regex patterns joined into one RE2 alternation (keeps each program small).
_CHUNK = 64

_SLASH, _STAR, _QUESTION, _BACKSLASH = 0x2F, 0x2A, 0x3F, 0x5C
_LBRACKET, _RBRACKET, _DASH, _COLON = 0x5B, 0x5D, 0x2D, 0x3A
#: Characters that make a pattern more than a literal (git's `is_glob_special`).
_SPECIAL = frozenset(b"*?[\\")
_ALL = frozenset(range(256))


def _ascii(test: Callable[[int], bool]) -> frozenset[int]:
    return frozenset(c for c in range(128) if test(c))


#: wildmatch's POSIX classes: ASCII only, as git's ctype (its `isspace` is " \t\n\r").
_POSIX: dict[bytes, frozenset[int]] = {
    b"alnum": _ascii(lambda c: chr(c).isalnum()),
    b"alpha": _ascii(lambda c: chr(c).isalpha()),
    b"blank": frozenset(b" \t"),
    b"cntrl": _ascii(lambda c: c < 0x20 or c == 0x7F),
    b"digit": frozenset(b"0123456789"),
    b"graph": _ascii(lambda c: 0x21 <= c <= 0x7E),
    b"lower": frozenset(b"abcdefghijklmnopqrstuvwxyz"),
    b"print": _ascii(lambda c: 0x20 <= c <= 0x7E),
    b"punct": _ascii(lambda c: 0x21 <= c <= 0x7E and not chr(c).isalnum()),
    b"space": frozenset(b" \t\n\r"),
    b"upper": frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    b"xdigit": frozenset(b"0123456789abcdefABCDEF"),
}


class _Abort(Exception):
    """git's WM_ABORT_ALL: the pattern can match nothing."""


def _literal(c: int) -> bytes:
    return bytes([c]) if chr(c).isalnum() or c == 0x5F else b"\\x%02x" % c


def _byte_class(members: frozenset[int]) -> bytes:
    """An RE2 class of exactly `members` (never `/`), as byte ranges."""
    members = members - {_SLASH}
    if not members:
        raise _Abort
    out: list[bytes] = []
    run_start = prev = -2
    for c in sorted(members):
        if c != prev + 1:
            if run_start >= 0:
                out.append(b"\\x%02x-\\x%02x" % (run_start, prev))
            run_start = c
        prev = c
    out.append(b"\\x%02x-\\x%02x" % (run_start, prev))
    return b"[" + b"".join(out) + b"]"


def _parse_class(p: bytes, i: int) -> tuple[bytes, int]:
    """The class opened by `p[i] == '['` as RE2 source, and the index after its `]`.

    Mirrors wildmatch's loop: the first member may be `]`; `a-z` is a range unless the
    `-` is first or last; `[:name:]` is a POSIX class; `\\` escapes.
    """
    n = len(p)
    i += 1
    if i >= n:
        raise _Abort
    negated = p[i] in (0x21, 0x5E)  # ! ^
    if negated:
        i += 1
    members: set[int] = set()
    prev = 0
    if i >= n:
        raise _Abort
    c = p[i]
    while True:
        if c == _BACKSLASH:
            i += 1
            if i >= n:
                raise _Abort
            c = p[i]
            members.add(c)
        elif c == _DASH and prev and i + 1 < n and p[i + 1] != _RBRACKET:
            i += 1
            hi = p[i]
            if hi == _BACKSLASH:
                i += 1
                if i >= n:
                    raise _Abort
                hi = p[i]
            members.update(range(prev, hi + 1))
            c = 0
        elif c == _LBRACKET and i + 1 < n and p[i + 1] == _COLON:
            start = i + 2
            end = p.find(b"]", start)
            if end < 0:
                raise _Abort
            if end - start - 1 < 0 or p[end - 1] != _COLON:
                members.add(_LBRACKET)  # no ":]": an ordinary `[`, the scan resumes after it
            else:
                named = _POSIX.get(p[start : end - 1])
                if named is None:
                    raise _Abort
                members |= named
                i = end
                c = 0
        else:
            members.add(c)
        prev = c
        i += 1
        if i >= n:
            raise _Abort
        c = p[i]
        if c == _RBRACKET:
            break
    return _byte_class(_ALL - members if negated else frozenset(members)), i + 1


def wildmatch_regex(pattern: bytes, *, pathname: bool) -> bytes | None:
    """RE2 source (Latin-1, dot matching newlines) that fully matches what git's
    `wildmatch(pattern, text, pathname ? WM_PATHNAME : 0)` matches, or None when git
    would abort (the pattern matches nothing). Without `pathname` the text is one name
    (no `/`), where `**` is `*`. Pure; linear in the pattern."""
    out: list[bytes] = []
    i, n = 0, len(pattern)
    try:
        while i < n:
            c = pattern[i]
            if c == _BACKSLASH:
                if i + 1 >= n:
                    return None
                out.append(_literal(pattern[i + 1]))
                i += 2
            elif c == _QUESTION:
                out.append(b"[^/]")
                i += 1
            elif c == _STAR:
                j = i
                while j < n and pattern[j] == _STAR:
                    j += 1
                if pathname and j - i >= 2 and (i == 0 or pattern[i - 1] == _SLASH):
                    if j == n:
                        out.append(b".*")  # trailing `**`: everything
                        i = j
                        continue
                    if pattern[j] == _SLASH:
                        out.append(b"(?:.*/)?")  # `**/`: zero or more directories
                        i = j + 1
                        continue
                    if pattern[j : j + 2] == b"\\/":
                        out.append(b".*")  # the escaped slash follows as a literal
                        i = j
                        continue
                out.append(b"[^/]*")
                i = j
            elif c == _LBRACKET:
                source, i = _parse_class(pattern, i)
                out.append(source)
            else:
                out.append(_literal(c))
                i += 1
    except _Abort:
        return None
    return b"".join(out)


def _trim_trailing_spaces(line: bytes) -> bytes:
    """git's `trim_trailing_spaces`: drop trailing spaces unless escaped by a backslash."""
    last_space = -1
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c == 0x20:
            if last_space < 0:
                last_space = i
        elif c == _BACKSLASH:
            i += 1
            if i >= n:
                return line
            last_space = -1
        else:
            last_space = -1
        i += 1
    return line[:last_space] if last_space >= 0 else line


def _options() -> Any:
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1
    options.dot_nl = True
    return options


def _compile(sources: Sequence[bytes], where: str) -> list[Any]:
    """Full-match RE2 programs for `sources`, joined `_CHUNK` at a time. Refuses
    `limit_exceeded` when a pattern is over RE2's memory budget."""
    options = _options()
    out = []
    for start in range(0, len(sources), _CHUNK):
        chunk = sources[start : start + _CHUNK]
        try:
            out.append(re2.compile(b"|".join(b"(?:" + s + b")" for s in chunk), options))
        except re2.error:
            raise LimitExceeded(
                f"{where}: a pattern is too complex to match", scope="gitignore"
            ) from None
    return out


@dataclass
class _Matchers:
    """Patterns of one kind of target, by how they are checked (any hit is a match)."""

    names: set[bytes] = field(default_factory=set)
    suffixes: list[bytes] = field(default_factory=list)
    name_sources: list[bytes] = field(default_factory=list)
    paths: set[bytes] = field(default_factory=set)
    path_sources: list[bytes] = field(default_factory=list)
    name_regexes: list[Any] = field(default_factory=list)
    path_regexes: list[Any] = field(default_factory=list)
    suffix_tuple: tuple[bytes, ...] = ()

    def add(self, body: bytes, nodir: bool) -> None:
        if nodir:
            if not _SPECIAL.intersection(body):
                self.names.add(body)
            elif body[:1] == b"*" and not _SPECIAL.intersection(body[1:]):
                self.suffixes.append(body[1:])
            else:
                source = wildmatch_regex(body, pathname=False)
                if source is not None:
                    self.name_sources.append(source)
        elif not _SPECIAL.intersection(body):
            self.paths.add(body)
        else:
            source = wildmatch_regex(body, pathname=True)
            if source is not None:
                self.path_sources.append(source)

    def compile(self, where: str) -> None:
        self.suffix_tuple = tuple(self.suffixes)
        self.name_regexes = _compile(self.name_sources, where)
        self.path_regexes = _compile(self.path_sources, where)

    def hit(self, sub: bytes, name: bytes) -> bool:
        if name in self.names or sub in self.paths:
            return True
        if self.suffix_tuple and name.endswith(self.suffix_tuple):
            return True
        return any(r.fullmatch(name) for r in self.name_regexes) or any(
            r.fullmatch(sub) for r in self.path_regexes
        )


@dataclass
class _Run:
    """Consecutive lines of one sign: which of them matched does not change the answer."""

    negated: bool
    every: _Matchers = field(default_factory=_Matchers)
    dirs: _Matchers = field(default_factory=_Matchers)

    def hit(self, sub: bytes, name: bytes, is_dir: bool) -> bool:
        return self.every.hit(sub, name) or (is_dir and self.dirs.hit(sub, name))


@dataclass
class IgnoreFile:
    """The rules of one ignore file whose directory is `base` (workspace-relative,
    bytes, `b""` for the root, else ending in `/`)."""

    base: bytes
    runs: list[_Run]
    patterns: int

    @classmethod
    def parse(cls, data: bytes, base: bytes, where: str = "ignore file") -> IgnoreFile:
        """Parse and compile; see the module doc for the syntax. Refuses
        `limit_exceeded` for a pattern over RE2's memory budget. Costs one pass over
        `data` and one RE2 compile per 64 wildcard patterns."""
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        runs: list[_Run] = []
        count = 0
        for raw in data.split(b"\n"):
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line or line[:1] == b"#":
                continue
            line = _trim_trailing_spaces(line)
            negated = line[:1] == b"!"
            if negated:
                line = line[1:]
            dir_only = line.endswith(b"/")
            if dir_only:
                line = line[:-1]
            if not line:
                continue
            nodir = b"/" not in line
            body = line if nodir else line.removeprefix(b"/")
            if not runs or runs[-1].negated != negated:
                runs.append(_Run(negated))
            (runs[-1].dirs if dir_only else runs[-1].every).add(body, nodir)
            count += 1
        for run in runs:
            run.every.compile(where)
            run.dirs.compile(where)
        return cls(base, runs, count)

    def decide(self, rel: bytes, name: bytes, is_dir: bool) -> bool | None:
        """True: ignored; False: re-included by a `!` line; None: no line matches.
        `rel` must lie beneath `base`."""
        sub = rel[len(self.base) :]
        for run in reversed(self.runs):
            if run.hit(sub, name, is_dir):
                return not run.negated
        return None


class IgnoreStack:
    """The ignore files in force at one point of a walk, one frame per directory entered.

    `push(files, repository)` on entering a directory (its files lowest priority first:
    `.git/info/exclude`, then `.gitignore`; `repository` when it holds `.git`, which
    hides the frames above), `pop()` on leaving it. Pure.
    """

    def __init__(self) -> None:
        self._frames: list[tuple[list[IgnoreFile], bool]] = []
        self._pushed: list[bool] = []

    def push(self, files: list[IgnoreFile], repository: bool) -> None:
        keep = bool(files) or repository
        if keep:
            self._frames.append((files, repository))
        self._pushed.append(keep)

    def pop(self) -> None:
        if self._pushed.pop():
            self._frames.pop()

    def ignored(self, rel: bytes, name: bytes, is_dir: bool) -> bool:
        """Whether git ignores the workspace-relative `rel` (last component `name`).
        Costs a few set look-ups and RE2 matches per file in force."""
        for files, repository in reversed(self._frames):
            for rules in reversed(files):
                decided = rules.decide(rel, name, is_dir)
                if decided is not None:
                    return decided
            if repository:
                break
        return False


class Pruner:
    """What one `fs.walk` or `fs.search` leaves out, asked by the walk
    (`reads.walk_entries`) for every entry before it is reported or entered.

    `exclude`: policy-dialect globs (`substrate.workspace.policy`), each matched
    against the whole workspace-relative path; an excluded directory is not entered.
    `gitignore`: git's ignore rules, read as the walk enters directories. `may_read`
    is the read policy (files it denies are not read); `where` names a path in messages.
    Refuses `invalid_params` (`$.exclude`) for a bad glob. Blocking (file reads): call
    it from the walk's thread.
    """

    def __init__(
        self,
        exclude: Sequence[str],
        gitignore: bool,
        *,
        may_read: Callable[[str], bool],
        where: Callable[[str], str],
    ) -> None:
        if len(exclude) > MAX_EXCLUDE_GLOBS:
            raise InvalidParams(f"more than {MAX_EXCLUDE_GLOBS} exclude globs", path="$.exclude")
        try:
            self._exclude = GlobSet.of(list(exclude)) if exclude else None
        except InvalidParams as exc:
            raise InvalidParams(exc.message, path="$.exclude") from None
        self._stack = IgnoreStack() if gitignore else None
        self._may_read = may_read
        self._where = where
        self._bytes = 0
        self._patterns = 0
        #: Per directory entered: whether it is (in) a `.git`, where no rule applies.
        self._in_git: list[bool] = []

    @classmethod
    def of(
        cls,
        exclude: Sequence[str],
        gitignore: bool,
        *,
        may_read: Callable[[str], bool],
        where: Callable[[str], str],
    ) -> Pruner | None:
        """A pruner, or None when nothing is left out (the walk then asks nothing)."""
        if not exclude and not gitignore:
            return None
        return cls(exclude, gitignore, may_read=may_read, where=where)

    def leaves_out(self, rel: str, name: str, kind: paths.Kind) -> bool:
        """Whether the entry `rel` (its parents already kept) is left out."""
        if self._exclude is not None and self._exclude.matches_exactly(rel):
            return True
        if self._stack is None or name == ".git" or (self._in_git and self._in_git[-1]):
            return False
        return self._stack.ignored(os.fsencode(rel), os.fsencode(name), kind == "dir")

    def start(self, root_fd: int, parts: Sequence[str]) -> bool:
        """Before a walk of `parts`: enter every directory above it (reading their
        ignore files) and say whether the start itself is kept. Refuses what opening
        the path refuses (`symlink_refused`, `not_found`, ...)."""
        if self._exclude is not None and parts and self._exclude.matches("/".join(parts)):
            return False
        if self._stack is None:
            return True
        fd = paths.open_dir(root_fd, ())
        rel = ""
        try:
            for part in parts:
                self.enter(fd, rel, None)
                rel = f"{rel}/{part}" if rel else part
                if self.leaves_out(rel, part, "dir"):
                    return False
                child = paths.open_dir(fd, (part,), self._where(rel))
                os.close(fd)
                fd = child
        finally:
            os.close(fd)
        return True

    def enter(self, dir_fd: int, rel: str, names: Container[str] | None) -> None:
        """The walk entered directory `rel` (open as `dir_fd`; `names`: its entries, or
        None to look). Reads its `.gitignore`, and at a repository's top (a `.git`
        directory or file here) `.git/info/exclude`. Refuses `too_large` for an ignore
        file over `MAX_IGNORE_FILE_BYTES`, `limit_exceeded` past the per-call totals."""
        if self._stack is None:
            return
        in_git = (bool(self._in_git) and self._in_git[-1]) or rel.rsplit("/", 1)[-1] == ".git"
        self._in_git.append(in_git)
        if in_git:
            self._stack.push([], False)
            return
        base = os.fsencode(rel + "/" if rel else "")
        repository = (".git" in names) if names is not None else _exists(dir_fd, ".git")
        files: list[IgnoreFile] = []
        if repository:
            exclude = self._read_info_exclude(dir_fd, rel, base)
            if exclude is not None:
                files.append(exclude)
        if names is None or ".gitignore" in names:
            found = self._read(dir_fd, ".gitignore", f"{rel}/.gitignore" if rel else ".gitignore")
            if found is not None:
                files.append(self._parse(found, base, rel, ".gitignore"))
        self._stack.push(files, repository)

    def leave(self) -> None:
        """The walk left the directory last entered."""
        if self._stack is not None:
            self._in_git.pop()
            self._stack.pop()

    def _parse(self, data: bytes, base: bytes, rel: str, name: str) -> IgnoreFile:
        where = self._where(f"{rel}/{name}" if rel else name)
        rules = IgnoreFile.parse(data, base, where)
        self._patterns += rules.patterns
        if self._patterns > MAX_IGNORE_PATTERNS:
            raise LimitExceeded(
                f"{where}: more than {MAX_IGNORE_PATTERNS} ignore patterns in one call",
                limit=MAX_IGNORE_PATTERNS,
                scope="gitignore_patterns",
            )
        return rules

    def _read(self, dir_fd: int, name: str, rel: str) -> bytes | None:
        """The bytes of the ignore file `name` in `dir_fd`, or None when there is no
        regular file there (a symlink is never followed) or the read policy denies it."""
        if not self._may_read(rel):
            return None
        where = self._where(rel)
        try:
            _, data = fsops.read_regular(dir_fd, name, MAX_IGNORE_FILE_BYTES, where)
        except (NotFound, NotAFile, SymlinkRefused, PathDenied):
            return None  # not there, not a regular file, or not ours to read: git skips it too
        self._bytes += len(data)
        if self._bytes > MAX_IGNORE_BYTES:
            raise LimitExceeded(
                f"{where}: more than {MAX_IGNORE_BYTES} bytes of ignore files in one call",
                limit=MAX_IGNORE_BYTES,
                scope="gitignore_bytes",
            )
        return data

    def _read_info_exclude(self, dir_fd: int, rel: str, base: bytes) -> IgnoreFile | None:
        """`.git/info/exclude` of the repository whose top is `dir_fd`, when `.git` is a
        directory (a worktree's or submodule's `.git` file points elsewhere: not read)."""
        git_rel = f"{rel}/.git" if rel else ".git"
        try:
            with paths.opened_dir(dir_fd, (".git", "info"), self._where(git_rel)) as info:
                data = self._read(info, "exclude", f"{git_rel}/info/exclude")
        except (NotFound, SymlinkRefused, NotADirectory, PathDenied):
            return None
        if data is None:
            return None
        return self._parse(data, base, git_rel, "info/exclude")


def _exists(dir_fd: int, name: str) -> bool:
    return paths.lstat_at(dir_fd, name) is not None
