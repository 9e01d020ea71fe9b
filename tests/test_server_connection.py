"""One `Connection` in process over a socket pair: where unexpected errors stop.

The end-to-end behaviour is in `tests/test_server.py` (a real daemon); here a fault is
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


def connection(daemon: FakeDaemon, stream: trio.SocketStream) -> server.Connection:
    return server.Connection(daemon.backend(), stream, "agent", server.Admission(daemon.config))


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
