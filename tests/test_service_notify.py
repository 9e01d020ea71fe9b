"""The daemon tells systemd it is ready once every socket accepts, and that it stops
(`Type=notify`, docs/deployment.md): `$NOTIFY_SOCKET` is a datagram socket this test
listens on, the daemon a real `substrate serve` process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from substrate.daemon import notify_service_manager
from tests.harness import remove_tree, short_tempdir
from tests.harness.daemon import daemon_env


def test_ready_once_the_sockets_accept_then_stopping() -> None:
    base = short_tempdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(base / "notify"))
    listener.settimeout(60)
    env = {**daemon_env(), "NOTIFY_SOCKET": str(base / "notify")}
    argv = [sys.executable, "-m", "substrate", "--state-dir", str(base / "state"), "serve",
            "--adopt-root", str(base), "--listen", "127.0.0.1:0"]  # fmt: skip
    with open(base / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        try:
            assert listener.recv(64) == b"READY=1"
            # Ready means ready: the agent socket accepts at once.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(str(base / "state" / "substrate.sock"))
            daemon.send_signal(signal.SIGTERM)
            assert listener.recv(64) == b"STOPPING=1"
            assert daemon.wait(60) == 0
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            listener.close()
            remove_tree(base)


def test_the_abstract_namespace_and_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"substrate-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notify_service_manager("READY=1")
        assert listener.recv(64) == b"READY=1"
    monkeypatch.setenv("NOTIFY_SOCKET", str(Path("/nonexistent/notify")))
    notify_service_manager("READY=1")  # unreachable: logged, not raised
    monkeypatch.delenv("NOTIFY_SOCKET")
    notify_service_manager("READY=1")  # no $NOTIFY_SOCKET: nothing at all
