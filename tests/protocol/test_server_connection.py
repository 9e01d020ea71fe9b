"""One `Connection` in process over a socket pair: where unexpected errors stop.

The end-to-end behaviour is in `tests/protocol/test_server.py` (a real daemon); here a fault is
planted inside the server (a decoder or a handler that raises) to show that the
connection task contains it: the client gets an `internal` error, the journal records
an `internal` entry with exception type names only, and nothing propagates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from substrate.config import Config
from substrate.errors import ArgvDenied
from substrate.protocol import rpc, server
from substrate.protocol.caller import Caller
from substrate.protocol.connection import ConnectionState, UnsentBytes
from substrate.store.db import Store
from substrate.store.journal import Journal

Handler = Callable[[Caller, Any], Awaitable[Any]]


@dataclass
class FakeDaemon:
    """What a `Connection` is given (a `server.Backend`): config, dispatcher, journal.

    `handlers` maps a method name to `async (caller, params) -> result`.
    """

    config: Config
    journal: Journal
    handlers: dict[str, Handler] = field(default_factory=dict)

    async def dispatch(self, method: str, caller: Caller, params: Any) -> Any:
        return await self.handlers[method](caller, params)

    def backend(self) -> server.Backend:
        return server.Backend(
            config=self.config, dispatch=self.dispatch, record=self.journal.append
        )


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    store = Store(tmp_path / "db")
    yield FakeDaemon(Config(state_dir=str(tmp_path / "state")), Journal(store))
    store.close()


def connection(
    daemon: FakeDaemon,
    stream: trio.SocketStream,
    admission: server.Admission | None = None,
    outbox: server.Outbox | None = None,
) -> server.Connection:
    """A connection on a socket of its own, unless it is given the socket's shares."""
    return server.Connection(
        daemon.backend(),
        stream,
        "agent",
        admission or server.Admission(daemon.config),
        outbox or server.Outbox(daemon.config),
    )


