"""The agent and operator sockets end to end (docs/protocol.md §1): framing, errors, peers, caps.

Every test talks to a real daemon subprocess through raw sockets, so what is checked is
what a client sees on the wire. Timeouts here are configured small to keep the tests
short; nothing asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.protocol.client import Client, ConnectionLost, RpcError
from tests.harness import wait_until

if TYPE_CHECKING:
    from conftest import DaemonProcess

MiB = 1 << 20
#: How long a test waits for something that must happen (a failure, not a measurement).
PATIENCE_S = 30.0


def request(method: str, id: Any = 1, **params: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()


class Wire:
    """A raw connection reading newline-delimited JSON messages."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def message(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionLost("closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        value: dict[str, Any] = json.loads(line)
        return value

    def closed(self) -> bool:
        """True once the daemon has closed (EOF or reset), waiting at most PATIENCE_S."""
        self.sock.settimeout(PATIENCE_S)
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return True
                self.buf += chunk
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def wire(module_daemon: DaemonProcess) -> Iterator[Callable[..., Wire]]:
    made: list[Wire] = []

    def connect(operator: bool = False) -> Wire:
        w = Wire(module_daemon.raw(operator=operator, timeout=PATIENCE_S))
        made.append(w)
        return w

    yield connect
    for w in made:
        w.close()


def assert_served(d: DaemonProcess) -> None:
    with Client(d.agent_path, timeout=PATIENCE_S) as c:
        assert c.call("daemon.status")["version"]


# --- framing and JSON-RPC errors ----------------------------------------------------------


def test_status_on_both_sockets(module_daemon: DaemonProcess) -> None:
    with module_daemon.client() as agent, module_daemon.operator() as operator:
        a, o = agent.call("daemon.status"), operator.call("daemon.status")
    assert a["epoch"] == o["epoch"] >= 1
    assert a["version"] == o["version"]


def test_invalid_json_is_a_parse_error_and_the_connection_survives(
    wire: Callable[..., Wire],
) -> None:
    w = wire()
    w.send(b'{"jsonrpc": "2.0", "id": 1, "method": \n')
    reply = w.message()
    assert reply["id"] is None
    assert reply["error"]["code"] == -32700
    w.send(b"not json at all\n")
    assert w.message()["error"]["code"] == -32700
    w.send(request("daemon.status", id=2) + b"\n")
    assert w.message()["id"] == 2


@pytest.mark.parametrize(
    "line",
    [
        b"[1, 2, 3]",
        b'{"jsonrpc": "2.0", "id": 3}',
        b'{"jsonrpc": "1.0", "id": 3, "method": "daemon.status"}',
        b'{"jsonrpc": "2.0", "id": 3, "method": "daemon.status", "extra": 1}',
        b'{"jsonrpc": "2.0", "id": 3, "method": 7}',
        b'{"jsonrpc": "2.0", "id": 3, "method": "daemon.status", "params": [1]}',
    ],
)
def test_invalid_request(wire: Callable[..., Wire], line: bytes) -> None:
    w = wire()
    w.send(line + b"\n")
    reply = w.message()
    assert reply["error"]["code"] == -32600
    assert reply["id"] in (None, 3)


def test_unknown_method(wire: Callable[..., Wire]) -> None:
    w = wire()
    w.send(request("fs.frobnicate", id="abc") + b"\n")
    reply = w.message()
    assert reply["id"] == "abc"
    assert reply["error"]["code"] == -32601


