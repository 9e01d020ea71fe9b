"""`substrate.sandbox.reaper` without Docker: cgroup paths, process attribution (pure),
membership read from command cgroups (a directory tree standing in for cgroupfs), and
reading a host process (a child of the test)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from substrate.sandbox.reaper import (
    CMD_PREFIX,
    MARKER,
    CgroupDirs,
    ProcInfo,
    attribute,
    command_members,
    commands_parent,
    identity,
    owners,
    read_proc,
    targets,
    with_roots,
)

V1 = """9:name=systemd:/docker/abc
8:pids:/docker/abc
6:freezer:/docker/abc
4:memory:/docker/abc
1:cpu,cpuacct:/docker/abc
0::/docker/abc
"""


def test_cgroup_v1_wins_in_a_hybrid_hierarchy() -> None:
    dirs = CgroupDirs.parse(V1, Path("/cg"))
    assert dirs == CgroupDirs(
        procs=Path("/cg/pids/docker/abc"),
        memory=Path("/cg/memory/docker/abc"),
        freezer=Path("/cg/freezer/docker/abc"),
        v2=False,
        cpu=Path("/cg/cpuacct/docker/abc"),
        unified=Path("/cg/unified/docker/abc"),
    )


def test_cgroup_v2() -> None:
    dirs = CgroupDirs.parse("0::/system.slice/docker-abc.scope\n", Path("/cg"))
    assert dirs.v2 and dirs.procs == dirs.memory == Path("/cg/system.slice/docker-abc.scope")
    assert dirs.cpu == dirs.procs == dirs.unified
    with pytest.raises(OSError):
        CgroupDirs.parse("", Path("/cg"))


def info(pid: int, ppid: int, owner: str | None) -> ProcInfo:
    return ProcInfo(pid=pid, ppid=ppid, ident=pid, owner=owner)


def test_attribution_follows_command_cgroups_then_ancestors() -> None:
    procs = [
        info(1, 0, None),  # the container's init (protected)
        info(2, 1, None),  # its keep-alive (protected)
        info(10, 0, "a"),  # command a, in its cgroup
        info(11, 10, None),  # a child of a forked before a was moved into its cgroup
        info(12, 11, None),  # ... and its child
        info(20, 0, "b"),  # command b
        info(21, 1, "b"),  # b's double-forked grandchild, re-parented to init: in b's cgroup
        info(30, 1, None),  # outside every cgroup and re-parented: nobody's
    ]
    owners = attribute(procs, frozenset({1, 2}))
    assert owners == {10: "a", 11: "a", 12: "a", 20: "b", 21: "b", 30: None}


def test_attribution_survives_a_ppid_cycle() -> None:
    owners = attribute([info(5, 6, None), info(6, 5, None)], frozenset())
    assert owners == {5: None, 6: None}


def test_the_main_process_is_a_root_even_without_a_marker() -> None:
    # The engine reported pid 10 (started at tick 7) as the command's main process, not
    # in its cgroup yet, nor is its child. Pid 40 reuses a root's number.
    procs = [
        ProcInfo(pid=10, ppid=0, ident=(10, 7), owner=None),
        ProcInfo(pid=11, ppid=10, ident=(11, 8), owner=None),
        ProcInfo(pid=40, ppid=0, ident=(40, 9), owner=None),
    ]
    rooted = with_roots(procs, "a", {(10, 7), (40, 1)})
    assert attribute(rooted, frozenset()) == {10: "a", 11: "a", 40: None}
    assert with_roots(procs, "a", set()) == procs


def test_a_host_process_is_read_with_its_identity_and_never_its_environment() -> None:
    child = subprocess.Popen(["sleep", "60"], env={MARKER: "p_feed", "PATH": os.defpath})
    try:
        info = read_proc(child.pid)
        assert info is not None
        # The marker in its environment is the process's own word: not read.
        assert (info.pid, info.ppid, info.owner) == (child.pid, os.getpid(), None)
        assert read_proc(child.pid, "p_cgroup") == ProcInfo(
            pid=child.pid, ppid=os.getpid(), ident=info.ident, owner="p_cgroup"
        )
        assert identity(child.pid) == info.ident  # the same process, read again
        mine = read_proc(os.getpid())
        assert mine is not None and mine.ident != info.ident
        child.kill()
        # Exited, not yet reaped: a zombie is nobody's process any more.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert read_proc(child.pid) is None and identity(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert read_proc(child.pid) is None and identity(child.pid) is None


def cgroup_tree(root: Path, own: list[int], commands: dict[str, list[int]]) -> CgroupDirs:
    """A directory tree laid out as a v2 container cgroup with command cgroups."""
    base = root / "docker" / "abc"
    base.mkdir(parents=True)
    (base / "cgroup.procs").write_text("".join(f"{p}\n" for p in own))
    for owner, pids in commands.items():
        (base / (CMD_PREFIX + owner)).mkdir()
        (base / (CMD_PREFIX + owner) / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (base / "not-a-command").mkdir()  # another cgroup beneath: nobody's membership
    (base / "not-a-command" / "cgroup.procs").write_text("")
    return CgroupDirs.parse("0::/docker/abc\n", root)


def test_membership_is_the_command_cgroup_that_holds_a_process(tmp_path: Path) -> None:
    dirs = cgroup_tree(tmp_path, [1, 2], {"p_a": [10, 11], "p_b": [20]})
    assert commands_parent(dirs) == (tmp_path / "docker" / "abc", True)
    assert command_members(dirs) == {10: "p_a", 11: "p_a", 20: "p_b"}
    hybrid = CgroupDirs.parse(V1, tmp_path)  # no unified hierarchy there: the v1 pids one
    assert commands_parent(hybrid) == (tmp_path / "pids" / "docker" / "abc", False)
    assert command_members(hybrid) == {}


def test_a_forged_marker_decides_nothing(tmp_path: Path) -> None:
    # Two processes of the test stand in for the sandbox's: one in command p_a's cgroup
    # claiming (in its environment) to be p_b's, one outside every cgroup claiming p_a.
    env = {"PATH": os.defpath}
    inside = subprocess.Popen(["sleep", "60"], env={**env, MARKER: "p_b"})
    outside = subprocess.Popen(["sleep", "60"], env={**env, MARKER: "p_a"})
    try:
        dirs = cgroup_tree(tmp_path, [outside.pid], {"p_a": [inside.pid], "p_b": []})
        assert owners(dirs, frozenset()) == {inside.pid: "p_a", outside.pid: None}
        assert targets(dirs, "p_a", frozenset(), False) == [inside.pid]
        assert targets(dirs, "p_b", frozenset(), False) == []
        # Alone in its sandbox, a command's end takes what belongs to nobody too.
        assert sorted(targets(dirs, "p_b", frozenset(), True)) == [outside.pid]
    finally:
        for child in (inside, outside):
            child.kill()
            child.wait()
