"""What a sandbox mounts read-only over its workspace, and the empty resolver file.

Read-only over the workspace bind: the policy's whole-directory denies (`X/**`, found by
`substrate.workspace.gate.readonly_identities`, the same reading the write gate makes) and
every git directory at any depth — each `.git`, directory or file (worktrees,
submodules); each directory that is a git directory by content whatever its name (a
bare repository, a `--separate-git-dir` store: host git would run its config and hooks,
docs/confinement.md); and whatever a `.git` file names inside the checkout — found by a
bounded walk from the held root fd that never follows a symlink (`git_paths`). Each is
bound with its identity (st_dev, st_ino) taken now from the held fds; the sandbox is then
required to show exactly those identities (`identity_required`), so a path swapped
between this walk and the container's start is caught.

An empty read-only file is bound over `/etc/resolv.conf` (`empty_resolv_conf`): the
engine would otherwise copy the host's resolver (its name server address) into a sandbox
that has no network.

Blocking (directory walks, lstat, file creation): callers use worker threads.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Collection, Sequence
from pathlib import Path

from substrate.errors import ConfinementUnmet, LimitExceeded, Refusal
from substrate.fs.paths import open_dir
from substrate.sandbox.facts import FactValue
from substrate.sandbox.profiles import Profile
from substrate.workspace import discoverable
from substrate.workspace.gate import readonly_identities
from substrate.workspace.registry import Workspace

#: At most this many `.git` paths get a read-only mount in one sandbox; more is refused
#: (`limit_exceeded`): a checkout with that many nested repositories is not supported.
MAX_GIT_PATHS = 128
#: The `.git` search reads at most this many directory entries, and goes this deep;
#: past either the sandbox is refused (`limit_exceeded`) rather than left unprotected.
MAX_GIT_WALK_ENTRIES = 1_000_000
MAX_GIT_WALK_DEPTH = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def readonly_paths(ws: Workspace, profile: Profile) -> list[tuple[str, tuple[int, int]]]:
    """Paths to bind read-only over the workspace, with their (st_dev, st_ino), sorted:
    the policy's read-only dirs that exist as a real directory or regular file (no
    symlink anywhere on the way, the last component included), and every git directory
    at any depth (`git_paths`). None for a profile that mounts no workspace.

    A regular file counts because `.git` is a file in a git worktree or submodule (it
    names the real git dir): it is bound read-only like a directory would be. Refuses
    as `git_paths` does. Cost: the policy's few lstats plus the `.git` walk.
    """
    if profile.workspace == "none":
        return []
    found = readonly_identities(ws)
    gits = git_paths(ws.root_fd, found, ws.checkout_path)
    found |= {rel: ident for rel, ident in gits if rel not in found}
    return sorted(found.items())


def identity_required(
    profile: Profile,
    readonly: Sequence[tuple[str, tuple[int, int]]],
    owner: os.stat_result,
) -> dict[str, FactValue]:
    """The mounts must be *our* directories: `workspace_identity` facts required from the
    (st_dev, st_ino) of the held root (`owner`, its fstat) and of each read-only path."""
    if profile.workspace == "none":
        return {}
    found: dict[str, FactValue] = {"workspace_identity": f"{owner.st_dev}:{owner.st_ino}"}
    for rel, (dev, ino) in readonly:
        found[f"workspace_identity:{rel}"] = f"{dev}:{ino}"
    return found


def git_paths(
    root_fd: int, skip: Collection[str] = (), checkout_path: str | None = None
) -> list[tuple[str, tuple[int, int]]]:
    """Every git directory beneath `root_fd` as (workspace-relative path, (st_dev,
    st_ino)), sorted: each `.git` that is a directory or a regular file, each directory
    that is a git directory by content whatever its name (`discoverable.completes`: a
    bare repository, a `--separate-git-dir` store, a submodule's git dir), and the
    directory a `.git` file names inside the checkout (`discoverable.gitfile_target`,
    read bounded by dir fd; `checkout_path` places an absolute one). Nothing inside
    another one is listed (its mount covers it). Blocking.

    Walks from the held root fd with `O_NOFOLLOW | O_DIRECTORY` opens, one fd per level
    (never one per pending directory): never follows a symlink, never enters a `.git`
    or a git directory by content (its mount covers it) nor a directory in `skip`
    (mounted read-only whole already). Refuses `limit_exceeded` past `MAX_GIT_PATHS`
    found, `MAX_GIT_WALK_ENTRIES` entries read or `MAX_GIT_WALK_DEPTH` levels (a
    sandbox is refused rather than left with a writable git directory), and
    `confinement_unmet` for one whose path is not UTF-8 (the engine's API cannot name
    it, so it cannot be mounted). Cost: one `scandir` per directory, about 13 ms per
    10,000 entries (warm page cache), plus a bounded read per `.git` file.
    """
    found: list[tuple[str, tuple[int, int]]] = []
    targets: list[tuple[str, ...]] = []
    seen = 0

    def scan(dir_fd: int, prefix: str) -> list[str]:
        nonlocal seen
        subdirs: list[str] = []
        pieces: set[str] = set()
        with os.scandir(dir_fd) as it:
            for entry in it:
                seen += 1
                if seen > MAX_GIT_WALK_ENTRIES:
                    raise LimitExceeded(
                        f"the workspace has more than {MAX_GIT_WALK_ENTRIES} entries to "
                        "search for .git directories",
                        limit=MAX_GIT_WALK_ENTRIES,
                    )
                rel = prefix + entry.name
                if entry.name in discoverable.PIECES:
                    pieces.add(entry.name)
                if entry.name == ".git":
                    if _add_git(found, rel, entry):
                        target = discoverable.gitfile_target(
                            dir_fd, entry.name, prefix.rstrip("/"), checkout_path
                        )
                        if target is not None:
                            targets.append(target)
                elif entry.is_dir(follow_symlinks=False) and rel not in skip:
                    subdirs.append(entry.name)
        if prefix and discoverable.completes(pieces):
            st = os.fstat(dir_fd)
            _add(found, prefix.rstrip("/"), (st.st_dev, st.st_ino))
            return []  # its mount covers everything in it
        return subdirs

    # Each level: (its fd, its prefix, its subdirectories still to visit).
    stack: list[tuple[int, str, list[str]]] = []
    try:
        top = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
        stack.append((top, "", []))
        stack[-1][2].extend(scan(top, ""))
        while stack:
            dir_fd, prefix, todo = stack[-1]
            if not todo:
                os.close(dir_fd)
                stack.pop()
                continue
            name = todo.pop()
            if len(stack) >= MAX_GIT_WALK_DEPTH:
                raise LimitExceeded(
                    f"the workspace is more than {MAX_GIT_WALK_DEPTH} directories deep",
                    limit=MAX_GIT_WALK_DEPTH,
                )
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue  # swapped for a symlink or gone meanwhile: never followed
            stack.append((child, f"{prefix}{name}/", []))
            stack[-1][2].extend(scan(child, f"{prefix}{name}/"))
    finally:
        for dir_fd, _, _ in stack:
            os.close(dir_fd)
    for parts in targets:
        _add_target(found, root_fd, parts, skip)
    return _outermost(found)


def _add_target(
    found: list[tuple[str, tuple[int, int]]],
    root_fd: int,
    parts: tuple[str, ...],
    skip: Collection[str],
) -> None:
    """The directory a `.git` file names, when it is a real one in the checkout (opened
    beneath the root, no symlink followed) not covered already."""
    rel = "/".join(parts)
    covered = {r for r, _ in found} | set(skip)
    if any(rel == c or rel.startswith(c + "/") for c in covered):
        return
    try:
        fd = open_dir(root_fd, parts, rel)
    except Refusal:
        return  # missing or through a symlink: git dirs by content were found anyway
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    _add(found, rel, (st.st_dev, st.st_ino))


def _outermost(found: list[tuple[str, tuple[int, int]]]) -> list[tuple[str, tuple[int, int]]]:
    """`found` sorted, without the paths inside another of them."""
    out: list[tuple[str, tuple[int, int]]] = []
    for rel, ident in sorted(found):
        if not any(rel.startswith(kept + "/") for kept, _ in out):
            out.append((rel, ident))
    return out


def _add_git(found: list[tuple[str, tuple[int, int]]], rel: str, entry: os.DirEntry[str]) -> bool:
    """Add a `.git` that is a directory or regular file; True when it is a file."""
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return False  # a symlink named .git points elsewhere in the sandbox's own view
    _add(found, rel, (st.st_dev, st.st_ino))
    return stat.S_ISREG(st.st_mode)


def _add(found: list[tuple[str, tuple[int, int]]], rel: str, ident: tuple[int, int]) -> None:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfinementUnmet(
            "a git directory in the workspace lies under a directory whose name is not "
            "UTF-8: it cannot be mounted read-only (rename that directory)",
            required={"readonly_dirs": "every .git"},
            observed={"readonly_dirs": "a .git under a name that is not UTF-8"},
        ) from None
    found.append((rel, ident))
    if len(found) > MAX_GIT_PATHS:
        raise LimitExceeded(
            f"the workspace has more than {MAX_GIT_PATHS} .git directories or files",
            limit=MAX_GIT_PATHS,
        )


#: The empty file bound over /etc/resolv.conf (in the daemon's `files_dir`).
RESOLV_CONF_NAME = "resolv.conf"


def empty_resolv_conf(files_dir: Path) -> str:
    """The host path of an empty, read-only resolver file for sandboxes, made (or made
    empty again) in `files_dir` (0700, under the state dir). Blocking."""
    files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(files_dir, 0o700)
    target = files_dir / RESOLV_CONF_NAME
    st = None
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(target)
    if (
        st is None
        or not stat.S_ISREG(st.st_mode)
        or st.st_size
        or stat.S_IMODE(st.st_mode) != 0o444
    ):
        temp = files_dir / f".{RESOLV_CONF_NAME}.{secrets.token_hex(4)}"
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444
        )
        os.fchmod(fd, 0o444)
        os.close(fd)
        os.rename(temp, target)
    return str(target)
