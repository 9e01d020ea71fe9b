"""substrate.protocol.client: refusals surface by name; a full notification queue never loses an exit.

The request-size tests talk to a real daemon; the notification tests feed an
`AsyncClient` from a socket pair (the server side is the test), so that the queue can be
filled on purpose.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import trio
import trio.testing

from substrate.protocol.client import (
    DEFAULT_MAX_REQUEST_BYTES,
    AsyncClient,
    Client,
    RpcError,
    open_client,
)
from substrate.schema.upload import chunk_bytes

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

LIMIT = 4096
MiB = 1 << 20


@pytest.mark.parametrize("size", [8 * 1024, 4 * MiB], ids=["buffered", "broken-pipe"])
def test_oversized_request_is_request_too_large(
    daemon_factory: Callable[..., DaemonProcess], size: int
) -> None:
    """Unchecked by the client (`max_request_bytes=None`): the daemon's refusal arrives."""
    d = daemon_factory(max_request_bytes=LIMIT)
    with (
        Client(d.agent_path, timeout=30, max_request_bytes=None) as c,
        pytest.raises(RpcError) as info,
    ):
        c.call("journal.read", workspace="x" * size)
    assert info.value.refusal == "request_too_large"
    assert info.value.data["limit"] == LIMIT


def test_known_limit_refuses_before_sending(daemon_factory: Callable[..., DaemonProcess]) -> None:
    d = daemon_factory(max_request_bytes=LIMIT)
    with Client(d.agent_path, timeout=30, max_request_bytes=LIMIT) as c:
        with pytest.raises(RpcError) as info:
            c.call("journal.read", workspace="x" * LIMIT)
        assert info.value.refusal == "request_too_large"
        # Nothing was sent: the connection is still good.
        assert c.call("daemon.status")["version"]


@pytest.mark.parametrize("size", [8 * 1024, 4 * MiB], ids=["buffered", "broken-pipe"])
async def test_async_oversized_request_is_request_too_large(
    daemon_factory: Callable[..., DaemonProcess], size: int
) -> None:
    d = daemon_factory(max_request_bytes=LIMIT)
    async with open_client(d.agent_path, max_request_bytes=None) as c:
        with pytest.raises(RpcError) as info, trio.fail_after(30):
            await c.call("journal.read", workspace="x" * size)
    assert info.value.refusal == "request_too_large"
    async with open_client(d.agent_path, max_request_bytes=LIMIT) as c:
        with pytest.raises(RpcError) as info:
            await c.call("journal.read", workspace="x" * size)
        assert info.value.refusal == "request_too_large"
        assert (await c.call("daemon.status"))["version"]


def test_by_default_a_line_over_the_daemons_default_limit_is_not_sent(
    daemon: DaemonProcess,
) -> None:
    """A write too big for one request line is a named refusal, never a broken pipe."""
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    with Client(daemon.agent_path, timeout=30) as c:
        assert c.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == MiB
        with pytest.raises(RpcError) as info:
            c.call("fs.write", workspace=ws, path="big.bin", base_sha256=None, content="x" * MiB)
        assert (info.value.refusal, info.value.data["limit"]) == ("request_too_large", MiB)
        assert c.call("daemon.status")["version"]  # nothing was sent: still connected
    assert not (root / "big.bin").exists()