class Peer:
    """The client end of the pair: send lines, read messages until EOF."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def messages_until_eof(self) -> list[dict[str, Any]]:
        with trio.fail_after(10):
            while chunk := await self.stream.receive_some(65536):
                self.buf += chunk
        return [msgspec.json.decode(line) for line in self.buf.splitlines() if line.strip()]


async def serve_one(daemon: FakeDaemon, lines: list[bytes]) -> list[dict[str, Any]]:
    """Run one connection for `lines` (then half-close); return every message it sent."""
    ours, theirs = trio.socket.socketpair()
    conn = connection(daemon, trio.SocketStream(ours))
    peer = Peer(trio.SocketStream(theirs))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)  # raises into this nursery if anything escapes
        await peer.stream.send_all(b"".join(line + b"\n" for line in lines))
        await peer.stream.send_eof()
        messages = await peer.messages_until_eof()
    await peer.stream.aclose()
    return messages


def internal_entries(daemon: FakeDaemon) -> list[dict[str, Any]]:
    return [{"actor": e.actor, **e.data} for e in daemon.journal.read() if e.kind == "internal"]


async def test_a_fault_in_the_connection_task_is_contained(
    fake_daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_decoder(line: bytes) -> rpc.Call | rpc.Outcome:
        raise RuntimeError("a bug in the decoder, with a secret: hunter2")

    monkeypatch.setattr(rpc, "decode_call", broken_decoder)
    messages = await serve_one(fake_daemon, [b'{"jsonrpc":"2.0","id":1,"method":"x"}'])
    assert len(messages) == 1
    assert messages[0]["id"] is None
    assert messages[0]["error"]["data"] == {"refusal": "internal"}
    [entry] = internal_entries(fake_daemon)
    assert entry["where"] == "connection"
    assert entry["errors"] == ["RuntimeError"]
    assert entry["actor"].startswith("agent:")
    assert "hunter2" not in str(fake_daemon.journal.read())


async def test_a_fault_in_a_handler_is_answered_and_journaled(fake_daemon: FakeDaemon) -> None:
    async def broken_handler(caller: Any, params: Any) -> Any:
        raise KeyError("hunter2")

    fake_daemon.handlers["daemon.status"] = broken_handler
    messages = await serve_one(
        fake_daemon,
        [
            b'{"jsonrpc":"2.0","id":7,"method":"daemon.status"}',
            b'{"jsonrpc":"2.0","id":8,"method":"daemon.status"}',
        ],
    )
    # The connection goes on after the first fault: both calls are answered.
    assert sorted(m["id"] for m in messages) == [7, 8]
    assert all(m["error"]["data"] == {"refusal": "internal"} for m in messages)
    entries = internal_entries(fake_daemon)
    assert [(e["where"], e["method"], e["errors"]) for e in entries] == [
        ("call", "daemon.status", ["KeyError"]),
        ("call", "daemon.status", ["KeyError"]),
    ]
    assert "hunter2" not in str(fake_daemon.journal.read())


async def test_a_half_closed_peer_gets_the_reply_of_a_slow_call(fake_daemon: FakeDaemon) -> None:
    release = trio.Event()

    async def slow_handler(caller: Any, params: Any) -> Any:
        await release.wait()
        return {"ok": True}

    fake_daemon.handlers["daemon.status"] = slow_handler
    ours, theirs = trio.socket.socketpair()
    conn = connection(fake_daemon, trio.SocketStream(ours))
    peer = Peer(trio.SocketStream(theirs))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        # The last line has no newline: the end of input ends it.
        await peer.stream.send_all(b'{"jsonrpc":"2.0","id":3,"method":"daemon.status"}')
        await peer.stream.send_eof()
        # Once every task is blocked, the server has read the EOF; the call still runs.
        await trio.testing.wait_all_tasks_blocked()
        assert conn.state.in_flight == 1
        release.set()
        messages = await peer.messages_until_eof()
    await peer.stream.aclose()
    assert messages == [{"jsonrpc": "2.0", "id": 3, "result": {"ok": True}}]


def test_a_refused_run_journals_its_argv_only_as_a_summary() -> None:
    secret = "sk-live-inline-prompt-0f9e8d7c"
    argv = ["python3", "-c", f"print('{secret}')"]
    line = msgspec.json.encode(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "proc.run",
            "params": {"workspace": "ws_0123456789abcdef", "profile": "default", "argv": argv},
        }
    )
    call = rpc.decode_call(line)
    assert isinstance(call, rpc.Call)
    data, workspace = server.refusal_record(call, ArgvDenied("python3 is not allowed"))
    assert workspace == "ws_0123456789abcdef"
    assert data == {
        "method": "proc.run",
        "refusal": "argv_denied",
        "argv0": "python3",
        "argc": 3,
        "argv_sha256": hashlib.sha256(msgspec.json.encode(argv)).hexdigest(),
    }
    assert secret not in msgspec.json.encode(data).decode()


# --- the daemon's choice not to read (docs/protocol.md §1 "Concurrency") -------------------


def status_line(request_id: int | None) -> bytes:
    """A `daemon.status` request (a notification when `request_id` is None)."""
    envelope: dict[str, Any] = {"jsonrpc": "2.0", "method": "daemon.status"}
    if request_id is not None:
        envelope["id"] = request_id
    return msgspec.json.encode(envelope) + b"\n"


async def read_messages(peer: Peer, count: int) -> list[dict[str, Any]]:
    """Exactly `count` messages from `peer` (failing if the connection ends first)."""
    while peer.buf.count(b"\n") < count:
        chunk = await peer.stream.receive_some(65536)
        assert chunk, f"closed before {count} messages"
        peer.buf += chunk
    *lines, peer.buf = peer.buf.split(b"\n", count)
    return [msgspec.json.decode(line) for line in lines]


async def test_pipelined_slow_calls_past_the_in_flight_cap_are_all_answered(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """While the daemon does not read (its in-flight cap is reached) the line deadline does
    not run: the client's half-read line is not held against it."""
    store = Store(tmp_path / "db")
    daemon = FakeDaemon(
        Config(state_dir=str(tmp_path / "state"), line_timeout_s=1.0, max_in_flight=64),
        Journal(store),
    )
    cancelled = 0

    async def slow(caller: Any, params: Any) -> Any:
        nonlocal cancelled
        try:
            await trio.sleep(5)  # five line timeouts
        except trio.Cancelled:
            cancelled += 1
            raise
        return {"ok": True}

    daemon.handlers["daemon.status"] = slow
    lines = b"".join(status_line(i) for i in range(67))
    # 65 whole lines and half of the 66th: the 65th waits for a slot, the 66th is pending.
    cut = len(b"".join(status_line(i) for i in range(65))) + len(status_line(65)) // 2
    ours, theirs = trio.socket.socketpair()
    conn = connection(daemon, trio.SocketStream(ours))
    peer = Peer(trio.SocketStream(theirs))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        await peer.stream.send_all(lines[:cut])
        await trio.testing.wait_all_tasks_blocked()
        assert conn.state.in_flight == 64
        await peer.stream.send_all(lines[cut:])
        with trio.fail_after(60):
            replies = await read_messages(peer, 67)
        await peer.stream.send_eof()
        assert await peer.messages_until_eof() == []
    await peer.stream.aclose()
    store.close()
    assert sorted(r["id"] for r in replies) == list(range(67))
    assert all(r["result"] == {"ok": True} for r in replies)
    assert cancelled == 0


