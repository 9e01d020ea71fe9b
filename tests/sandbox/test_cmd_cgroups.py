"""`substrate.sandbox.cmd_cgroups` without Docker: a directory tree stands in for the
container's cgroup (the real one is exercised in tests/integration/test_tree_kill_engine.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from substrate.sandbox import cmd_cgroups
from substrate.sandbox.reaper import CMD_PREFIX, CgroupDirs


def container(root: Path) -> CgroupDirs:
    base = root / "docker" / "abc"
    base.mkdir(parents=True)
    (base / "cgroup.procs").write_text("")
    return CgroupDirs.parse("0::/docker/abc\n", root)


def test_a_command_cgroup_is_made_beneath_the_containers(tmp_path: Path) -> None:
    dirs = container(tmp_path)
    cg = cmd_cgroups.make(dirs, "p_0123")
    assert cg is not None
    assert cg.path == tmp_path / "docker" / "abc" / (CMD_PREFIX + "p_0123") and cg.v2
    assert cg.path.is_dir()
    assert cmd_cgroups.make(dirs, "p_0123") == cg  # made by an earlier try: reused
    with pytest.raises(ValueError):
        cmd_cgroups.make(dirs, "../escape")
    # No hierarchy to make it in: none (the reaper then knows the main process only).
    assert cmd_cgroups.make(CgroupDirs.parse("0::/gone\n", tmp_path), "p_1") is None


def test_only_a_process_in_the_containers_own_cgroup_is_moved(tmp_path: Path) -> None:
    cg = cmd_cgroups.make(container(tmp_path), "p_0123")
    assert cg is not None
    # The test's own process is not in that container: it is never written there.
    assert cmd_cgroups.enter(cg, os.getpid()) is False
    assert not (cg.path / "cgroup.procs").exists()
    assert cmd_cgroups.enclose(cg, os.getpid(), [os.getpid()]) == 0


async def test_close_removes_an_empty_cgroup(tmp_path: Path) -> None:
    cg = cmd_cgroups.make(container(tmp_path), "p_0123")
    assert cg is not None
    assert cmd_cgroups.pids(cg) == [] and cmd_cgroups.kill(cg) == 0
    assert await cmd_cgroups.close(cg) is True
    assert not cg.path.exists()
    assert await cmd_cgroups.close(cg) is True  # gone already: idempotent
