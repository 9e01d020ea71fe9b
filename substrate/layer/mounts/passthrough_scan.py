"""What a command left in its passthrough dirs that the guarded path would never have made
(docs/working-layer.md, "Passthrough: ungoverned, then looked at").

Theory of operation. A passthrough bind takes the sandbox's writes straight into the
checkout: no policy, no base, no set-id stripping, no refusal of links or special files.
What the guarded path refuses cannot be undone without deleting a person's files, so
after each command (at its generation's conclusion) the bound dirs are walked, bounded
(`MAX_ENTRIES`, `MAX_DEPTH`), from the held root fd without following a symlink, and
each finding is reported (`changes.blocked`, `rule: "passthrough"`):
- `git_dir`: a `.git` that is not one of the sandbox's read-only parts, or a directory
  that is a git directory by content (`discoverable.completes`). Host git would run its
  config: **neutralised** when the sandbox made it (its `HEAD`, or the `.git` file,
  changed since the generation began): that one entry is made mode 000, so git no
  longer takes the directory for a repository (nothing is deleted; the person can
  chmod it back). The walk does not enter it.
- `setid`: a regular file with a set-uid or set-gid bit: **neutralised** (the bits
  cleared, as a guarded write clears them) when it changed since the generation began.
- `symlink`, `hard_link`, `fifo`, `socket`, `device`: reported only, when they changed
  since the generation began; removing them would delete what may be the person's.
- `unscanned`: the walk stopped at a bound; what lies past it was not looked at.

Size is not governed there (caches hold big files). Attribution is by ctime, the
working layer's own rule (`working_layer.begin`): a host change in the same window is
treated as the sandbox's, which here only ever clears bits. Blocking: worker threads.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from substrate.errors import Refusal
from substrate.fs.paths import open_dir
from substrate.workspace import discoverable

#: Entries looked at per conclusion, over every passthrough dir, and directory depth.
MAX_ENTRIES = 200_000
MAX_DEPTH = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SETID = stat.S_ISUID | stat.S_ISGID


@dataclass(frozen=True)
class Finding:
    """One thing found: its workspace-relative path, why (see the module doc), and the
    mode it was left with when neutralised (None: reported only)."""

    path: str
    reason: str
    mode: int | None = None


def _kind_reason(st: os.stat_result) -> str | None:
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return None


def _chmod(dir_fd: int, name: str, st: os.stat_result, mode: int) -> bool:
    """Set `name`'s mode to `mode` if it is still the regular file `st` (opened without
    following a symlink, identity re-checked); True when done."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            return False
        os.fchmod(fd, mode)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _neutralise_git(dir_fd: int, name: str, since_ns: int) -> int | None:
    """Make the git dir `name` in `dir_fd` (or the `.git` file `name`) undiscoverable
    when the sandbox made it: its `HEAD` (or the file itself) to mode 000 if changed
    since `since_ns`. The mode left, or None when nothing was done."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        target_dir, target, tst = dir_fd, name, st
        sub = None
    elif stat.S_ISDIR(st.st_mode):
        try:
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            return None
        target_dir, target = sub, discoverable.HEAD
        try:
            tst = os.stat(target, dir_fd=sub, follow_symlinks=False)
        except OSError:
            os.close(sub)
            return None
    else:
        return None
    try:
        if tst.st_ctime_ns < since_ns or not stat.S_ISREG(tst.st_mode):
            return None
        return 0 if _chmod(target_dir, target, tst, 0) else None
    finally:
        if sub is not None:
            os.close(sub)


def inspect(
    root_fd: int, dirs: Sequence[str], since_ns: int, readonly: Collection[str] = ()
) -> list[Finding]:
    """Walk the passthrough `dirs` (workspace-relative) beneath `root_fd` and report and
    neutralise what the module doc says, in walk order. `since_ns`: when the generation
    began (ctime attribution); `readonly`: the read-only parts (git dirs that existed
    when it was mounted: not findings). Never raises for what it meets; a directory it
    cannot open (gone, swapped for a symlink) is skipped. Each directory is opened
    beneath the root when its turn comes, so one fd is held at a time. Costs an open
    and a `scandir` per directory and an lstat per entry, about 13 ms per 10,000
    entries, plus a chmod per neutralised entry."""
    found: list[Finding] = []
    budget = MAX_ENTRIES
    stack: list[tuple[str, int]] = [(top, 0) for top in reversed(dirs)]
    while stack and budget > 0:
        rel, depth = stack.pop()
        try:
            dir_fd = open_dir(root_fd, rel.split("/"), rel)
        except Refusal:
            continue
        try:
            budget = _scan_dir(dir_fd, rel, depth, since_ns, readonly, found, stack, budget)
        except OSError:
            continue
        finally:
            os.close(dir_fd)
        if budget <= 0:
            found.append(Finding(path=rel, reason="unscanned"))
    return found


def _scan_dir(
    dir_fd: int,
    rel: str,
    depth: int,
    since_ns: int,
    readonly: Collection[str],
    found: list[Finding],
    stack: list[tuple[str, int]],
    budget: int,
) -> int:
    """One directory of `inspect`'s walk; the entries left in the budget."""
    with os.scandir(dir_fd) as it:
        entries = sorted(it, key=lambda e: e.name)  # a deterministic order of findings
    if discoverable.completes({e.name for e in entries}):
        # The directory itself is a repository by content: neutralise its HEAD.
        if rel not in readonly:
            mode = _neutralise_git(dir_fd, ".", since_ns)
            found.append(Finding(path=rel, reason=discoverable.GIT_DIR, mode=mode))
        return budget - len(entries)
    for entry in entries:
        budget -= 1
        if budget <= 0:
            return budget
        path = f"{rel}/{entry.name}"
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.name == ".git":
            if path not in readonly:
                mode = _neutralise_git(dir_fd, ".git", since_ns)
                found.append(Finding(path, discoverable.GIT_DIR, mode))
            continue
        fresh = st.st_ctime_ns >= since_ns
        reason = _kind_reason(st)
        if reason is not None:
            if fresh:
                found.append(Finding(path, reason))
        elif stat.S_ISREG(st.st_mode) and st.st_mode & _SETID:
            mode = stat.S_IMODE(st.st_mode) & ~_SETID
            done = fresh and _chmod(dir_fd, entry.name, st, mode)
            found.append(Finding(path, "setid", mode if done else None))
        elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            if fresh:
                found.append(Finding(path, "hard_link"))
        elif stat.S_ISDIR(st.st_mode) and depth + 1 < MAX_DEPTH:
            stack.append((path, depth + 1))
        elif stat.S_ISDIR(st.st_mode):
            found.append(Finding(path, "unscanned"))
    return budget