async def test_unread_replies_are_bounded_per_connection_and_per_uid(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients that ask for large replies and never read them hold at most the budgets'
    bytes (plus one reply) in the daemon, per connection and per uid; a connection over
    budget is not read; everything is given back when they go."""
    per_connection, per_uid, reply = 1 << 20, 2 << 20, 200 << 10
    store = Store(tmp_path / "db")
    config = Config(
        state_dir=str(tmp_path / "state"),
        max_unsent_bytes=per_connection,
        max_unsent_bytes_per_uid=per_uid,
    )
    daemon = FakeDaemon(config, Journal(store))
    big = msgspec.Raw(b'"' + b"x" * reply + b'"')

    async def large(caller: Any, params: Any) -> Any:
        return big

    daemon.handlers["daemon.status"] = large
    peaks = {"connection": 0, "uid": 0}
    queued, added = ConnectionState.queued, UnsentBytes.add

    def queued_peak(state: ConnectionState, n: int) -> None:
        queued(state, n)
        peaks["connection"] = max(peaks["connection"], state.unsent_bytes)

    def added_peak(unsent: UnsentBytes, uid: int, n: int) -> None:
        added(unsent, uid, n)
        peaks["uid"] = max(peaks["uid"], unsent.by_uid[uid])

    monkeypatch.setattr(ConnectionState, "queued", queued_peak)
    monkeypatch.setattr(UnsentBytes, "add", added_peak)
    admission, outbox = server.Admission(config), server.Outbox(config)
    calls = b"".join(status_line(i) for i in range(200))
    conns: list[server.Connection] = []
    peers: list[trio.SocketStream] = []
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            ours, theirs = trio.socket.socketpair()
            conn = connection(daemon, trio.SocketStream(ours), admission, outbox)
            conns.append(conn)
            peers.append(trio.SocketStream(theirs))
            nursery.start_soon(conn.run)
            await peers[-1].send_all(calls)  # and never read
        await trio.testing.wait_all_tasks_blocked()
        one_reply = len(rpc.reply_result(0, big))
        assert 0 < peaks["connection"] <= per_connection + one_reply
        assert per_connection < peaks["uid"] <= per_uid + one_reply
        # Over budget, the daemon stops reading: most of the 800 calls never started.
        assert sum(c.state.in_flight for c in conns) < 4 * 64
        for peer in peers:
            await peer.aclose()
    assert outbox.unsent.by_uid == {}
    assert all(c.state.unsent_bytes == 0 for c in conns)
    store.close()


async def test_one_connection_takes_a_bounded_share_of_each_turn(
    fake_daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notifications nobody answers (here: of an unknown method) are read a few lines per
    turn of the event loop, as any line: others are served between them."""
    decoded = 0
    real_decode = rpc.decode_call

    def counting(line: bytes) -> rpc.Call | rpc.Outcome:
        nonlocal decoded
        decoded += 1
        return real_decode(line)

    monkeypatch.setattr(rpc, "decode_call", counting)
    flood = b'{"jsonrpc":"2.0","method":"no.such"}\n' * 1500  # one read's worth
    ours, theirs = trio.socket.socketpair()
    conn = connection(fake_daemon, trio.SocketStream(ours))
    peer = Peer(trio.SocketStream(theirs))
    steps: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        await peer.stream.send_all(flood)
        with trio.fail_after(10):
            while decoded < 1500:
                before = decoded
                await trio.lowlevel.checkpoint()
                steps.append(decoded - before)
        await peer.stream.send_eof()
        assert await peer.messages_until_eof() == []
    await peer.stream.aclose()
    # Between two turns of this task the reader had at most two turns of its own, each of
    # at most 16 lines (docs/protocol.md §1, "A connection's share").
    assert len(steps) > 1
    assert max(steps) <= 2 * 16


async def test_notifications_hold_in_flight_slots_like_requests(fake_daemon: FakeDaemon) -> None:
    release = trio.Event()
    ran = 0

    async def blocking(caller: Any, params: Any) -> Any:
        nonlocal ran
        ran += 1
        await release.wait()
        return {}

    fake_daemon.handlers["daemon.status"] = blocking
    ours, theirs = trio.socket.socketpair()
    conn = connection(fake_daemon, trio.SocketStream(ours))
    peer = Peer(trio.SocketStream(theirs))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        await peer.stream.send_all(b"".join(status_line(None) for _ in range(100)))
        await trio.testing.wait_all_tasks_blocked()
        assert (ran, conn.state.in_flight) == (64, 64)
        release.set()
        await peer.stream.send_eof()
        assert await peer.messages_until_eof() == []
    await peer.stream.aclose()
    assert ran == 100