def test_notifications_get_no_reply(wire: Callable[..., Wire]) -> None:
    w = wire()
    w.send(b'{"jsonrpc": "2.0", "method": "daemon.status"}\n')
    w.send(b'{"jsonrpc": "2.0", "method": "no.such.method"}\n')
    w.send(request("daemon.status", id=9) + b"\n")
    assert w.message()["id"] == 9


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("fs.read", {"workspace": "w", "path": 3}, "$.path"),
        ("fs.read", {"workspace": "w", "path": "a", "offset": "0"}, "$.offset"),
        ("fs.read", {"workspace": "w", "path": "a", "offset": -1}, "$.offset"),
        ("fs.read", {"path": "a"}, "$.workspace"),
        ("fs.write", {"workspace": "w", "path": "a", "base_sha256": "xyz"}, "$.base_sha256"),
        (
            "fs.patch",
            {"workspace": "w", "path": "a", "base_sha256": "0" * 64, "edits": [{"old": 1}]},
            "$.edits[0].old",
        ),
        ("fs.search", {"workspace": "w", "pattern": ["x"]}, "$.pattern"),
        ("workspace.adopt", {"path": "/x", "policy": {"write_deny": "x"}}, "$.policy.write_deny"),
        ("journal.read", {"limit": True}, "$.limit"),
    ],
)
def test_wrong_param_types(
    wire: Callable[..., Wire], method: str, params: dict[str, Any], path: str
) -> None:
    w = wire()
    w.send(request(method, id=5, **params) + b"\n")
    error = w.message()["error"]
    assert error["code"] == -32602
    assert error["data"]["refusal"] == "invalid_params"
    assert error["data"]["path"] == path


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("fs.read", {"workspace": "w", "path": "a", "bogus": 1}, "$.bogus"),
        ("daemon.status", {"verbose": True}, "$.verbose"),
        (
            "fs.patch",
            {
                "workspace": "w",
                "path": "a",
                "base_sha256": "0" * 64,
                "edits": [{"old": "a", "new": "b", "cnt": 2}],
            },
            "$.edits[0].cnt",
        ),
    ],
)
def test_unknown_param_field(
    wire: Callable[..., Wire], method: str, params: dict[str, Any], path: str
) -> None:
    """Unknown fields are refused (never ignored), and `data.path` names the field."""
    w = wire()
    w.send(request(method, id=6, **params) + b"\n")
    error = w.message()["error"]
    assert error["code"] == -32602
    assert error["data"]["refusal"] == "invalid_params"
    assert error["data"]["path"] == path


def test_line_at_the_limit_is_served_one_byte_more_is_refused(
    module_daemon: DaemonProcess, wire: Callable[..., Wire]
) -> None:
    limit = 1 * MiB  # the default max_request_bytes
    base = request("daemon.status", id=1)
    w = wire()
    w.send(base + b" " * (limit - len(base)) + b"\n")
    assert w.message()["id"] == 1

    w = wire()
    w.send(base + b" " * (limit + 1 - len(base)))  # no newline needed to be too long
    reply = w.message()
    assert reply["id"] is None
    assert reply["error"]["data"]["refusal"] == "request_too_large"
    assert reply["error"]["data"]["limit"] == limit
    assert w.closed()
    assert_served(module_daemon)


