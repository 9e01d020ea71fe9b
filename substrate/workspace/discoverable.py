"""What a person's host tools would find in a checkout: git dirs by content, misleading names.

What a person's host tools would find in a checkout that substrate wrote: git
directories by content, and names that mislead (docs/confinement.md, "What host tools
discover").

Theory of operation. Git does not need a `.git` to take a directory for a repository:
run inside any directory, it walks up and, at each level, asks `is_git_directory` of the
directory itself (a bare repository) before looking for a `.git`. That test is a `HEAD`
(a file or symlink), an `objects` and a `refs` it may enter — or, for a worktree's
admin dir, a `HEAD` and a `commondir` naming where `objects` and `refs` are. A directory
that passes is read as a repository: its `config` (`core.fsmonitor`, `core.worktree`,
hooks) runs on the person's host the next time they run git beneath it. So no guarded
write may land *beneath* a directory that is, or once the write is made would be, a git
directory by content — whatever its name — and a `.git` file's target is one such
directory (git refuses a target that fails the test).

The rule is conservative where git is precise: any kind of entry counts as a piece
(`access(X_OK)` passes for an executable file named `objects`, and a directory `HEAD`
may become a file later), `HEAD`'s bytes are not read, and `commondir` counts as the
`objects`+`refs` pair. What it costs a project: a checkout holding bare repositories as
test fixtures cannot have them changed through substrate (the person changes them).

`completes` is the pure test; `GitDirs` applies it beneath a held root fd, remembering
the pieces a batch has planned so that pieces arriving together count together. Every
guarded write asks `GitDirs.check` (`substrate.workspace.writes`: `writer`, `upload`,
`batch_files`, `batch_dirs`); a change set is screened whole first (`screen`, from the
layer's scan), so that none of the pieces that would complete a git directory lands.

Names: a new name holding a control character (C0, DEL, C1) or a bidirectional control
misleads line-based tools and reviewers (a newline splits a path in two, U+202E shows
`txt.exe` as `exe.txt`). No write path creates one (`check_new_names`: `path_invalid`
with `reason`); a file that already has such a name stays readable and writable.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Collection, Iterable, Sequence

from substrate.errors import PathDenied, PathInvalid, Refusal
from substrate.fs import paths
from substrate.schema.changes import Change
from substrate.workspace.policy import is_git_path

HEAD = "HEAD"
#: The entries git's `is_git_directory` looks for in a directory.
PIECES = frozenset({HEAD, "objects", "refs", "commondir"})
#: The refusal reason (`data.reason`) and the change sets' blocked reason.
GIT_DIR = "git_dir"
CONTROL_CHARACTER = "control_character"
BIDI_CONTROL = "bidi_control"
#: The most of a `.git` file read to find its target (git's own are a line).
MAX_GITFILE_BYTES = 4096

_BIDI = frozenset(
    {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)},
)


def completes(names: Collection[str]) -> bool:
    """Do `names` (entries of one directory) make it a git directory by content? A
    `HEAD` with `objects` and `refs`, or with `commondir`. Pure."""
    return HEAD in names and (("objects" in names and "refs" in names) or "commondir" in names)


def name_problem(name: str) -> tuple[str, str] | None:
    """(reason, "U+XXXX") of the first character of `name` no new name may hold: a
    control character (C0, DEL, C1: `control_character`) or a bidirectional control
    (`bidi_control`); None when it has none. Pure; linear in the name."""
    for c in name:
        code = ord(c)
        if code < 0x20 or 0x7F <= code <= 0x9F:
            return CONTROL_CHARACTER, f"U+{code:04X}"
        if code in _BIDI:
            return BIDI_CONTROL, f"U+{code:04X}"
    return None


def check_new_names(names: Iterable[str], where: str) -> None:
    """Refuse `path_invalid` (`reason`, `character`) when a name about to be created
    holds a character `name_problem` names."""
    for name in names:
        problem = name_problem(name)
        if problem is not None:
            reason, char = problem
            raise PathInvalid(
                f"{where}: a new name may not hold the control character {char}",
                reason=reason,
                character=char,
            )


def git_dir_refusal(where: str, git_dir: str) -> PathDenied:
    return PathDenied(
        f"{where}: {git_dir} is, or would be, a git directory by content: host git would "
        "run its config",
        reason=GIT_DIR,
        git_dir=git_dir,
    )


class GitDirs:
    """Which directories beneath the held `root_fd` are git directories by content, for
    one write or one batch. What each directory holds is looked up once (an open beneath
    the root, never through a symlink, and an lstat per piece) and kept; the pieces the
    batch plans (`add`) count as there. The root is looked at through `root_fd` itself,
    and a directory the caller holds already (`held`: its components → an fd opened
    beneath the root without following a symlink, as a write's parent is) through that
    fd, so neither is opened again."""

    def __init__(self, root_fd: int, held: dict[tuple[str, ...], int] | None = None) -> None:
        self._root = root_fd
        self._held: dict[tuple[str, ...], int] = {(): root_fd, **(held or {})}
        self._now: dict[tuple[str, ...], frozenset[str] | None] = {}
        self._added: dict[tuple[str, ...], set[str]] = {}
        self._removed: dict[tuple[str, ...], set[str]] = {}

    def _pieces(self, dirs: tuple[str, ...]) -> frozenset[str] | None:
        """The pieces directory `dirs` holds now; None when it is not a directory
        reached without a symlink (a missing parent's children are missing too)."""
        if dirs in self._now:
            return self._now[dirs]
        found: frozenset[str] | None
        if dirs and self._pieces(dirs[:-1]) is None:
            found = None
        elif (held := self._held.get(dirs)) is not None:
            found = frozenset(p for p in PIECES if paths.lstat_at(held, p) is not None)
        else:
            try:
                fd = paths.open_dir(self._root, dirs, "/".join(dirs) or ".")
            except Refusal:
                found = None
            else:
                try:
                    found = frozenset(p for p in PIECES if paths.lstat_at(fd, p) is not None)
                finally:
                    os.close(fd)
        self._now[dirs] = found
        return found

    def beneath(self, parts: Sequence[str]) -> str | None:
        """The directory (relative, `.` for the root) that `parts` lies beneath and that
        is a git directory by content now, or would be once `parts` exists (with the
        pieces added, less those removed); None when there is none. Costs, per directory
        on the way not looked at yet, four lstats (and an open, unless it is held)."""
        for i in range(len(parts)):
            dirs = tuple(parts[:i])
            now = self._pieces(dirs) or frozenset()
            after = (now - self._removed.get(dirs, set())) | self._added.get(dirs, set())
            if parts[i] in PIECES:
                after = after | {parts[i]}
            if completes(now) or completes(after):
                return "/".join(dirs) or "."
        return None

    def check(self, parts: Sequence[str], where: str) -> None:
        """Refuse `path_denied` (`reason: "git_dir"`, `git_dir`) when `beneath` names a
        directory."""
        found = self.beneath(parts)
        if found is not None:
            raise git_dir_refusal(where, found)

    def add(self, parts: Sequence[str]) -> None:
        """Count every piece on `parts` as there from now on (a change planned to land)."""
        for i, name in enumerate(parts):
            if name in PIECES:
                self._added.setdefault(tuple(parts[:i]), set()).add(name)

    def remove(self, parts: Sequence[str]) -> None:
        """Count the piece `parts` names as gone (a delete planned to land)."""
        if parts and parts[-1] in PIECES:
            self._removed.setdefault(tuple(parts[:-1]), set()).add(parts[-1])


def screen(
    changes: Sequence[Change], lower_fd: int
) -> tuple[list[Change], list[tuple[Change, str]]]:
    """A change set screened whole against the checkout `lower_fd` before it is kept
    or applied: (the changes that may go on, [(change, reason)] blocked). Blocked:
    every change beneath a directory that is a git directory by content now or would be
    once the whole set landed (`git_dir`: the pieces that would complete it and what
    the set puts in it), and every change creating a name `name_problem` refuses, or
    creating something beneath a directory the set makes with one (its reason). The
    guarded path checks each change again as it lands. Costs, per directory holding a
    change, an open and four lstats."""
    dirs = GitDirs(lower_fd)
    made = {c.path for c in changes if c.op == "mkdir"}
    for change in changes:
        parts = change.path.split("/")
        if change.op == "delete":
            dirs.remove(parts)
        else:
            dirs.add(parts)
    kept: list[Change] = []
    blocked: list[tuple[Change, str]] = []
    for change in changes:
        parts = change.path.split("/")
        reason = None
        if is_git_path(change.path):
            pass  # the policy's own `.git/**` blocks it as it always has
        elif dirs.beneath(parts) is not None:
            reason = GIT_DIR
        else:
            new = [
                name
                for i, name in enumerate(parts)
                if "/".join(parts[: i + 1]) in made
                or (i == len(parts) - 1 and change.op == "create")
            ]
            problems = [found for found in map(name_problem, new) if found is not None]
            reason = problems[0][0] if problems else None
        if reason is None:
            kept.append(change)
        else:
            blocked.append((change, reason))
    return kept, blocked


def gitfile_target(
    dir_fd: int, name: str, prefix: str, checkout_path: str | None
) -> tuple[str, ...] | None:
    """Where the `.git` *file* `name` in `dir_fd` (the directory `prefix`, relative to
    the checkout, "" for the root) points inside the checkout: its components relative
    to the checkout root, or None when it is not a regular file, names no `gitdir:`, or
    points outside (resolved lexically; an absolute target counts as inside only beneath
    `checkout_path`). Read bounded (`MAX_GITFILE_BYTES`) through `dir_fd`, never
    following a symlink; git is never run. What stands at the target is not looked at.
    """
    try:
        fd = paths.open_regular(dir_fd, name, name)
    except Refusal:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_GITFILE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = data.decode("utf-8", "surrogateescape")
    first = text.split("\n", 1)[0].rstrip("\r \t")
    if not first.startswith("gitdir:"):
        return None
    target = first[len("gitdir:") :].strip()
    if not target or "\x00" in target:
        return None
    if target.startswith("/"):
        if checkout_path is None:
            return None
        top = checkout_path.rstrip("/") + "/"
        norm = posixpath.normpath(target)
        if not norm.startswith(top):
            return None
        rel = norm[len(top) :]
    else:
        rel = posixpath.normpath(posixpath.join(prefix, target))
        if rel == "." or rel == ".." or rel.startswith("../"):
            return None
    parts = tuple(p for p in rel.split("/") if p)
    return parts or None


def check_write(
    dirs: GitDirs, parts: Sequence[str], where: str, created: Iterable[str] = ()
) -> None:
    """The check every guarded write makes of its path, after the policy's: `created`
    (the names it makes: a new target, missing parents) hold no control character
    (`check_new_names`), and `parts` lies beneath no git directory by content, nor
    completes one (`GitDirs.check`). Refuses `path_invalid` or `path_denied`, each with
    `reason`."""
    check_new_names(created, where)
    dirs.check(parts, where)


#: The `data.reason` of the refusals this module makes.
REASONS = frozenset({GIT_DIR, CONTROL_CHARACTER, BIDI_CONTROL})


def blocked_reason(refusal: Refusal | None) -> str | None:
    """The reason a change set or a restore lists a change `blocked` for, when the
    refusal is one of this module's (`git_dir`, `control_character`, `bidi_control`)."""
    if isinstance(refusal, (PathDenied, PathInvalid)):
        reason = refusal.data.get("reason")
        if reason in REASONS:
            return str(reason)
    return None
