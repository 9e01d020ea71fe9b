"""Daemon start-up and shutdown, as a subprocess (docs/protocol.md §1, §2, §8, §9).

Start-up refusals leave the daemon not running, with a message naming the problem, and
never touch what a planted symlink points at. Shutdown on SIGTERM/SIGINT lets an
in-flight write finish, journals `daemon.stopped` and exits 0.
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import socket
import sqlite3
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

from substrate.config import Config
from substrate.daemon import open_daemon
from substrate.errors import StartupError
from substrate.protocol.client import Client, ConnectionLost, RpcError
from tests.harness import wait_until

if TYPE_CHECKING:
    from conftest import DaemonProcess

MiB = 1 << 20
PATIENCE_S = 30.0


def journal_rows(d: DaemonProcess) -> list[dict[str, Any]]:
    """The journal read straight from the database (works while the daemon is down)."""
    db = sqlite3.connect(f"file:{d.state_dir / 'substrate.db'}?mode=ro", uri=True)
    try:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM journal ORDER BY seq")]
    finally:
        db.close()


def wait_exit(d: DaemonProcess) -> int:
    assert d.proc is not None
    try:
        return d.proc.wait(PATIENCE_S)
    except Exception:
        d.proc.kill()
        raise


# --- the state dir ---------------------------------------------------------------------------


def test_state_dir_is_created_0700(daemon: DaemonProcess) -> None:
    st = os.lstat(daemon.state_dir)
    assert stat.S_ISDIR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()
    assert stat.S_IMODE(os.lstat(daemon.state_dir / "substrate.db").st_mode) == 0o600


def test_existing_state_dir_is_tightened_to_0700(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(start=False)
    d.state_dir.mkdir(mode=0o755)
    os.chmod(d.state_dir, 0o755)
    d.start()
    assert stat.S_IMODE(os.lstat(d.state_dir).st_mode) == 0o700


def test_state_dir_symlink_is_refused(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(start=False, prewarmed=False)
    real = d.base / "elsewhere"
    real.mkdir(mode=0o755)
    os.chmod(real, 0o755)
    d.state_dir.symlink_to(real)
    d.spawn()
    assert wait_exit(d) != 0
    assert "state dir" in d.stderr()
    assert list(real.iterdir()) == []
    assert stat.S_IMODE(os.lstat(real).st_mode) == 0o755


def test_state_dir_owned_by_someone_else_is_refused(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(start=False, prewarmed=False)
    d.state_dir.mkdir(mode=0o700)
    os.chown(d.state_dir, 1000, 1000)
    d.spawn()
    assert wait_exit(d) != 0
    assert "uid 1000" in d.stderr()
    assert list(d.state_dir.iterdir()) == []


# --- open_daemon, in process -------------------------------------------------------------------


async def test_open_daemon_opens_the_services_and_closes_them_on_exit(tmp_path: Path) -> None:
    config = Config(state_dir=str(tmp_path / "state"), listen="127.0.0.1:0")
    async with open_daemon(config) as daemon:
        assert daemon.journal.epoch == 1
        assert daemon.journal.count() == 0
        assert daemon.execution.profiles and daemon.terminals.grants is not None
        store = daemon.store
    with pytest.raises(sqlite3.ProgrammingError):
        store.query("SELECT 1")


async def test_open_daemon_refuses_a_symlinked_state_dir(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "state").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StartupError, match="not a plain directory"):
        async with open_daemon(Config(state_dir=str(tmp_path / "state"))):
            raise AssertionError("opened on a symlink")
    assert list((tmp_path / "elsewhere").iterdir()) == []


# --- sockets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["substrate.sock", "operator.sock"])
@pytest.mark.parametrize("target_kind", ["file", "missing", "dir"])
def test_symlink_at_socket_path_is_refused_not_followed(
    daemon_factory: Callable[..., DaemonProcess], which: str, target_kind: str
) -> None:
    d = daemon_factory(start=False, prewarmed=False)
    d.state_dir.mkdir(mode=0o700)
    victim_dir = d.base / "victim"
    victim_dir.mkdir()
    target = victim_dir / "target"
    if target_kind == "file":
        target.write_bytes(b"precious\n")
    elif target_kind == "dir":
        target.mkdir()
    (d.state_dir / which).symlink_to(target)
    before = (
        sorted(os.listdir(victim_dir)),
        (target.read_bytes() if target_kind == "file" else None),
    )

    d.spawn()
    code = wait_exit(d)
    assert code != 0
    assert which in d.stderr()
    # Nothing was created, replaced or bound through the link.
    assert os.path.islink(d.state_dir / which)
    assert os.readlink(d.state_dir / which) == str(target)
    after = sorted(os.listdir(victim_dir)), (target.read_bytes() if target_kind == "file" else None)
    assert after == before
    if target_kind == "dir":
        assert list(target.iterdir()) == []
    # And the daemon is not half up: neither socket answers.
    for path in (d.agent_path, d.operator_path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(OSError):
            s.connect(str(path))


def test_regular_file_at_socket_path_is_refused(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(start=False, prewarmed=False)
    d.state_dir.mkdir(mode=0o700)
    d.agent_path.write_bytes(b"not a socket\n")
    d.spawn()
    assert wait_exit(d) != 0
    assert d.agent_path.read_bytes() == b"not a socket\n"


def test_startup_refusal_is_a_clean_message(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A refused start says `substrate: <why>` and exits 2, like a config error."""
    d = daemon_factory(start=False, prewarmed=False)
    d.state_dir.mkdir(mode=0o700)
    d.agent_path.symlink_to(d.base / "nowhere")
    d.spawn()
    assert wait_exit(d) == 2
    log = d.stderr()
    assert "substrate: " in log and "substrate.sock" in log
    assert "Traceback" not in log


