"""`substrate.sandbox.mounts` without Docker: which paths a sandbox gets read-only, and the
empty resolver file bound over /etc/resolv.conf."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import ConfinementUnmet, LimitExceeded
from substrate.sandbox import mounts
from substrate.sandbox.mounts import empty_resolv_conf, git_paths


@pytest.fixture
def root(tmp_path: Path) -> Path:
    made = tmp_path / "ws"
    made.mkdir()
    return made


@pytest.fixture
def root_fd(root: Path) -> Iterator[int]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def identity(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def test_every_git_at_any_depth_is_found_never_through_a_symlink(
    tmp_path: Path, root: Path, root_fd: int
) -> None:
    (root / ".git" / "modules" / "sub" / ".git").mkdir(parents=True)  # inside: covered
    (root / "vendor" / "lib" / ".git").mkdir(parents=True)
    (root / "mod" / "sub").mkdir(parents=True)
    (root / "mod" / "sub" / ".git").write_text("gitdir: ../../.git/modules/sub\n")
    (root / "deep" / "a" / "b" / ".git").mkdir(parents=True)
    (root / "skipped" / ".git").mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / ".git").mkdir(parents=True)
    os.symlink(outside, root / "link")  # never followed
    os.symlink(outside / ".git", root / "deep" / ".git")  # a symlink named .git: not a dir
    found = git_paths(root_fd, skip={"skipped"})
    assert found == [
        (".git", identity(root / ".git")),
        ("deep/a/b/.git", identity(root / "deep" / "a" / "b" / ".git")),
        ("mod/sub/.git", identity(root / "mod" / "sub" / ".git")),
        ("vendor/lib/.git", identity(root / "vendor" / "lib" / ".git")),
    ]


def test_git_dirs_by_content_and_gitfile_targets_are_found(root: Path, root_fd: int) -> None:
    # `git init --separate-git-dir=<checkout>/gitstore`: `.git` is a file naming it.
    for name in ("objects", "refs", "hooks"):
        (root / "gitstore" / name).mkdir(parents=True)
    (root / "gitstore" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".git").write_text("gitdir: gitstore\n")
    # A bare repository under any name; what is inside it is covered by its mount.
    for name in ("HEAD", "objects", "refs"):
        (root / "fixtures" / "bare" / name).mkdir(parents=True)
    (root / "fixtures" / "bare" / "refs" / ".git").mkdir()
    # A `.git` file naming, by absolute path, a directory that is no git dir (yet).
    (root / "wt" / "store").mkdir(parents=True)
    (root / "wt" / ".git").write_text(f"gitdir: {root}/wt/store\n")
    (root / "other").mkdir()
    (root / "other" / ".git").write_text("gitdir: /elsewhere/repo\n")  # outside: not ours
    found = git_paths(root_fd, checkout_path=str(root))
    assert found == [
        (".git", identity(root / ".git")),
        ("fixtures/bare", identity(root / "fixtures" / "bare")),
        ("gitstore", identity(root / "gitstore")),
        ("other/.git", identity(root / "other" / ".git")),
        ("wt/.git", identity(root / "wt" / ".git")),
        ("wt/store", identity(root / "wt" / "store")),
    ]


def test_the_search_is_bounded_with_a_named_refusal(
    root: Path, root_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(3):
        (root / f"r{i}" / ".git").mkdir(parents=True)
    monkeypatch.setattr(mounts, "MAX_GIT_PATHS", 2)
    with pytest.raises(LimitExceeded):
        git_paths(root_fd)
    monkeypatch.setattr(mounts, "MAX_GIT_PATHS", 10)
    monkeypatch.setattr(mounts, "MAX_GIT_WALK_ENTRIES", 4)
    with pytest.raises(LimitExceeded):
        git_paths(root_fd)
    monkeypatch.setattr(mounts, "MAX_GIT_WALK_ENTRIES", 1000)
    (root / "a" / "b" / "c").mkdir(parents=True)
    monkeypatch.setattr(mounts, "MAX_GIT_WALK_DEPTH", 2)
    with pytest.raises(LimitExceeded):
        git_paths(root_fd)


def test_a_git_under_a_name_that_is_not_utf8_is_refused(root: Path, root_fd: int) -> None:
    os.makedirs(os.fsencode(root) + b"/d\xff/.git")
    with pytest.raises(ConfinementUnmet):
        git_paths(root_fd)


def test_the_resolver_file_is_empty_and_read_only(tmp_path: Path) -> None:
    files = tmp_path / "sandbox-files"
    path = Path(empty_resolv_conf(files))
    st = os.lstat(path)
    assert (st.st_size, stat.S_IMODE(st.st_mode)) == (0, 0o444)
    assert stat.S_IMODE(os.lstat(files).st_mode) == 0o700
    os.chmod(path, 0o644)
    path.write_text("nameserver 10.0.0.1\n")
    assert Path(empty_resolv_conf(files)) == path
    assert path.read_bytes() == b"" and stat.S_IMODE(os.lstat(path).st_mode) == 0o444