def test_huge_line_is_refused_before_it_is_buffered(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(max_request_bytes=4096)
    with Wire(d.raw(timeout=PATIENCE_S)) as w:
        # Far more than the limit: the daemon answers and closes without reading it all.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            w.send(b"x" * (4 * MiB))
        reply = w.message()
        assert reply["error"]["data"]["refusal"] == "request_too_large"
        assert w.closed()
    assert_served(d)


# --- authorization --------------------------------------------------------------------------


def test_agent_cannot_call_operator_methods(module_daemon: DaemonProcess) -> None:
    digest = "a" * 64
    with module_daemon.client() as agent:
        with pytest.raises(RpcError) as info:
            agent.call("approval.grant", workspace="ws_x", plan_digest=digest)
        assert info.value.refusal == "unauthorized"
        # The connection is still usable after an unauthorized call.
        assert agent.call("daemon.status")["version"]
    with module_daemon.operator() as operator, pytest.raises(RpcError) as info:
        operator.call("approval.grant", workspace="ws_x", plan_digest=digest)
    assert info.value.refusal == "unknown_workspace"  # allowed there, refused for its params


def test_socket_modes(module_daemon: DaemonProcess) -> None:
    import stat

    agent = os.lstat(module_daemon.agent_path)
    operator = os.lstat(module_daemon.operator_path)
    assert stat.S_ISSOCK(agent.st_mode) and stat.S_ISSOCK(operator.st_mode)
    assert stat.S_IMODE(agent.st_mode) == 0o660
    assert stat.S_IMODE(operator.st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(module_daemon.state_dir).st_mode) == 0o700


def test_peer_uid_not_in_allow_list(daemon_factory: Callable[..., DaemonProcess]) -> None:
    """We are root; a daemon that allows only uid 4242 answers one unauthorized, then closes."""
    d = daemon_factory(allowed_uids=[4242])
    for path in (d.agent_path, d.operator_path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(PATIENCE_S)
            s.connect(str(path))
            w = Wire(s)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                w.send(request("daemon.status") + b"\n")
            reply = w.message()
            assert reply["id"] is None
            assert reply["error"]["data"]["refusal"] == "unauthorized"
            assert w.closed()
            assert "result" not in w.buf.decode()


#: Run as another uid: a stdlib-only script, under a system interpreter that user can exec.
_PEER_SCRIPT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
try:
    s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "daemon.status"}).encode() + b"\\n")
except OSError:
    pass
data = b""
try:
    while chunk := s.recv(65536):
        data += chunk
        if b"result" in data:
            break
except OSError:
    pass