def test_stale_socket_from_a_crash_is_replaced(daemon: DaemonProcess) -> None:
    daemon.kill()
    assert stat.S_ISSOCK(os.lstat(daemon.agent_path).st_mode)  # left behind by the crash
    daemon.start()
    with daemon.client() as c:
        assert c.call("daemon.status")["epoch"] == 2


def test_stale_socket_planted_before_start_is_replaced(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(start=False)
    d.state_dir.mkdir(mode=0o700)
    for path in (d.agent_path, d.operator_path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        s.close()
    d.start()
    with d.client() as c:
        assert c.call("daemon.status")["version"]


def test_each_start_is_a_new_epoch(daemon: DaemonProcess) -> None:
    epochs = []
    for _ in range(3):
        with daemon.client() as c:
            epochs.append(c.call("daemon.status")["epoch"])
        daemon.restart()
    assert epochs == [1, 2, 3]
    starts = [r for r in journal_rows(daemon) if r["kind"] == "daemon.started"]
    assert [r["epoch"] for r in starts] == [1, 2, 3, 4]


def test_status_reports_the_daemons_own_memory_fds_and_threads(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    with daemon.client() as c:
        status = c.call("daemon.status")
        me = psutil.Process(daemon.proc.pid)
        rss, fds = me.memory_info().rss, me.num_fds()
    # The figures are the daemon process's (not its launcher's, not ours): they change as
    # it runs, so compare loosely.
    assert 0.5 * rss < status["rss_bytes"] < 2 * rss
    # At least both listening sockets, this connection and the database.
    assert 4 <= status["open_fds"] <= fds + 16
    assert status["threads"] >= 1


def test_workspace_containing_the_state_dir_is_refused(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(start=False)
    d.config["adopt_roots"] = [str(d.base)]
    d.config_path.write_text(
        f'state_dir = "{d.state_dir}"\nadopt_roots = ["{d.base}"]\nlisten = "127.0.0.1:0"\n'
    )
    d.start()
    with d.client() as c:
        with pytest.raises(RpcError) as info:
            c.call("workspace.adopt", path=str(d.base))
        assert info.value.refusal == "path_denied"
        # Nor the state dir itself.
        with pytest.raises(RpcError) as info:
            c.call("workspace.adopt", path=str(d.state_dir))
        assert info.value.refusal == "path_denied"


# --- shutdown --------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(daemon_factory: Callable[..., DaemonProcess], signum: int) -> None:
    """The literal `python -m substrate serve` command: started, served, stopped."""
    daemon = daemon_factory(prewarmed=False)
    with daemon.client() as c:
        c.call("daemon.status")
    assert daemon.proc is not None
    daemon.proc.send_signal(signum)
    assert wait_exit(daemon) == 0
    kinds = [r["kind"] for r in journal_rows(daemon)]
    assert kinds[0] == "daemon.started"
    assert kinds[-1] == "daemon.stopped"
    # The sockets are gone with the daemon.
    assert not daemon.agent_path.exists()
    assert not daemon.operator_path.exists()


def test_sigterm_lets_an_in_flight_write_finish(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(max_request_bytes=256 * MiB)
    root = d.make_workspace(files={"big.bin": b"old\n"})
    ws = d.adopt(root)
    new = os.urandom(96 * MiB)
    new_sha = hashlib.sha256(new).hexdigest()
    payload = base64.b64encode(new).decode()
    outcome: dict[str, Any] = {}

    def write() -> None:
        try:
            with Client(d.agent_path, timeout=120, max_request_bytes=256 * MiB) as c:
                outcome["plan"] = c.call(
                    "fs.write",
                    workspace=ws,
                    path="big.bin",
                    content_b64=payload,
                    base_sha256=hashlib.sha256(b"old\n").hexdigest(),
                )
        except (ConnectionLost, OSError) as exc:
            outcome["lost"] = exc

    writer = threading.Thread(target=write)
    writer.start()

    # The write is in flight once its temp file exists in the target's directory.
    def in_flight() -> bool:
        assert writer.is_alive(), outcome
        return any(n.startswith(".substrate-tmp-") for n in os.listdir(root))

    wait_until(in_flight, PATIENCE_S, interval=0.001, message="the write never started")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    code = wait_exit(d)
    writer.join(PATIENCE_S)
    assert code == 0
    assert hashlib.sha256((root / "big.bin").read_bytes()).hexdigest() == new_sha
    assert [n for n in os.listdir(root) if n.startswith(".substrate-tmp-")] == []
    rows = journal_rows(d)
    kinds = [r["kind"] for r in rows]
    assert kinds[-1] == "daemon.stopped"
    writes = [r for r in rows if r["kind"] == "fs.write"]
    assert len(writes) == 1 and new_sha in writes[0]["data"]
    # The client that asked is told it applied (a finished write must not look lost).
    assert "plan" in outcome, outcome
    assert outcome["plan"]["applied"] is True
