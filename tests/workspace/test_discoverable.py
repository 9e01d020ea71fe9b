"""substrate.workspace.discoverable: git directories by content, `.git` files' targets,
misleading names."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import PathDenied, PathInvalid
from substrate.workspace import discoverable
from substrate.workspace.discoverable import GitDirs, completes, gitfile_target, name_problem

DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@pytest.mark.parametrize(
    ("names", "git"),
    [
        ({"HEAD", "objects", "refs"}, True),
        ({"HEAD", "commondir"}, True),  # a worktree's admin dir: objects/refs elsewhere
        ({"HEAD", "objects"}, False),
        ({"objects", "refs", "commondir"}, False),
        (set(), False),
    ],
)
def test_completes_is_gits_own_test(names: set[str], git: bool) -> None:
    assert completes(names) is git


def test_name_problem_names_control_and_bidi_characters() -> None:
    assert name_problem("plain-name_1.txt") is None
    assert name_problem("ünïcödé 名前") is None
    assert name_problem("a\rb") == ("control_character", "U+000D")
    assert name_problem("a\x9bb") == ("control_character", "U+009B")
    assert name_problem("a\u2069") == ("bidi_control", "U+2069")
    assert name_problem("a\u202a") == ("bidi_control", "U+202A")
    assert name_problem("a\u2065") is None  # next to the isolates, not one


@pytest.fixture
def root(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    fd = os.open(tmp_path, DIR)
    try:
        yield tmp_path, fd
    finally:
        os.close(fd)


def test_git_dirs_beneath_counts_the_path_and_the_batch(root: tuple[Path, int]) -> None:
    path, fd = root
    (path / "t" / "objects").mkdir(parents=True)
    dirs = GitDirs(fd)
    assert dirs.beneath(("t", "refs", "x")) is None  # no HEAD
    dirs.add(("t", "HEAD"))
    assert dirs.beneath(("t", "refs", "x")) == "t"
    dirs.remove(("t", "HEAD"))
    assert dirs.beneath(("t", "refs")) == "t"  # added pieces stay counted once added
    # A symlink on the way is never followed: what it points at counts for nothing.
    (path / "elsewhere" / "objects").mkdir(parents=True)
    (path / "elsewhere" / "refs").mkdir()
    (path / "link").symlink_to(path / "elsewhere")
    assert GitDirs(fd).beneath(("link", "HEAD")) is None
    assert GitDirs(fd).beneath(("elsewhere", "HEAD")) == "elsewhere"
    assert GitDirs(fd).beneath(("new", "deeper", "HEAD")) is None


def test_check_write_refuses_with_the_reason(root: tuple[Path, int]) -> None:
    path, fd = root
    for name in ("HEAD", "objects", "refs"):
        (path / "bare" / name).mkdir(parents=True)
    with pytest.raises(PathDenied) as caught:
        discoverable.check_write(GitDirs(fd), ("bare", "config"), "demo:bare/config")
    assert caught.value.data == {"reason": "git_dir", "git_dir": "bare"}
    assert discoverable.blocked_reason(caught.value) == "git_dir"
    with pytest.raises(PathInvalid) as invalid:
        discoverable.check_write(GitDirs(fd), ("x\ny",), "demo:x", ["x\ny"])
    assert invalid.value.data == {"reason": "control_character", "character": "U+000A"}


@pytest.mark.parametrize(
    ("prefix", "content", "target"),
    [
        ("", "gitdir: gitstore\n", ("gitstore",)),
        ("sub", "gitdir: ../store/x\r\n", ("store", "x")),
        ("sub", "gitdir: /checkout/abs/git\n", ("abs", "git")),
        ("sub", "gitdir: /elsewhere/git\n", None),
        ("", "gitdir: ../outside\n", None),
        ("", "gitdir: .\n", None),
        ("", "not a gitfile\n", None),
    ],
)
def test_gitfile_target(
    root: tuple[Path, int], prefix: str, content: str, target: tuple[str, ...] | None
) -> None:
    path, _fd = root
    where = path / prefix
    where.mkdir(exist_ok=True)
    (where / ".git").write_text(content)
    dir_fd = os.open(where, DIR)
    try:
        assert gitfile_target(dir_fd, ".git", prefix, "/checkout") == target
    finally:
        os.close(dir_fd)


def test_gitfile_target_never_follows_a_symlink(root: tuple[Path, int]) -> None:
    path, fd = root
    (path / "real").write_text("gitdir: gitstore\n")
    (path / ".git").symlink_to(path / "real")
    assert gitfile_target(fd, ".git", "", None) is None
