"""`Spawned.exited` on a pidfd numbered past `FD_SETSIZE`: a daemon holding a hundred
sandboxes has such descriptors, and `select` refused them (`ValueError`), failing the
command with an internal error."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from substrate.sandbox.supervisor.link import Spawned

HIGH_FD = 1500


@pytest.fixture
def high_fd_room() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH_FD:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} leaves no room for fd {HIGH_FD}")
    if soft != resource.RLIM_INFINITY and soft <= HIGH_FD:
        resource.setrlimit(resource.RLIMIT_NOFILE, (HIGH_FD + 1, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_exited_reads_a_pidfd_past_fd_setsize(high_fd_room: None) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    pidfd = os.pidfd_open(child.pid)
    high = os.dup2(pidfd, HIGH_FD)
    os.close(pidfd)
    try:
        spawned = Spawned(chan=None, pidfd=high)  # type: ignore[arg-type]  # no channel needed
        assert not spawned.exited()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        assert spawned.exited()
    finally:
        os.close(high)
        if child.poll() is None:
            child.kill()
            child.wait()


def test_exited_without_a_pidfd_is_true() -> None:
    assert Spawned(chan=None).exited()  # type: ignore[arg-type]
