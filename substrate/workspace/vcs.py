"""A checkout's git state, read from `.git` as plain files: git itself is never run.

So no hook, fsmonitor, filter or diff driver a checkout configures can run when
substrate reports where its HEAD is or decides whether a directory is a git directory.
Every file is opened beneath a held dir fd, never through a symlink, and read with a cap.
"""

from __future__ import annotations

import os
import re
import stat

from substrate.errors import Refusal
from substrate.fs import paths
from substrate.schema.workspace import Vcs

_SHA_RE = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_REF_RE = re.compile(r"^refs/[A-Za-z0-9._/-]{1,200}$")


def _read_small(dir_fd: int, name: str, limit: int = 1 << 20) -> bytes | None:
    try:
        fd = paths.open_regular(dir_fd, name, name)
    except Refusal:
        return None
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def read_vcs(root_fd: int) -> Vcs | None:
    """Read `.git/HEAD` (and the ref it names) as plain files; None when not a git checkout."""
    try:
        git_fd = paths.open_dir(root_fd, (".git",))
    except Refusal:
        return None
    try:
        head = _read_small(git_fd, "HEAD")
        if head is None:
            return None
        text = head.decode("utf-8", "replace").strip()
        if _SHA_RE.match(text):
            return Vcs(kind="git", head=text)
        if not text.startswith("ref:"):
            return Vcs(kind="git", head=None)
        ref = text[4:].strip()
        if not _REF_RE.match(ref) or ".." in ref.split("/"):
            return Vcs(kind="git", head=None)
        return Vcs(kind="git", head=_resolve_ref(git_fd, ref))
    finally:
        os.close(git_fd)


def _resolve_ref(git_fd: int, ref: str) -> str | None:
    *dirs, name = ref.split("/")
    try:
        with paths.opened_dir(git_fd, dirs) as ref_dir:
            loose = _read_small(ref_dir, name)
    except Refusal:
        loose = None
    if loose is not None:
        sha = loose.decode("ascii", "replace").strip()
        return sha if _SHA_RE.match(sha) else None
    packed = _read_small(git_fd, "packed-refs", 64 << 20)
    for line in (packed or b"").decode("utf-8", "replace").splitlines():
        parts = line.split(" ", 1)
        if len(parts) == 2 and parts[1] == ref and _SHA_RE.match(parts[0]):
            return parts[0]
    return None


def is_git_dir(dir_fd: int) -> bool:
    """True for a git directory by content, as git itself decides: a HEAD naming a ref or
    a commit, and `objects` and `refs` directories (a bare repository, a `.git`, a
    submodule's git dir under another name)."""
    head = _read_small(dir_fd, "HEAD", 256)
    if head is None:
        return False
    text = head.decode("utf-8", "replace").strip()
    if not (text.startswith("ref:") or _SHA_RE.match(text)):
        return False
    for name in ("objects", "refs"):
        st = paths.lstat_at(dir_fd, name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            return False
    return True
