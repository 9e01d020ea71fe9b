"""Snapshots of a directory tree, to prove that nothing in it changed."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any


def snapshot_tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under `root` (root included as "."), never following a symlink.

    Values: (kind, mode, uid, gid[, content sha256 and inode | link target]). Equal
    snapshots mean no name, byte, mode, owner or file identity changed. Reads every
    file whole: cost is the tree's size.
    """
    out: dict[str, tuple[Any, ...]] = {}

    def entry(path: str, rel: str) -> None:
        st = os.lstat(path)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("symlink", mode, st.st_uid, st.st_gid, os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            out[rel] = ("file", mode, st.st_uid, st.st_gid, digest, st.st_ino)
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", mode, st.st_uid, st.st_gid)
        else:
            out[rel] = ("other", stat.S_IFMT(st.st_mode), mode, st.st_uid, st.st_gid)

    entry(str(root), ".")
    if not os.path.isdir(root) or os.path.islink(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            entry(full, os.path.relpath(full, root))
    return out
