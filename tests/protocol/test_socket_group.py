"""`agent_socket_group`: an unprivileged group reaches the agent socket, and nothing else
of the state dir (docs/deployment.md, "Sockets: who may connect"). The clients here are
forked children that drop to uid 1000 (as an agent backend's process on a node would
run), with or without the group."""

from __future__ import annotations

import grp
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from substrate.config import Config, ConfigError
from substrate.daemon import prepare_state_dir
from tests.harness import DaemonProcess
from tests.harness.daemon import daemon_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes uid and group: needs root")

USER = 1000
#: A group every Debian host has and no test user is in.
GROUP = "nogroup"


def _as_user(groups: list[int], probe: Callable[[], str]) -> str:
    """`probe()` in a forked child running as uid 1000 with supplementary `groups`."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: raw system calls only, then _exit
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(USER)
            os.setuid(USER)
            answer = probe()
        except BaseException as exc:
            answer = f"error {type(exc).__name__}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


def _status(path: Path) -> Callable[[], str]:
    def probe() -> str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
                s.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "daemon.status"}\n')
                reply = json.loads(s.makefile("rb").readline())
        except PermissionError:
            return "EACCES"
        return "version" if "version" in reply.get("result", {}) else json.dumps(reply)

    return probe


def _listing(path: Path) -> Callable[[], str]:
    def probe() -> str:
        try:
            os.listdir(path)
        except PermissionError:
            return "EACCES"
        return "listed"

    return probe


def test_the_group_reaches_the_agent_socket_and_nothing_else(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    gid = grp.getgrnam(GROUP).gr_gid
    d = daemon_factory(agent_socket_group=GROUP, allowed_uids=[0, USER])
    os.chmod(d.base, 0o711)  # the test's temp base, as /var/lib is to /var/lib/substrate
    state = os.stat(d.state_dir)
    assert (stat.S_IMODE(state.st_mode), state.st_gid) == (0o710, gid)
    agent = os.stat(d.agent_path)
    assert (stat.S_IMODE(agent.st_mode), agent.st_gid) == (0o660, gid)
    assert stat.S_IMODE(os.stat(d.operator_path).st_mode) == 0o600
    member, stranger = [gid], []
    assert _as_user(member, _status(d.agent_path)) == "version"
    assert _as_user(member, _status(d.operator_path)) == "EACCES"
    assert _as_user(member, _listing(d.state_dir)) == "EACCES"
    assert _as_user(stranger, _status(d.agent_path)) == "EACCES"
    # Every entry but the agent socket is the daemon's alone.
    for entry in os.scandir(d.state_dir):
        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
        assert entry.name == "substrate.sock" or not mode & 0o077, (entry.name, oct(mode))


def test_without_the_group_the_state_dir_is_closed_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    prepare_state_dir(state, grp.getgrnam(GROUP).gr_gid)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o710
    prepare_state_dir(state)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700


def test_an_unknown_group_stops_the_start(tmp_path: Path) -> None:
    assert Config(agent_socket_group=str(grp.getgrnam(GROUP).gr_gid)).agent_gid() is not None
    with pytest.raises(ConfigError, match="no group 'no-such-group-here'"):
        Config(agent_socket_group="no-such-group-here").agent_gid()
    argv = [sys.executable, "-m", "substrate", "--state-dir", str(tmp_path / "state"),
            "serve", "--config", str(tmp_path / "substrate.toml")]  # fmt: skip
    (tmp_path / "substrate.toml").write_text('agent_socket_group = "no-such-group-here"\n')
    started = subprocess.run(argv, env=daemon_env(), capture_output=True, timeout=60)
    assert started.returncode != 0
    assert b"no group 'no-such-group-here'" in started.stderr
    assert not (tmp_path / "state" / "substrate.sock").exists()
