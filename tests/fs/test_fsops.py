"""substrate.fs.fsops: the file-system primitives beneath a dir fd, on a temp dir."""

from __future__ import annotations

import errno
import os
import resource
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import SymlinkRefused, TooLarge
from substrate.fs import fsops


@pytest.fixture
def top(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, fsops.DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def test_make_dirs_gives_the_exact_mode_whatever_the_umask(top: int, tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        fd = fsops.make_dirs(top, ("a", "b"), "a/b", lambda i: (0o755 if i else 0o750, None))
    finally:
        os.umask(old)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o755


def test_make_dirs_never_follows_a_symlink(top: int, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "a").symlink_to(elsewhere)
    with pytest.raises(SymlinkRefused):
        fsops.make_dirs(top, ("a", "b"), "a/b", lambda i: (0o755, None))
    assert list(elsewhere.iterdir()) == []


def test_write_new_never_writes_through_a_planted_symlink(top: int, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    (tmp_path / "new").symlink_to(victim)
    with pytest.raises(FileExistsError):
        fsops.write_new(top, "new", b"x", mode=0o600)
    assert victim.read_text() == "untouched\n"


def test_atomic_write_replaces_with_mode_and_mtime_and_leaves_no_temp(
    top: int, tmp_path: Path
) -> None:
    (tmp_path / "f").write_text("old\n")
    fsops.atomic_write(top, "f", b"new\n", mode=0o640, mtime_ns=1_000_000_000)
    st = os.stat(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"new\n"
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o640, 1_000_000_000)
    assert os.listdir(tmp_path) == ["f"]


def test_read_fd_is_capped(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert fsops.read_fd(fd, 100) == b"x" * 100
        assert fsops.read_fd(fd, 99) is None
        # A file larger than it was said to be (it grew) is read whole, or refused.
        assert fsops.read_fd(fd, 100, expected=10) == b"x" * 100
        assert fsops.read_fd(fd, 50, expected=10) is None
    finally:
        os.close(fd)


def test_read_regular_refuses_over_the_cap(top: int, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    st, data = fsops.read_regular(top, "f", 3, "f")
    assert (st.st_size, data) == (3, b"abc")
    with pytest.raises(TooLarge):
        fsops.read_regular(top, "f", 2, "f")


def test_remove_tree_unlinks_symlinks_never_their_targets(top: int, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("kept\n")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "file").write_text("x")
    (tree / "a" / "b" / "to-dir").symlink_to(outside)
    (tree / "to-file").symlink_to(outside / "keep.txt")
    fsops.remove_tree(top, "tree")
    assert not tree.exists()
    assert (outside / "keep.txt").read_text() == "kept\n"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_remove_tree_of_any_depth_holds_one_dir_fd(top: int, tmp_path: Path) -> None:
    """Deeper than the recursion limit, under an fd limit far below the depth."""
    depth = sys.getrecursionlimit() + 1000
    os.mkdir("deep", dir_fd=top)
    fd = os.open("deep", fsops.DIR_FLAGS, dir_fd=top)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", fsops.DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + 20, hard))
    try:
        fsops.remove_tree(top, "deep")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert os.listdir(tmp_path) == []


def test_climb_refuses_a_directory_moved_away(top: int, tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    a = os.open("a", fsops.DIR_FLAGS, dir_fd=top)
    b = os.open("b", fsops.DIR_FLAGS, dir_fd=a)
    try:
        up = fsops.climb(b, fsops.identity(a))
        os.close(up)
        os.rename(tmp_path / "a" / "b", tmp_path / "c" / "b")
        with pytest.raises(OSError) as info:
            fsops.climb(b, fsops.identity(a))
        assert info.value.errno == errno.ESTALE
    finally:
        os.close(a)
        os.close(b)
