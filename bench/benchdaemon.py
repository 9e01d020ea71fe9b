"""A real `substrate serve` subprocess for benchmarks: private state and adopt root,
started from this checkout, stopped with SIGTERM (so it removes its sandboxes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class BenchDaemon:
    def __init__(
        self,
        base: Path,
        serve_args: Sequence[str] = (),
        repo: Path = REPO,
        module: str = "substrate",
        env: dict[str, str] | None = None,
        launcher: Sequence[str] | None = None,
    ) -> None:
        """`repo`: the checkout whose `substrate` runs (another one for an A/B run);
        `module`: what `python -m` runs (a bench wrapper of `substrate`'s command line,
        such as `bench.layerclock`); `launcher`: what `python` runs instead of `-m
        module` (a script wrapping the command line: `write_probes.py`); `env`: set in
        the daemon's environment."""
        self.base = base
        self.state = base / "state"
        self.roots = base / "roots"
        self.roots.mkdir()
        self.log = open(base / "daemon.log", "wb")  # noqa: SIM115 - closed in stop()
        environ = dict(os.environ) | (env or {})
        paths = [str(repo), *filter(None, [environ.get("PYTHONPATH")])]
        if module != "substrate":  # a wrapper in this checkout's bench/
            paths.append(str(REPO))
        environ["PYTHONPATH"] = os.pathsep.join(paths)
        environ.pop("SUBSTRATE_STATE_DIR", None)
        run = list(launcher) if launcher is not None else ["-m", module]
        argv = [
            sys.executable, *run, "--state-dir", str(self.state),
            "serve", "--adopt-root", str(self.roots), "--listen", "127.0.0.1:0", *serve_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, cwd=base, env=environ, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log
        )
        self.socket = self.state / "substrate.sock"
        deadline = time.monotonic() + 30
        while not self._accepts():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"daemon did not start:\n{(base / 'daemon.log').read_text()}")
            time.sleep(0.02)

    def _accepts(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.socket))
            except OSError:
                return False
        return True

    def stop(self, grace_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def cgroup_favordynmods() -> str:
    """Whether the host's cgroup2 mounts have `favordynmods` (scripts/cgroup-favor-dynmods):
    without it a warm command after a pause pays a cgroup move's RCU grace period."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            _, _, tail = line.partition(" - ")
            fields = tail.split()
            if fields and fields[0] == "cgroup2":
                options = fields[2].split(",") if len(fields) > 2 else []
                found.append("on" if "favordynmods" in options else "off")
    return ",".join(found) or "no cgroup2 mount"
