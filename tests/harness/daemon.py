"""Real daemons for tests: `substrate serve` in its own process on a private state dir.

`DaemonProcess(base, config)` is the handle (start, stop, kill, restart, clients,
journal); `daemons(base_of)` is the context manager behind the `daemon_factory` fixture,
killing every daemon it made at the end. Daemons start from the pre-warmed launcher by
default (`tests.harness.prewarmed`, ~0.1 s); `prewarmed=False` runs the literal
`python -m substrate ...` command instead (~2 s: start-up tests use it).

Every daemon runs the `substrate` the tests import (`PACKAGE_ROOT` goes first on its
`PYTHONPATH`), so that a worktree's tests exercise that worktree's code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import substrate
from substrate.protocol.client import (
    DEFAULT_MAX_REQUEST_BYTES,
    AsyncClient,
    Client,
    open_client,
)
from tests.harness.prewarmed import ForkedDaemon, shared_launcher
from tests.harness.waiting import WaitTimeout, wait_until
from tests.harness.workspaces import create_workspace, remove_tree

READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 30.0
#: The directory holding the `substrate` package the tests import: daemons run the same code.
PACKAGE_ROOT = Path(substrate.__file__).resolve().parent.parent
#: The directory holding this `tests` tree (the launcher is imported from it).
HARNESS_ROOT = Path(__file__).resolve().parent.parent.parent

#: Journal kinds that record a change to a workspace file.
WRITE_KINDS = frozenset({"fs.write", "fs.patch", "fs.delete"})

#: Daemons made by `daemons()` and not yet closed: their logs go into failure reports.
LIVE: list[DaemonProcess] = []


class DaemonFailed(Exception):
    """The daemon exited or did not become ready; the message carries its stderr."""


def toml_value(value: Any) -> str:
    """`value` as a TOML value (bool, number, string, a list of those, or a table of
    them: an inline table, `{key = value, ...}`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _pythonpath(*first: Path) -> str:
    """`first`, then the inherited `PYTHONPATH` entries."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*map(str, first), *filter(None, [inherited])])


def daemon_env() -> dict[str, str]:
    """This environment, with `PACKAGE_ROOT` first on `PYTHONPATH` and no state dir."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _pythonpath(PACKAGE_ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("SUBSTRATE_STATE_DIR", None)
    return env


def launcher_env() -> dict[str, str]:
    """`daemon_env()`, with `HARNESS_ROOT` after `PACKAGE_ROOT` to import the launcher."""
    return {**daemon_env(), "PYTHONPATH": _pythonpath(PACKAGE_ROOT, HARNESS_ROOT)}


class DaemonProcess:
    """A real `substrate serve` process on a private state dir.

    `base` holds `state/`, `roots/` (the adopt root), `substrate.toml` and `daemon.log`
    (stdout+stderr of every run). `config` entries go to `substrate.toml` as is.
    `prewarmed=False` runs the literal `python -m substrate` command (slower start).
    """

    def __init__(
        self, base: Path, config: Mapping[str, Any] | None = None, *, prewarmed: bool = True
    ) -> None:
        self.base = base
        self.prewarmed = prewarmed
        self.state_dir = base / "state"
        self.adopt_root = base / "roots"
        self.adopt_root.mkdir(exist_ok=True)
        self.config_path = base / "substrate.toml"
        self.log_path = base / "daemon.log"
        self.config: dict[str, Any] = {
            "state_dir": str(self.state_dir),
            "adopt_roots": [str(self.adopt_root)],
            # Many daemons run at once: let each terminal listener pick a free port.
            "listen": "127.0.0.1:0",
            **(config or {}),
        }
        self.config_path.write_text(
            "".join(f"{k} = {toml_value(v)}\n" for k, v in self.config.items())
        )
        self.proc: subprocess.Popen[bytes] | ForkedDaemon | None = None
        self.returncodes: list[int] = []
        self._clients: list[Client] = []
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()

    # -- paths ------------------------------------------------------------------------------

    @property
    def agent_path(self) -> Path:
        return self.state_dir / "substrate.sock"

    @property
    def operator_path(self) -> Path:
        return self.state_dir / "operator.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "daemon not started"
        return self.proc.pid

    def argv(self) -> list[str]:
        """The command line (`python -m substrate` plus `cli_args()`)."""
        return [sys.executable, "-m", "substrate", *self.cli_args()]

    def cli_args(self) -> list[str]:
        return [
            "--state-dir",
            str(self.state_dir),
            "serve",
            "--config",
            str(self.config_path),
            *[arg for root in self.config["adopt_roots"] for arg in ("--adopt-root", root)],
        ]

    # -- lifecycle ---------------------------------------------------------------------------

    def spawn(self) -> subprocess.Popen[bytes] | ForkedDaemon:
        """Start the process without waiting for it (start-up refusal tests use this)."""
        self._log.write(f"--- start {time.strftime('%H:%M:%S')} ---\n".encode())
        self._log.flush()
        if self.prewarmed:
            self.proc = shared_launcher(launcher_env()).spawn(
                self.cli_args(), str(self.base), daemon_env(), str(self.log_path)
            )
        else:
            self.proc = subprocess.Popen(
                self.argv(),
                cwd=self.base,
                env=daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
        return self.proc

    def start(self) -> DaemonProcess:
        """Start and wait until both sockets accept (at most 15 s)."""
        proc = self.spawn()

        def ready() -> bool:
            if proc.poll() is not None:
                raise DaemonFailed(f"daemon exited with {proc.returncode}:\n{self.stderr()}")
            return self._accepts(self.agent_path) and self._accepts(self.operator_path)

        try:
            wait_until(ready, READY_TIMEOUT_S)
        except WaitTimeout:
            raise DaemonFailed(
                f"daemon not ready after {READY_TIMEOUT_S} s:\n{self.stderr()}"
            ) from None
        return self

    @staticmethod
    def _accepts(path: Path) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(path))
            except OSError:
                return False
        return True

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait, return the exit code (SIGKILL after `timeout`)."""
        assert self.proc is not None
        self._close_clients()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise DaemonFailed(f"daemon ignored SIGTERM for {timeout} s") from None
        code = self.proc.wait()  # reaped already: at once
        self.returncodes.append(code)
        return code

    def kill(self) -> int:
        """SIGKILL (a crash) and reap."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self._close_clients()
        self.returncodes.append(code)
        return code

    def restart(self) -> DaemonProcess:
        """Stop gracefully if running (use `kill()` first for a crash), then start again."""
        if self.running:
            self.stop()
        return self.start()

    def close(self) -> None:
        """Teardown: kill whatever still runs, close clients and the log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_clients()
        self._log.close()

    def stderr(self, tail: int = 200) -> str:
        """The last `tail` lines the daemon wrote (stdout and stderr, every run)."""
        self._log.flush()
        with contextlib.suppress(OSError):
            lines = self.log_path.read_bytes().decode("utf-8", "replace").splitlines()
            return "\n".join(lines[-tail:])
        return ""

    # -- clients -----------------------------------------------------------------------------

    @property
    def max_request_bytes(self) -> int:
        """The daemon's line limit, which its clients check requests against."""
        return int(self.config.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))

    def client(self, timeout: float | None = 60.0) -> Client:
        """A synchronous agent client (closed at teardown or on stop/kill)."""
        c = Client(self.agent_path, timeout=timeout, max_request_bytes=self.max_request_bytes)
        self._clients.append(c)
        return c

    def operator(self, timeout: float | None = 60.0) -> Client:
        """A synchronous operator client."""
        c = Client(self.operator_path, timeout=timeout, max_request_bytes=self.max_request_bytes)
        self._clients.append(c)
        return c

    @contextlib.asynccontextmanager
    async def async_client(self, operator: bool = False) -> AsyncIterator[AsyncClient]:
        """A Trio client for the duration of the block."""
        path = self.operator_path if operator else self.agent_path
        async with open_client(path, max_request_bytes=self.max_request_bytes) as c:
            yield c

    def raw(self, operator: bool = False, timeout: float = 30.0) -> socket.socket:
        """A plain connected socket, for framing tests."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(str(self.operator_path if operator else self.agent_path))
        return s

    def _close_clients(self) -> None:
        for c in self._clients:
            with contextlib.suppress(OSError):
                c.close()
        self._clients.clear()

    # -- conveniences --------------------------------------------------------------------------

    def make_workspace(
        self,
        name: str | None = None,
        files: Mapping[str, str | bytes] | None = None,
        *,
        git: bool = False,
    ) -> Path:
        """A workspace dir under this daemon's adopt root (not adopted yet)."""
        return create_workspace(self.adopt_root, name, files, git=git)

    def adopt(self, path: Path, **params: Any) -> str:
        """Adopt `path` (over a fresh agent connection) and return the workspace handle."""
        with Client(self.agent_path, timeout=60) as c:
            return str(c.call("workspace.adopt", path=str(path), **params)["workspace"])

    def journal(self, kinds: set[str] | None = None, workspace: str | None = None) -> list[Any]:
        """Every journal entry (paged), optionally only these kinds / this workspace."""
        entries: list[dict[str, Any]] = []
        since = 0
        with Client(self.agent_path, timeout=60) as c:
            while True:
                params: dict[str, Any] = {"since": since, "limit": 10000}
                if workspace is not None:
                    params["workspace"] = workspace
                batch = c.call("journal.read", **params)["entries"]
                if not batch:
                    break
                entries.extend(batch)
                since = batch[-1]["seq"]
        return [e for e in entries if kinds is None or e["kind"] in kinds]

    def verify_journal(self) -> dict[str, Any]:
        with Client(self.agent_path, timeout=60) as c:
            result: dict[str, Any] = c.call("journal.verify")
            return result


@contextlib.contextmanager
def daemons(base_of: Callable[[], Path]) -> Iterator[Callable[..., DaemonProcess]]:
    """Yield `factory(start=True, prewarmed=True, **substrate_toml_keys)` → a `DaemonProcess`.

    Each daemon gets a fresh `base_of()` dir; at exit every one is killed and its dir removed.
    """
    made: list[tuple[DaemonProcess, Path]] = []

    def factory(*, start: bool = True, prewarmed: bool = True, **config: Any) -> DaemonProcess:
        base = base_of()
        d = DaemonProcess(base, config, prewarmed=prewarmed)
        made.append((d, base))
        LIVE.append(d)
        if start:
            d.start()
        return d

    try:
        yield factory
    finally:
        for d, base in made:
            d.close()
            LIVE.remove(d)
            remove_tree(base)