class CountingClient(Client):
    """A `Client` that records the methods it called."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.methods: list[str] = []

    def call(self, method: str, **params: Any) -> Any:
        self.methods.append(method)
        return super().call(method, **params)


@pytest.mark.parametrize("mode", ["path", "file"])
def test_upload_file_chunks_what_one_line_cannot_hold(
    daemon: DaemonProcess, tmp_path: Path, mode: str
) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    data = os.urandom(3 * MiB + 7)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    limit = 256 * 1024
    with CountingClient(daemon.agent_path, timeout=60, max_request_bytes=limit) as c:
        if mode == "path":
            plan = c.upload_file(ws, "sub/big.bin", source, base_sha256=None, create_parents=True)
        else:
            with open(source, "rb") as f:
                f.read(5)  # the helper sends from offset 0 whatever the position
                plan = c.upload_file(ws, "sub/big.bin", f, base_sha256=None, create_parents=True)
    assert plan["applied"] and plan["new_sha256"] == hashlib.sha256(data).hexdigest()
    assert (root / "sub" / "big.bin").read_bytes() == data
    # Chunks small enough for the client's own 256 KiB limit, however big the daemon's.
    chunks = c.methods.count("fs.upload.chunk")
    assert chunks == -(-len(data) // chunk_bytes(limit))
    assert c.methods == ["fs.upload.begin", *["fs.upload.chunk"] * chunks, "fs.upload.commit"]
    assert [e["data"]["size"] for e in daemon.journal({"fs.upload"})] == [len(data)]
    assert os.listdir(daemon.state_dir / "uploads") == []


def test_upload_file_refused_or_dry_run_aborts_its_upload(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = daemon.adopt(root)
    source = tmp_path / "source.bin"
    source.write_bytes(b"new\n")
    with Client(daemon.agent_path, timeout=60) as c:
        dry = c.upload_file(
            ws, "a.txt", source, base_sha256=hashlib.sha256(b"a\n").hexdigest(), dry_run=True
        )
        assert not dry["applied"] and "+new" in dry["diff"]
        (root / "a.txt").write_text("edited\n")
        with pytest.raises(RpcError) as info:
            # The dry run's digest is of the plan against "a\n": this one's differs.
            c.upload_file(
                ws,
                "a.txt",
                source,
                base_sha256=hashlib.sha256(b"edited\n").hexdigest(),
                plan_digest=dry["plan_digest"],
            )
        assert info.value.refusal == "plan_mismatch"
    assert (root / "a.txt").read_text() == "edited\n"
    assert os.listdir(daemon.state_dir / "uploads") == []


async def test_async_upload_file(daemon: DaemonProcess) -> None:
    root = daemon.make_workspace("demo", {"a.txt": "a\n"})
    ws = await trio.to_thread.run_sync(daemon.adopt, root)
    data = os.urandom(2 * MiB)
    async with open_client(daemon.agent_path) as c:
        plan = await c.upload_file(ws, "big.bin", io.BytesIO(data), base_sha256=None)
    assert plan["applied"]
    assert (root / "big.bin").read_bytes() == data


def test_connection_refusal_answers_the_waiting_call(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(allowed_uids=[4242])
    with Client(d.agent_path, timeout=30) as c, pytest.raises(RpcError) as info:
        c.call("daemon.status")
    assert info.value.refusal == "unauthorized"


# --- notifications ---------------------------------------------------------------------------


def output(offset: int, data: str = "x", proc: str = "p1", stream: str = "stdout") -> bytes:
    params = {"proc": proc, "stream": stream, "offset": offset, "data": data}
    return msgspec.json.encode({"jsonrpc": "2.0", "method": "proc.output", "params": params})


def exit_notice(proc: str = "p1") -> bytes:
    params = {"proc": proc, "exit_code": 0}
    return msgspec.json.encode({"jsonrpc": "2.0", "method": "proc.exit", "params": params})


@contextlib.asynccontextmanager
async def fed_client(buffer: int) -> AsyncIterator[tuple[AsyncClient, trio.SocketStream]]:
    """An AsyncClient with a small queue, and the server end of its socket."""
    ours, theirs = trio.socket.socketpair()
    server = trio.SocketStream(theirs)
    async with trio.open_nursery() as nursery:
        client = AsyncClient(trio.SocketStream(ours), nursery, notification_buffer=buffer)
        yield client, server
        await client.aclose()
        await server.aclose()
        nursery.cancel_scope.cancel()


async def send_lines(server: trio.SocketStream, *lines: bytes) -> None:
    await server.send_all(b"".join(line + b"\n" for line in lines))
    await trio.testing.wait_all_tasks_blocked()  # the client's reader has taken them all


async def take(client: AsyncClient, n: int) -> list[dict[str, Any]]:
    with trio.fail_after(5):
        return [(await client.notifications.receive())["params"] for _ in range(n)]


async def test_full_queue_drops_output_never_the_exit() -> None:
    async with fed_client(buffer=4) as (client, server):
        await send_lines(server, *[output(i) for i in range(10)], exit_notice())
        got = await take(client, 6)
    assert [p.get("offset") for p in got[:4]] == [0, 1, 2, 3]
    assert all("skipped_from" not in p for p in got[:4])
    # The hole is reported before the exit, as the daemon reports its own skips.
    assert got[4] == {"proc": "p1", "stream": "stdout", "offset": 10, "data": "", "skipped_from": 4}
    assert got[5] == {"proc": "p1", "exit_code": 0}
    assert client.dropped_output == 6


async def test_next_delivered_piece_carries_skipped_from() -> None:
    async with fed_client(buffer=2) as (client, server):
        await send_lines(server, output(0, "ab"), output(2, "cd"), output(4, "é"), output(6, "gh"))
        first = await take(client, 2)
        await send_lines(server, output(8, "ij"), output(0, "z", stream="stderr"), exit_notice())
        rest = await take(client, 2)
        # The exit waited for room (it is never dropped): it comes once the queue drains.
        last = await take(client, 1)
    assert [p["offset"] for p in first] == [0, 2]
    assert rest[0] == {
        "proc": "p1",
        "stream": "stdout",
        "offset": 8,
        "data": "ij",
        "skipped_from": 4,
    }
    assert rest[1]["stream"] == "stderr"
    assert last == [{"proc": "p1", "exit_code": 0}]
    assert client.dropped_output == 2


async def test_exit_after_held_notifications_keeps_order() -> None:
    async with fed_client(buffer=1) as (client, server):
        await send_lines(
            server,
            output(0, proc="a"),
            exit_notice("a"),
            output(0, proc="b"),
            exit_notice("b"),
        )
        got = await take(client, 4)
    assert got[0] == {"proc": "a", "stream": "stdout", "offset": 0, "data": "x"}
    assert got[1] == {"proc": "a", "exit_code": 0}
    # b's output came while a's exit was still held: dropped, and reported before b's exit.
    assert got[2] == {"proc": "b", "stream": "stdout", "offset": 1, "data": "", "skipped_from": 0}
    assert got[3] == {"proc": "b", "exit_code": 0}
