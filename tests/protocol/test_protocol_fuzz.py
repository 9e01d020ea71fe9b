"""Hostile request lines against a real daemon, on both sockets: nothing ends the daemon.

Every line, whatever its shape, gets a reply or a clean close, and the connection (or a
new one) is served afterwards. Nesting depth first (the 2 KB line of 1,000 nested arrays
used to end the process), then a seeded generator of deep, wide, truncated and
out-of-range lines; the seed is printed so that a failure can be replayed
(`SUBSTRATE_FUZZ_SEED`). At the end the journal holds no `internal` entry: none of these
lines found a bug.
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from substrate.protocol.rpc import MAX_DEPTH

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

PATIENCE_S = 30.0
SOCKETS = ["agent", "operator"]


class Line:
    """A raw connection: send a line, read messages until the reply to a sentinel."""

    def __init__(self, d: DaemonProcess, which: str) -> None:
        self.sock = d.raw(operator=which == "operator", timeout=PATIENCE_S)
        self.buf = b""
        self.sentinels = 0

    def close(self) -> None:
        self.sock.close()

    def message(self) -> dict[str, Any] | None:
        """The next message, or None once the daemon has closed the connection."""
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(1 << 16)
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        value: dict[str, Any] = json.loads(line)
        return value

    def exchange(self, line: bytes) -> list[dict[str, Any]] | None:
        """Send `line` then a sentinel status call; every message up to the sentinel's reply.

        None: the daemon closed the connection (a clean close is an allowed answer).
        """
        self.sentinels += 1
        sentinel = f"sentinel-{self.sentinels}"
        status = {"jsonrpc": "2.0", "id": sentinel, "method": "daemon.status"}
        try:
            self.sock.sendall(line + b"\n" + json.dumps(status).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            return None
        seen: list[dict[str, Any]] = []
        while (message := self.message()) is not None:
            if message.get("id") == sentinel:
                assert "result" in message, message
                return seen
            seen.append(message)
        return None


@pytest.fixture(params=SOCKETS)
def line(request: pytest.FixtureRequest, module_daemon: DaemonProcess) -> Iterator[Line]:
    conn = Line(module_daemon, request.param)
    yield conn
    conn.close()


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return opener * depth + closer * depth


def deep_object(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def call(params: bytes, method: bytes = b"daemon.status", id: bytes = b"1") -> bytes:
    return b'{"jsonrpc":"2.0","id":%s,"method":"%s","params":%s}' % (id, method, params)


def assert_too_deep(messages: list[dict[str, Any]] | None) -> None:
    assert messages is not None, "the daemon closed instead of answering"
    [reply] = messages
    assert reply["id"] is None
    assert reply["error"]["data"] == {"refusal": "request_too_deep", "limit": MAX_DEPTH}


def assert_alive(d: DaemonProcess) -> None:
    assert d.running, d.stderr()
    with d.client(timeout=PATIENCE_S) as c:
        assert c.call("daemon.status")["version"]


@pytest.mark.parametrize(
    "payload",
    [
        nested(1000),  # 2 KB: this line used to end the daemon
        nested(1000, b"{", b"}"),
        b"[" * 200_000,  # never closed
        call(b'{"a":' + nested(1000) + b"}"),
        call(deep_object(1000)),
        call(deep_object(MAX_DEPTH)),  # one level over: envelope + 64
        call(b"{}", id=nested(500)),
        call(b'{"workspace":' + nested(800) + b"}", method=b"journal.read"),
        b'{"jsonrpc":"2.0","method":"daemon.status","params":{"a":' + nested(900) + b"}}",
    ],
    ids=[
        "arrays",
        "objects",
        "unclosed",
        "params-arrays",
        "params-objects",
        "one-over",
        "in-id",
        "in-a-field",
        "notification",
    ],
)
def test_deep_nesting_is_refused_and_the_connection_goes_on(
    line: Line, module_daemon: DaemonProcess, payload: bytes
) -> None:
    assert_too_deep(line.exchange(payload))
    assert_too_deep(line.exchange(payload))  # and again, on the same connection
    assert_alive(module_daemon)


def test_depth_at_the_limit_is_parsed(line: Line) -> None:
    messages = line.exchange(call(deep_object(MAX_DEPTH - 1), id=b"7"))
    assert messages is not None
    [reply] = messages
    assert reply["id"] == 7
    assert reply["error"]["data"] == {"refusal": "invalid_params", "path": "$.a"}


def test_brackets_in_strings_are_text(line: Line) -> None:
    text = json.dumps("[" * 5000 + "{" * 5000).encode()
    messages = line.exchange(call(b'{"workspace":' + text + b"}", method=b"journal.read", id=b"8"))
    assert messages is not None
    [reply] = messages
    assert reply["id"] == 8
    assert reply["error"]["data"]["refusal"] == "invalid_params"  # too long a handle


# --- seeded generator --------------------------------------------------------------------------

METHODS = ["daemon.status", "journal.read", "workspace.list", "fs.stat", "proc.status", "x.y"]
FIELDS = ["since", "limit", "workspace", "path", "proc", "a", ""]


def random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(9 if depth < 6 else 5)
    if kind == 0:
        return rng.choice([2**63, -(2**63) - 1, 10**30, 2**63 - 1, 0, -1, 1.5e300])
    if kind == 1:
        return rng.choice(["", "[[[[", '"\\', "ws_0", "a/b", "\u2028", "x" * 300])
    if kind == 2:
        return rng.choice([None, True, False])
    if kind in (3, 4):
        return rng.randrange(-1000, 1000)
    if kind in (5, 6):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def random_line(rng: random.Random) -> bytes:
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": rng.choice(METHODS)}
    if rng.random() < 0.9:
        body["id"] = rng.choice([1, "s", None, 2**70, [1], {"a": 1}])
    if rng.random() < 0.9:
        body["params"] = {rng.choice(FIELDS): random_value(rng, 0) for _ in range(3)}
    raw = json.dumps(body).encode()
    mutation = rng.randrange(6)
    if mutation == 0:  # wrap somewhere in deep brackets
        depth = rng.choice([MAX_DEPTH - 3, MAX_DEPTH + 1, 500, 5000])
        at = rng.randrange(len(raw))
        return raw[:at] + b"[" * depth + raw[at:] + b"]" * depth
    if mutation == 1:  # truncated
        return raw[: rng.randrange(len(raw))]
    if mutation == 2:  # a byte replaced
        at = rng.randrange(len(raw))
        return raw[:at] + bytes([rng.choice(b'[]{}",:\\0 \xff')]) + raw[at + 1 :]
    if mutation == 3:  # huge integer literal spliced in
        return raw.replace(b"1", b"9" * rng.choice([19, 20, 400, 5000]), 1)
    return raw


@pytest.mark.parametrize("which", SOCKETS)
def test_seeded_hostile_lines(module_daemon: DaemonProcess, which: str) -> None:
    seed = int(os.environ.get("SUBSTRATE_FUZZ_SEED", str(random.randrange(1 << 30))))
    print(f"SUBSTRATE_FUZZ_SEED={seed}")
    rng = random.Random(seed)
    conn = Line(module_daemon, which)
    closes = 0
    try:
        for _ in range(300):
            payload = random_line(rng)
            messages = conn.exchange(payload)
            if messages is None:  # a clean close; the next line gets a new connection
                closes += 1
                conn.close()
                conn = Line(module_daemon, which)
                continue
            for message in messages:
                assert message.get("jsonrpc") == "2.0", (payload, message)
                refusal = message.get("error", {}).get("data", {}).get("refusal")
                assert refusal != "internal", (payload, message)
    finally:
        conn.close()
    assert closes == 0
    assert_alive(module_daemon)


def test_the_daemon_survives_a_raw_socket_storm(module_daemon: DaemonProcess) -> None:
    for payload in (nested(10_000), b"\x00" * 5000, b"{" * 100_000 + b"\n" * 3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(PATIENCE_S)
            s.connect(str(module_daemon.agent_path))
            s.sendall(payload + b"\n")
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
    assert_alive(module_daemon)


def test_no_line_found_a_bug(module_daemon: DaemonProcess) -> None:
    """A fixed corpus (deep lines and 100 seeded ones) on both sockets, each
    answered; then the journal holds no `internal` entry. Run with the module, it also
    covers every line the tests above sent, as it runs last."""
    rng = random.Random(0)
    corpus = [
        nested(1000),
        call(deep_object(MAX_DEPTH)),
        call(deep_object(MAX_DEPTH - 1)),
        *(random_line(rng) for _ in range(100)),
    ]
    for which in SOCKETS:
        conn = Line(module_daemon, which)
        try:
            for payload in corpus:
                messages = conn.exchange(payload)
                assert messages is not None, payload  # the daemon answered, not closed
        finally:
            conn.close()
    assert module_daemon.journal(kinds={"internal"}) == []
    assert module_daemon.verify_journal()["ok"]
