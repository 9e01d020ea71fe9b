"""Shared fixtures: real daemons run as subprocesses, workspaces owned by uid 1000.

- `make_workspace(name=None, files=None, git=False)` makes a directory under the
  function's adopt root, fills it, chowns it to uid/gid 1000 and returns its path;
  `workspace_dir` is one made with the defaults.
- `daemon` is a real daemon (`substrate serve`) in its own process on a private state
  dir, ready when both sockets accept; `daemon_factory(**config)` starts more, with
  `substrate.toml` keys (`line_timeout_s`, `max_connections`, ...); `module_daemon` is
  one per test module, for the many cheap tests that only need *a* daemon (make your own
  workspace with `module_daemon.make_workspace`). See `DaemonProcess` for the handle.
- `snapshot_tree(path)` / `chown_tree(path)`: every name, kind, mode, owner and content
  digest under a path (never following a symlink), to prove that nothing changed; and a
  recursive lchown to uid 1000 for entries a test adds.

Daemons start from a pre-warmed launcher by default: one helper process per session
imports substrate once, then forks a child per daemon that runs `substrate.cli.main.main`
exactly as `python -m substrate` would (same argv, config, sockets, signals), in ~0.1 s
instead of the ~2 s a fresh interpreter spends importing. `daemon_factory(prewarmed=
False)` runs the literal `python -m substrate ...` command instead (start-up tests do).

Every daemon is killed at teardown; when a test fails, the log (stdout+stderr) of every
daemon still alive is attached to its report. Temp dirs are short (`/tmp/sbst-*`)
because a Unix socket path must fit in 108 bytes.

Test modules must not `import conftest` (tests/integration has its own, and pytest swaps
the module of that name while collecting): use the fixtures, and import `DaemonProcess`
under `TYPE_CHECKING` only.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import substrate
from substrate.protocol.client import AsyncClient, Client, open_client

#: Workspaces in tests belong to this user, as agents' checkouts do (we run as root).
WORKSPACE_UID = 1000
WORKSPACE_GID = 1000
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 30.0
#: The directory holding the `substrate` package the tests import: daemons run the same code.
PACKAGE_ROOT = Path(substrate.__file__).resolve().parent.parent

DEFAULT_FILES: dict[str, str | bytes] = {
    "README.md": "# demo\n\nhello\n",
    "src/main.py": "def main() -> None:\n    print('hello')\n",
    "src/util.py": "VALUE = 1\n",
    "data/blob.bin": bytes(range(256)) * 4,
}

#: A fixed commit id for fake `.git` dirs (no git is ever run).
FAKE_HEAD = "0123456789abcdef0123456789abcdef01234567"

_names = itertools.count(1)
_LIVE: list[DaemonProcess] = []


# --- workspaces --------------------------------------------------------------------------


def chown_tree(path: Path, uid: int = WORKSPACE_UID, gid: int = WORKSPACE_GID) -> None:
    """lchown `path` and everything beneath it (symlinks themselves, never their targets)."""
    os.lchown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def write_files(root: Path, files: Mapping[str, str | bytes]) -> None:
    for rel, content in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            target.write_text(content)
        else:
            target.write_bytes(content)


def write_fake_git(root: Path, head: str = FAKE_HEAD, branch: str = "main") -> None:
    """A `.git` dir with HEAD on `branch`, a loose ref and a config (no git needed)."""
    git = root / ".git"
    (git / "refs" / "heads").mkdir(parents=True, exist_ok=True)
    (git / "refs" / "tags").mkdir(parents=True, exist_ok=True)
    (git / "objects").mkdir(exist_ok=True)
    (git / "hooks").mkdir(exist_ok=True)
    (git / "HEAD").write_text(f"ref: refs/heads/{branch}\n")
    (git / "refs" / "heads" / branch).write_text(head + "\n")
    (git / "config").write_text(
        "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
    )


def create_workspace(
    adopt_root: Path,
    name: str | None = None,
    files: Mapping[str, str | bytes] | None = None,
    *,
    git: bool = False,
    owner: tuple[int, int] = (WORKSPACE_UID, WORKSPACE_GID),
) -> Path:
    """Make a workspace dir under `adopt_root` with `files` (default: a small tree)."""
    path = adopt_root / (name or f"ws-{next(_names)}")
    path.mkdir(parents=True)
    write_files(path, DEFAULT_FILES if files is None else files)
    if git:
        write_fake_git(path)
    chown_tree(path, *owner)
    return path


def short_tempdir(prefix: str = "sbst-") -> Path:
    """A fresh dir under /tmp with a short name (socket paths are limited to 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def remove_tree(path: Path) -> None:
    """rm -rf that also gets through dirs a test made unreadable or immutable-ish."""
    if not path.exists() and not path.is_symlink():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            with contextlib.suppress(OSError):
                p = os.path.join(dirpath, name)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
    shutil.rmtree(path, ignore_errors=True)


# --- snapshots ---------------------------------------------------------------------------


def snapshot_tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under `root` (root included as "."), never following a symlink.

    Values: (kind, mode, uid, gid[, content sha256 and inode | link target]). Equal
    snapshots mean no name, byte, mode, owner or file identity changed.
    """
    out: dict[str, tuple[Any, ...]] = {}

    def entry(path: str, rel: str) -> None:
        st = os.lstat(path)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("symlink", mode, st.st_uid, st.st_gid, os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            out[rel] = ("file", mode, st.st_uid, st.st_gid, digest, st.st_ino)
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", mode, st.st_uid, st.st_gid)
        else:
            out[rel] = ("other", stat.S_IFMT(st.st_mode), mode, st.st_uid, st.st_gid)

    entry(str(root), ".")
    if not os.path.isdir(root) or os.path.islink(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            entry(full, os.path.relpath(full, root))
    return out


@pytest.fixture(name="snapshot_tree")
def snapshot_tree_fixture() -> Callable[[Path], dict[str, tuple[Any, ...]]]:
    """`snapshot_tree(path)`: see the function of that name in tests/conftest.py."""
    return snapshot_tree


@pytest.fixture(name="chown_tree")
def chown_tree_fixture() -> Callable[..., None]:
    """`chown_tree(path, uid=1000, gid=1000)`: lchown a tree a test added entries to."""
    return chown_tree


# --- the daemon --------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


class DaemonFailed(Exception):
    """The daemon exited or did not become ready; the message carries its stderr."""


# --- the pre-warmed launcher ----------------------------------------------------------------

_LAUNCHER_SRC = r"""
import json, os, sys, traceback
import substrate.cli.main
for name in ("substrate.daemon", "substrate.api", "substrate.process.service", "substrate.pty.service"):
    try:
        __import__(name)
    except Exception:
        pass  # the daemon imports it again itself, and fails there as it would anyway
for raw in sys.stdin.buffer:
    request = json.loads(raw)
    if request["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                os.close(null)
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                sys.argv = ["substrate", *request["argv"]]
                code = substrate.cli.main.main(request["argv"])
            except SystemExit as exc:
                if isinstance(exc.code, int) or exc.code is None:
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        reply = {"pid": pid}
    else:
        pid, status = os.waitpid(request["pid"], os.WNOHANG)
        reply = {"code": os.waitstatus_to_exitcode(status) if pid else None}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""


class _Launcher:
    """The session's pre-warmed helper: forks daemons and reaps them on request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER_SRC],
            cwd="/",
            env=_daemon_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise DaemonFailed("the pre-warmed launcher died")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
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


_launcher: _Launcher | None = None


def _get_launcher() -> _Launcher:
    global _launcher
    if _launcher is None:
        _launcher = _Launcher()
    return _launcher


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _launcher
    if _launcher is not None:
        _launcher.close()
        _launcher = None


class _ForkedDaemon:
    """The `subprocess.Popen` subset DaemonProcess uses, for a child of the launcher."""

    def __init__(self, launcher: _Launcher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.ask({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["substrate", "serve"], timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _daemon_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("SUBSTRATE_STATE_DIR", None)
    return env


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
            "".join(f"{k} = {_toml_value(v)}\n" for k, v in self.config.items())
        )
        self.proc: subprocess.Popen[bytes] | _ForkedDaemon | None = None
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

    def spawn(self) -> subprocess.Popen[bytes] | _ForkedDaemon:
        """Start the process without waiting for it (start-up refusal tests use this)."""
        self._log.write(f"--- start {time.strftime('%H:%M:%S')} ---\n".encode())
        self._log.flush()
        if self.prewarmed:
            launcher = _get_launcher()
            request = {
                "op": "spawn",
                "argv": self.cli_args(),
                "cwd": str(self.base),
                "env": _daemon_env(),
                "log": str(self.log_path),
            }
            self.proc = _ForkedDaemon(launcher, launcher.ask(request)["pid"])
        else:
            self.proc = subprocess.Popen(
                self.argv(),
                cwd=self.base,
                env=_daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
        return self.proc

    def start(self) -> DaemonProcess:
        """Start and wait until both sockets accept (at most 15 s)."""
        proc = self.spawn()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise DaemonFailed(f"daemon exited with {proc.returncode}:\n{self.stderr()}")
            if self._accepts(self.agent_path) and self._accepts(self.operator_path):
                return self
            if time.monotonic() > deadline:
                raise DaemonFailed(f"daemon not ready after {READY_TIMEOUT_S} s:\n{self.stderr()}")
            time.sleep(0.02)

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
        self.returncodes.append(self.proc.returncode)
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL (a crash) and reap."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close_clients()
        self.returncodes.append(self.proc.returncode)
        return self.proc.returncode

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

    def client(self, timeout: float | None = 60.0) -> Client:
        """A synchronous agent client (closed at teardown or on stop/kill)."""
        c = Client(self.agent_path, timeout=timeout)
        self._clients.append(c)
        return c

    def operator(self, timeout: float | None = 60.0) -> Client:
        """A synchronous operator client."""
        c = Client(self.operator_path, timeout=timeout)
        self._clients.append(c)
        return c

    @contextlib.asynccontextmanager
    async def async_client(self, operator: bool = False) -> AsyncIterator[AsyncClient]:
        """A Trio client for the duration of the block."""
        async with open_client(self.operator_path if operator else self.agent_path) as c:
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


#: Journal kinds that record a change to a workspace file.
WRITE_KINDS = frozenset({"fs.write", "fs.patch", "fs.delete"})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LIVE:
        for i, d in enumerate(_LIVE):
            report.sections.append((f"daemon {i} log ({d.base})", d.stderr()))


@contextlib.contextmanager
def _daemons(base_of: Callable[[], Path]) -> Iterator[Callable[..., DaemonProcess]]:
    made: list[tuple[DaemonProcess, Path]] = []

    def factory(*, start: bool = True, prewarmed: bool = True, **config: Any) -> DaemonProcess:
        base = base_of()
        d = DaemonProcess(base, config, prewarmed=prewarmed)
        made.append((d, base))
        _LIVE.append(d)
        if start:
            d.start()
        return d

    try:
        yield factory
    finally:
        for d, base in made:
            d.close()
            _LIVE.remove(d)
            remove_tree(base)


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonProcess]]:
    """`daemon_factory(start=True, prewarmed=True, **substrate_toml_keys)` → a `DaemonProcess`."""
    with _daemons(short_tempdir) as factory:
        yield factory


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A started daemon with the default configuration; its adopt root is `adopt_root`."""
    return daemon_factory()


@pytest.fixture
def adopt_root(request: pytest.FixtureRequest) -> Iterator[Path]:
    """The adopt root of `daemon` when the test uses it, else a fresh temp dir."""
    if "daemon" in request.fixturenames:
        d: DaemonProcess = request.getfixturevalue("daemon")
        yield d.adopt_root
        return
    base = short_tempdir()
    root = base / "roots"
    root.mkdir()
    try:
        yield root
    finally:
        remove_tree(base)


@pytest.fixture
def make_workspace(adopt_root: Path) -> Callable[..., Path]:
    """`make_workspace(name=None, files=None, git=False)` → a uid-1000 dir under `adopt_root`.

    That is `daemon`'s adopt root; for a daemon from `daemon_factory`, use its own
    `d.make_workspace(...)` instead.
    """

    def make(
        name: str | None = None,
        files: Mapping[str, str | bytes] | None = None,
        *,
        git: bool = False,
    ) -> Path:
        return create_workspace(adopt_root, name, files, git=git)

    return make


@pytest.fixture
def workspace_dir(make_workspace: Callable[..., Path]) -> Path:
    """A workspace with the default small tree (not adopted)."""
    return make_workspace()


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[DaemonProcess]:
    """One started daemon per test module (defaults); make workspaces with its `make_workspace`."""
    with _daemons(short_tempdir) as factory:
        yield factory()
