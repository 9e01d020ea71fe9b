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
        launcher: Sequence[str] = ("-m", "substrate"),
        env: dict[str, str] | None = None,
    ) -> None:
        """`repo`: the checkout whose `substrate` runs (another one for an A/B run);
        `launcher`: what `python` runs with the command line (a script wrapping it:
        `write_probes.py`); `env`: added to the environment."""
        self.base = base
        self.state = base / "state"
        self.roots = base / "roots"
        self.roots.mkdir()
        self.log = open(base / "daemon.log", "wb")  # noqa: SIM115 - closed in stop()
        environ = {**os.environ, **(env or {})}
        path = [str(repo), *filter(None, [environ.get("PYTHONPATH")])]
        environ["PYTHONPATH"] = os.pathsep.join(path)
        environ.pop("SUBSTRATE_STATE_DIR", None)
        argv = [
            sys.executable, *launcher, "--state-dir", str(self.state),
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
