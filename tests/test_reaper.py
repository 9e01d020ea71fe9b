"""`substrate.sandbox.reaper` without Docker: cgroup paths, process attribution (pure), and
reading a host process (a child of the test)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from substrate.sandbox.reaper import (
    MARKER,
    CgroupDirs,
    ProcInfo,
    attribute,
    identity,
    read_proc,
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
    )


def test_cgroup_v2() -> None:
    dirs = CgroupDirs.parse("0::/system.slice/docker-abc.scope\n", Path("/cg"))
    assert dirs.v2 and dirs.procs == dirs.memory == Path("/cg/system.slice/docker-abc.scope")
    assert dirs.cpu == dirs.procs
    with pytest.raises(OSError):
        CgroupDirs.parse("", Path("/cg"))


def info(pid: int, ppid: int, marker: str | None) -> ProcInfo:
    return ProcInfo(pid=pid, ppid=ppid, ident=pid, marker=marker)


def test_attribution_follows_markers_then_ancestors() -> None:
    procs = [
        info(1, 0, None),  # the container's init (protected)
        info(2, 1, None),  # its keep-alive (protected)
        info(10, 0, "a"),  # command a (exec'd: parent outside the container)
        info(11, 10, None),  # a child of a that scrubbed its environment
        info(12, 11, None),  # ... and its child
        info(20, 0, "b"),  # command b
        info(21, 1, "b"),  # b's double-forked grandchild, re-parented to init
        info(30, 1, None),  # scrubbed and re-parented: nobody's
    ]
    owners = attribute(procs, frozenset({1, 2}))
    assert owners == {10: "a", 11: "a", 12: "a", 20: "b", 21: "b", 30: None}


def test_attribution_survives_a_ppid_cycle() -> None:
    owners = attribute([info(5, 6, None), info(6, 5, None)], frozenset())
    assert owners == {5: None, 6: None}


def test_the_main_process_is_a_root_even_without_a_marker() -> None:
    # The engine reported pid 10 (started at tick 7) as the command's main process; it
    # scrubbed its environment, and so did its child. Pid 40 reuses a root's number.
    procs = [
        ProcInfo(pid=10, ppid=0, ident=(10, 7), marker=None),
        ProcInfo(pid=11, ppid=10, ident=(11, 8), marker=None),
        ProcInfo(pid=40, ppid=0, ident=(40, 9), marker=None),
    ]
    rooted = with_roots(procs, "a", {(10, 7), (40, 1)})
    assert attribute(rooted, frozenset()) == {10: "a", 11: "a", 40: None}
    assert with_roots(procs, "a", set()) == procs


def test_a_host_process_is_read_with_its_marker_and_identity() -> None:
    child = subprocess.Popen(["sleep", "60"], env={MARKER: "p_feed", "PATH": os.defpath})
    try:
        info = read_proc(child.pid)
        assert info is not None
        assert (info.pid, info.ppid, info.marker) == (child.pid, os.getpid(), "p_feed")
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
