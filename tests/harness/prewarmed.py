"""The test session's side of the pre-warmed launcher (`tests.harness.launcher`).

`shared_launcher(env)` starts the launcher on first use; `close_shared_launcher()` ends it
at the end of the session. `Launcher.spawn` forks a daemon and returns a `ForkedDaemon`,
the subset of `subprocess.Popen` that `DaemonProcess` uses.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from tests.harness.waiting import WaitTimeout, wait_until


class LauncherDied(RuntimeError):
    """The launcher process is gone (its stdout closed)."""


class Launcher:
    """The pre-warmed helper process: forks daemons and reaps them on request.

    `env` is the launcher's environment: its `PYTHONPATH` must import the `substrate`
    under test first, and this package.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.launcher"],
            cwd="/",
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request, one reply (see the launcher's protocol); thread-safe."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise LauncherDied("the pre-warmed launcher died")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def spawn(self, argv: list[str], cwd: str, env: Mapping[str, str], log: str) -> ForkedDaemon:
        """Fork `substrate ARGV` in `cwd` with exactly `env`, stdout+stderr appended to `log`."""
        request = {"op": "spawn", "argv": argv, "cwd": cwd, "env": dict(env), "log": log}
        return ForkedDaemon(self, int(self.ask(request)["pid"]))

    def close(self) -> None:
        """Close its stdin (it exits), wait 10 s, then kill it."""
        with contextlib.suppress(OSError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


class ForkedDaemon:
    """The `subprocess.Popen` subset DaemonProcess uses, for a child of the launcher."""

    def __init__(self, launcher: Launcher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.ask({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            wait_until(
                lambda: self.poll() is not None,
                math.inf if timeout is None else timeout,
                interval=0.005,
            )
        except WaitTimeout:
            raise subprocess.TimeoutExpired(["substrate", "serve"], timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_shared: Launcher | None = None


def shared_launcher(env: Mapping[str, str]) -> Launcher:
    """The session's launcher, started with `env` on first use."""
    global _shared
    if _shared is None:
        _shared = Launcher(env)
    return _shared


def close_shared_launcher() -> None:
    """End the session's launcher, if one was started."""
    global _shared
    if _shared is not None:
        _shared.close()
        _shared = None