sys.stdout.buffer.write(data)
"""


def _peer_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no system python3 that another uid can run")


def _connect_as(uid: int, path: Path) -> list[dict[str, Any]]:
    """Connect as `uid` (a child process), send a status request, return every reply."""
    done = subprocess.run(
        [_peer_python(), "-I", "-c", _PEER_SCRIPT, str(path)],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        timeout=PATIENCE_S * 2,
        check=True,
        cwd="/",
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _open_to_everyone(d: DaemonProcess) -> None:
    # The state dir is 0700 and the socket 0660 root: only then can uid 1000 reach it at all.
    os.chmod(d.base, 0o711)
    os.chmod(d.state_dir, 0o711)
    os.chmod(d.agent_path, 0o666)


def test_peer_uid_checked_with_so_peercred(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory()
    _open_to_everyone(d)
    replies = _connect_as(1000, d.agent_path)
    assert len(replies) == 1
    assert replies[0]["id"] is None
    assert replies[0]["error"]["data"]["refusal"] == "unauthorized"


def test_allowed_uid_is_served(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(allowed_uids=[1000])
    _open_to_everyone(d)
    replies = _connect_as(1000, d.agent_path)
    assert [r["id"] for r in replies] == [1]
    assert replies[0]["result"]["version"]


# --- concurrency, caps and deadlines --------------------------------------------------------


@pytest.fixture(scope="module")
def slow_tree(module_daemon: DaemonProcess) -> str:
    """A workspace whose search for a back-reference regex takes a noticeable while."""
    line = b"lorem ipsum dolor sit amet consectetur adipiscing elit " * 2 + b"\n"
    files: dict[str, str | bytes] = {f"f{i}.txt": line * (MiB // len(line)) for i in range(10)}
    files["small.txt"] = "small\n"
    root = module_daemon.make_workspace("slow-tree", files)
    return module_daemon.adopt(root)


SLOW_PATTERN = r"(\w+)\s+\1zzz"


def test_many_requests_in_flight_answered_out_of_order(
    wire: Callable[..., Wire], slow_tree: str
) -> None:
    w = wire()
    batch = [request("fs.search", id="slow", workspace=slow_tree, pattern=SLOW_PATTERN)]
    batch += [request("fs.stat", id=i, workspace=slow_tree, path="small.txt") for i in range(20)]
    w.send(b"\n".join(batch) + b"\n")
    replies = [w.message() for _ in range(21)]
    ids = [r["id"] for r in replies]
    assert sorted(ids, key=str) == sorted(["slow", *range(20)], key=str)
    by_id = {r["id"]: r for r in replies}
    assert by_id["slow"]["result"]["files_scanned"] == 11
    for i in range(20):
        assert by_id[i]["result"]["kind"] == "file"
    # The search was sent first; had the connection been served one request at a time its
    # reply would come first. It takes ~1 s, a stat ~1 ms.
    assert ids[0] != "slow"


def test_call_in_flight_outlives_idle_timeout(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(idle_timeout_s=0.3)
    line = b"lorem ipsum dolor sit amet " * 4 + b"\n"
    # ~1 s of searching: several idle timeouts long.
    root = d.make_workspace(files={f"f{i}": line * (MiB // len(line)) for i in range(12)})
    ws = d.adopt(root)
    with d.client() as c:
        result = c.call("fs.search", workspace=ws, pattern=SLOW_PATTERN)
    assert result["files_scanned"] == 12
    with Wire(d.raw()) as w:
        assert w.closed(), "an idle connection is closed after idle_timeout_s"


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))


@pytest.mark.slow
def test_thousand_idle_connections_do_not_starve_others(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    _raise_nofile(4096)
    d = daemon_factory()
    idle: list[Wire] = []
    try:
        for i in range(1000):
            w = Wire(d.raw(timeout=PATIENCE_S))
            # One round trip each, so every connection is accepted and counted.
            w.send(request("workspace.list", id=i) + b"\n")
            assert w.message()["id"] == i
            idle.append(w)
        assert_served(d)
        with d.client() as c:
            ws = c.call("workspace.adopt", path=str(d.make_workspace()))["workspace"]
            assert c.call("fs.read", workspace=ws, path="README.md")["data"].startswith("# demo")
        # The idle ones are still there and still served.
        for w in (idle[0], idle[499], idle[-1]):
            w.send(request("workspace.list", id="again") + b"\n")
            assert w.message()["id"] == "again"
    finally:
        for w in idle:
            w.close()


def test_connection_cap(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(max_connections=20)
    held: list[Wire] = []
    try:
        for i in range(20):
            w = Wire(d.raw(timeout=PATIENCE_S))
            w.send(request("workspace.list", id=i) + b"\n")
            assert w.message()["id"] == i
            held.append(w)
        extra = Wire(d.raw(timeout=PATIENCE_S))
        reply = extra.message()
        assert reply["error"]["data"]["refusal"] == "limit_exceeded"
        assert extra.closed()
        extra.close()
        # A freed slot is usable again (the daemon notices the close asynchronously).
        held.pop().close()

        def served() -> bool:
            try:
                assert_served(d)
            except (RpcError, ConnectionLost, ConnectionResetError, BrokenPipeError):
                return False
            return True

        wait_until(served, PATIENCE_S, interval=0.05, message="a freed slot was never reused")
    finally:
        for w in held:
            w.close()


@pytest.mark.slow
def test_slowloris_is_disconnected_while_others_are_served(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(line_timeout_s=1.0)
    slow = d.raw(timeout=PATIENCE_S)
    payload = request("daemon.status") + b"\n"
    disconnected = threading.Event()
    sent = 0

    def drip() -> None:
        nonlocal sent
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            try:
                slow.sendall(payload[sent % len(payload) : sent % len(payload) + 1])
            except (BrokenPipeError, ConnectionResetError):
                disconnected.set()
                return
            sent += 1
            readable, _, _ = select.select([slow], [], [], 0.4)
            if readable:
                try:
                    data = slow.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    disconnected.set()
                    return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        # Others are served all along.
        with d.client() as c:
            while not disconnected.is_set() and dripper.is_alive():
                assert c.call("daemon.status")["version"]
                disconnected.wait(0.1)  # paces the calls; ends the pause once cut off
    finally:
        dripper.join()
        slow.close()
    assert disconnected.is_set(), "a line dripping one byte at a time was never cut off"
    # One byte every 0.4 s never completes the ~60-byte request: it was cut by the
    # line deadline, not served.
    assert sent < len(payload)
    assert_served(d)


def test_idle_connection_closed_after_idle_timeout(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(idle_timeout_s=0.5)
    with Wire(d.raw()) as w:
        w.send(request("daemon.status") + b"\n")
        assert w.message()["id"] == 1
        assert w.closed()
    assert_served(d)


def test_client_vanishing_mid_call_does_not_hurt_the_daemon(
    module_daemon: DaemonProcess, slow_tree: str
) -> None:
    for _ in range(5):
        s = module_daemon.raw()
        s.sendall(request("fs.search", workspace=slow_tree, pattern="dolor") + b"\n")
        s.close()
    assert_served(module_daemon)


# --- end of input, per-uid caps, integers ----------------------------------------------------


def test_half_closed_connection_gets_every_reply(
    module_daemon: DaemonProcess, slow_tree: str
) -> None:
    """shutdown(SHUT_WR) after the requests: all are answered, then the daemon closes."""
    with Wire(module_daemon.raw(timeout=PATIENCE_S)) as w:
        w.send(request("fs.search", id="slow", workspace=slow_tree, pattern=SLOW_PATTERN) + b"\n")
        w.send(request("daemon.status", id="status") + b"\n")
        w.send(request("workspace.list", id="no-newline"))  # ended by the end of input
        w.sock.shutdown(socket.SHUT_WR)
        assert w.closed()
        replies = [json.loads(line) for line in w.buf.splitlines()]
    assert sorted(r["id"] for r in replies) == ["no-newline", "slow", "status"]
    assert all("result" in r for r in replies), replies


def test_peer_gone_entirely_does_not_keep_its_calls(
    module_daemon: DaemonProcess, slow_tree: str
) -> None:
    for _ in range(3):
        s = module_daemon.raw()
        s.sendall(request("fs.search", workspace=slow_tree, pattern=SLOW_PATTERN) + b"\n")
        s.close()
    assert_served(module_daemon)


def test_per_uid_cap_leaves_room_for_other_uids(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(max_connections=20, max_connections_per_uid=3, allowed_uids=[0, 1000])
    held: list[Wire] = []
    try:
        for i in range(3):
            w = Wire(d.raw(timeout=PATIENCE_S))
            w.send(request("workspace.list", id=i) + b"\n")
            assert w.message()["id"] == i
            held.append(w)
        with Wire(d.raw(timeout=PATIENCE_S)) as extra:
            error = extra.message()["error"]
            assert error["data"] == {"refusal": "limit_exceeded", "limit": 3, "scope": "uid"}
            assert extra.closed()
        # Another uid is still served while uid 0 holds all it may.
        _open_to_everyone(d)
        replies = _connect_as(1000, d.agent_path)
        assert [r["id"] for r in replies] == [1]
        # The operator socket has its own slots.
        with d.operator() as operator:
            assert operator.call("daemon.status")["version"]
    finally:
        for w in held:
            w.close()


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("journal.read", {"since": 2**63}, "$.since"),
        ("journal.read", {"since": 0, "limit": 2**64}, "$.limit"),
        ("fs.read", {"workspace": "w", "path": "a", "offset": 2**63}, "$.offset"),
    ],
)
def test_integer_out_of_range_is_invalid_params(
    wire: Callable[..., Wire], method: str, params: dict[str, Any], path: str
) -> None:
    w = wire()
    w.send(request(method, id=13, **params) + b"\n")
    reply = w.message()
    assert reply["id"] == 13
    assert reply["error"]["code"] == -32602
    assert reply["error"]["data"] == {"refusal": "invalid_params", "path": path}


def test_status_reports_the_real_terminal_address(module_daemon: DaemonProcess) -> None:
    """The daemon listens on 127.0.0.1:0 here: status says which port it got."""
    with module_daemon.client() as c:
        listen = c.call("daemon.status")["listen"]
    host, _, port = listen.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    with socket.create_connection((host, int(port)), timeout=PATIENCE_S) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 200")
