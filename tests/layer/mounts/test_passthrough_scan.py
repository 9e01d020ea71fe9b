"""substrate.layer.mounts.passthrough_scan: what a command left in passthrough dirs is reported,
and git dirs and set-id bits the command made are neutralised."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.layer.mounts import passthrough_scan
from substrate.layer.mounts.passthrough_scan import Finding, inspect


@pytest.fixture
def root(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    (tmp_path / "node_modules").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield tmp_path, fd
    finally:
        os.close(fd)


def _git_dir(path: Path) -> None:
    for name in ("objects", "refs"):
        (path / name).mkdir(parents=True)
    (path / "HEAD").write_text("ref: refs/heads/main\n")
    (path / "config").write_text("[core]\n\tfsmonitor = touch MARKER\n")


def test_what_the_command_left_is_reported_and_neutralised(root: tuple[Path, int]) -> None:
    path, fd = root
    nm = path / "node_modules"
    (nm / "old-setid").write_text("x")
    os.chmod(nm / "old-setid", 0o4755)
    (nm / "old-link").symlink_to("/")
    since = time.time_ns()
    time.sleep(0.01)
    _git_dir(nm / "evil" / ".git")  # a new .git
    _git_dir(nm / "bare")  # a repository by content under another name
    (nm / "pkg" / ".git").mkdir(parents=True)  # one of the read-only parts: not a finding
    (nm / "run").write_text("#!/bin/sh\n")
    os.chmod(nm / "run", 0o6755)
    (nm / "shadow").symlink_to("/etc/shadow")
    os.mkfifo(nm / "pipe")
    os.link(nm / "run", nm / "run2")
    (nm / "big.bin").write_bytes(b"\0" * (1 << 20))  # size is not governed here
    found = inspect(fd, ["node_modules"], since, readonly={"node_modules/pkg/.git"})
    assert sorted(found, key=lambda f: f.path) == [
        Finding("node_modules/bare", "git_dir", 0),
        Finding("node_modules/evil/.git", "git_dir", 0),
        Finding("node_modules/old-setid", "setid", None),  # not the command's: untouched
        Finding("node_modules/pipe", "fifo"),
        Finding("node_modules/run", "setid", 0o755),  # a hard link keeps no set-id bit
        Finding("node_modules/run2", "hard_link"),
        Finding("node_modules/shadow", "symlink"),
    ]
    assert stat.S_IMODE((nm / "bare" / "HEAD").stat().st_mode) == 0
    assert stat.S_IMODE((nm / "evil" / ".git" / "HEAD").stat().st_mode) == 0
    assert (nm / "evil" / ".git" / "config").exists()  # nothing is deleted
    assert stat.S_IMODE((nm / "old-setid").stat().st_mode) == 0o4755


def test_a_set_id_file_made_during_the_command_loses_its_bits(root: tuple[Path, int]) -> None:
    path, fd = root
    since = time.time_ns()
    time.sleep(0.01)
    (path / "node_modules" / "tool").write_text("#!/bin/sh\n")
    os.chmod(path / "node_modules" / "tool", 0o4755)
    assert inspect(fd, ["node_modules"], since) == [Finding("node_modules/tool", "setid", 0o755)]
    assert stat.S_IMODE((path / "node_modules" / "tool").stat().st_mode) == 0o755


def test_the_walk_is_bounded(root: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    path, fd = root
    for i in range(10):
        (path / "node_modules" / f"f{i}").write_text("")
    monkeypatch.setattr(passthrough_scan, "MAX_ENTRIES", 5)
    assert inspect(fd, ["node_modules"], 0) == [Finding("node_modules", "unscanned")]
    assert inspect(fd, ["absent"], 0) == []
