"""Workspace directories for tests: filled, owned by uid 1000, removed afterwards.

Temp dirs are short (`/tmp/sbst-*`) because a Unix socket path under them must fit in
108 bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.harness.waiting import wait_until

#: Workspaces in tests belong to this user, as agents' checkouts do (we run as root).
WORKSPACE_UID = 1000
WORKSPACE_GID = 1000

#: What a workspace holds unless a test says otherwise.
DEFAULT_FILES: dict[str, str | bytes] = {
    "README.md": "# demo\n\nhello\n",
    "src/main.py": "def main() -> None:\n    print('hello')\n",
    "src/util.py": "VALUE = 1\n",
    "data/blob.bin": bytes(range(256)) * 4,
}

#: A fixed commit id for fake `.git` dirs (no git is ever run).
FAKE_HEAD = "0123456789abcdef0123456789abcdef01234567"

_names = itertools.count(1)


def chown_tree(path: Path, uid: int = WORKSPACE_UID, gid: int = WORKSPACE_GID) -> None:
    """lchown `path` and everything beneath it (symlinks themselves, never their targets)."""
    os.lchown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def write_files(root: Path, files: Mapping[str, str | bytes]) -> None:
    """Write each `relative path: content` under `root`, making parent dirs."""
    for rel, content in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            target.write_text(content)
        else:
            target.write_bytes(content)


def write_fake_git(root: Path, head: str = FAKE_HEAD, branch: str = "main") -> None:
    """A `.git` dir with HEAD on `branch`, a loose ref and a config (no git needed)."""
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True, exist_ok=True)
    (git / "refs" / "tags").mkdir(parents=True, exist_ok=True)
    (git / "objects").mkdir(exist_ok=True)
    (git / "hooks").mkdir(exist_ok=True)
    (git / "HEAD").write_text(f"ref: refs/heads/{branch}\n")
    (git / "refs" / "heads" / branch).write_text(head + "\n")
    (git / "config").write_text(
        "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
    )


def create_workspace(
    adopt_root: Path,
    name: str | None = None,
    files: Mapping[str, str | bytes] | None = None,
    *,
    git: bool = False,
    owner: tuple[int, int] = (WORKSPACE_UID, WORKSPACE_GID),
) -> Path:
    """Make a workspace dir under `adopt_root` with `files` (default: a small tree)."""
    path = adopt_root / (name or f"ws-{next(_names)}")
    path.mkdir(parents=True)
    write_files(path, DEFAULT_FILES if files is None else files)
    if git:
        write_fake_git(path)
    chown_tree(path, *owner)
    return path


def short_tempdir(prefix: str = "sbst-") -> Path:
    """A fresh dir under /tmp with a short name (socket paths are limited to 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def remove_tree(path: Path) -> None:
    """rm -rf that also gets through dirs a test made unreadable or immutable-ish."""
    if not path.exists() and not path.is_symlink():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            with contextlib.suppress(OSError):
                p = os.path.join(dirpath, name)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)


#: The size of a `quiet_ext4` filesystem: room for a few small checkouts.
QUIET_FS_BYTES = 64 << 20


@contextlib.contextmanager
def quiet_ext4(where: Path) -> Iterator[Path]:
    """A directory on an ext4 filesystem of its own, loop-mounted at `where` (made if
    missing) for as long as the block runs, then unmounted and its image removed.

    For tests of what a reused inode inherits: ext4 hands a freed inode out again to the
    next directory made in the same group, unless another process takes it first; on the
    machine's own filesystem the daemon under test (its journal, its state dir) and
    anything else running can, so the reuse would depend on what else runs. Nothing but
    the test makes files here. The directory returned is beneath the filesystem's root
    (ext4 spreads top-level directories over groups at random, never a child's)."""
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sbst-fs-") as images:
        image = Path(images) / "ext4.img"
        with image.open("wb") as f:
            f.truncate(QUIET_FS_BYTES)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(where)], check=True)
        try:
            inside = where / "checkouts"
            inside.mkdir()
            yield inside
        finally:
            # A container's mount namespace may still hold it a moment: detach it then.
            done = subprocess.run(["umount", str(where)], check=False, capture_output=True)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(where)], check=True)


#: How many directories `reuse_inode` makes per try, and how long it keeps trying.
REUSE_TRIES = 1000
REUSE_WAIT_S = 30.0


def reuse_inode(old: Path, parent: Path, stem: str = "new") -> Path:
    """Remove `old` (a directory tree) and make directories in `parent` until one has the
    inode `old` had (ext4 hands a freed inode out again at once, once nothing holds it:
    a container's mount namespace may hold it a moment after the container is gone, so
    this tries again until `REUSE_WAIT_S`); the others are removed. Fails the test
    loudly when no reuse happens: a test of what a reused inode inherits must never
    pass because none was reused."""
    st = os.stat(old)
    shutil.rmtree(old)
    rounds = itertools.count()

    def attempt() -> Path | None:
        made: list[Path] = []
        n = next(rounds)
        try:
            for i in range(REUSE_TRIES):
                candidate = parent / f"{stem}-{n}-{i}"
                candidate.mkdir()
                cst = os.stat(candidate)
                if (cst.st_dev, cst.st_ino) == (st.st_dev, st.st_ino):
                    os.chown(candidate, WORKSPACE_UID, WORKSPACE_GID)
                    return candidate
                made.append(candidate)
            return None
        finally:
            for path in made:
                path.rmdir()

    found = wait_until(
        attempt,
        REUSE_WAIT_S,
        message=f"no directory got inode {st.st_ino} again ({REUSE_TRIES} per try)",
    )
    assert found is not None  # wait_until returns only something truthy
    return found
