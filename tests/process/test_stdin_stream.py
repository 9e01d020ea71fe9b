"""Streamed stdin without Docker (docs/protocol.md §14 `proc.write`): `StdinStream` over a
socket pair (order, back-pressure, EOF, a stdin the command closed, the run's end,
ownership), the runner and driver over the fake engine, and the `proc.write` handler's
refusals."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from fake_execution import Layer, fake_layer

from substrate.api import proc as proc_api
from substrate.errors import (
    InvalidParams,
    LimitExceeded,
    ProcessUnknown,
    StdinClosed,
    TooLarge,
    Unauthorized,
)
from substrate.process.stdin_stream import PipeStdin, SocketStdin, StdinStream
from substrate.protocol.caller import Caller
from substrate.schema.proc import MAX_WRITE_BYTES, ProcResult, RunParams, StartParams, WriteParams


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    theirs.settimeout(10)  # a broken drain fails the test instead of hanging it
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "EOF before the bytes"
        out += chunk
    return out


async def test_bytes_reach_the_command_in_order_then_eof(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    stream = StdinStream("agent:1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.drain, SocketStdin(ours))
        first = await stream.write(b"one\n")
        assert (first.accepted, first.eof) == (4, False)
        await stream.write(b"two\n")
        last = await stream.write(b"", eof=True)
        assert last.eof and last.accepted == 0
        got = await trio.to_thread.run_sync(recv_exactly, theirs, 8)
        assert got == b"one\ntwo\n"
        assert await trio.to_thread.run_sync(theirs.recv, 1) == b""  # EOF
    assert (stream.written, stream.buffered, stream.closed) == (8, 0, "eof")
    with pytest.raises(StdinClosed) as caught:
        await stream.write(b"more")
    assert caught.value.data == {"reason": "eof"}


async def test_a_full_buffer_makes_a_write_wait_then_refuses_taking_nothing() -> None:
    stream = StdinStream("agent:1", cap=8, wait_s=0.05)
    await stream.write(b"12345678")  # the cap, nobody drains
    with pytest.raises(LimitExceeded) as caught:
        await stream.write(b"9")
    assert caught.value.data == {"scope": "stdin_buffer", "limit": 8, "buffered": 8}
    assert stream.buffered == 8  # the refused byte was not taken


async def test_a_waiting_write_goes_in_once_the_command_reads(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    stream = StdinStream("agent:1", cap=8, wait_s=60)
    await stream.write(b"abcdefgh")
    results: list[int] = []
    async with trio.open_nursery() as nursery:

        async def writer(data: bytes) -> None:
            results.append((await stream.write(data)).accepted)

        nursery.start_soon(writer, b"ijkl")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(writer, b"mn")  # behind the first: order is kept
        await trio.testing.wait_all_tasks_blocked()
        assert results == []  # both wait for room
        nursery.start_soon(stream.drain, SocketStdin(ours))
        got = await trio.to_thread.run_sync(recv_exactly, theirs, 14)
        assert got == b"abcdefghijklmn"
        assert results == [4, 2]
        nursery.cancel_scope.cancel()
    assert stream.closed == "ended"


async def test_a_stdin_the_command_closed_refuses_later_writes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    theirs.close()
    stream = StdinStream("agent:1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.drain, SocketStdin(ours))
        await stream.write(b"lost")  # taken; the pipe breaks when it is handed over
        with trio.fail_after(10):
            while stream.closed is None:
                await trio.testing.wait_all_tasks_blocked()
    assert (stream.closed, stream.buffered, stream.written) == ("closed", 0, 0)
    with pytest.raises(StdinClosed) as caught:
        await stream.write(b"x")
    assert caught.value.data == {"reason": "closed"}


async def test_the_run_ending_wakes_and_refuses_a_waiting_writer() -> None:
    stream = StdinStream("agent:1", cap=4, wait_s=60)
    await stream.write(b"full")
    refused: list[BaseException] = []
    async with trio.open_nursery() as nursery:

        async def writer() -> None:
            try:
                await stream.write(b"more")
            except StdinClosed as exc:
                refused.append(exc)

        nursery.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()
        stream.end("ended")  # what the drain does as its run ends
    assert [e.data for e in refused] == [{"reason": "ended"}]  # type: ignore[attr-defined]


async def test_a_pipe_stdin_takes_the_bytes_then_eof_and_reports_a_broken_one() -> None:
    """The stdin of a command the sandbox's supervisor started is a pipe (fast exec)."""
    r, w = os.pipe()
    closed: list[int] = []

    def close() -> None:
        closed.append(w)
        os.close(w)

    stream = StdinStream("agent:1")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.drain, PipeStdin(w, close))
            await stream.write(b"x" * 200_000, eof=True)  # more than a pipe holds
            got = b""
            while chunk := await trio.to_thread.run_sync(os.read, r, 1 << 16):
                got += chunk
        assert (got, closed, stream.closed) == (b"x" * 200_000, [w], "eof")
    finally:
        os.close(r)
    r, w = os.pipe()
    os.close(r)  # the command closed its stdin
    broken = StdinStream("agent:1")
    try:
        with trio.fail_after(10):  # a drain that missed the broken pipe would park forever
            async with trio.open_nursery() as nursery:
                nursery.start_soon(broken.drain, PipeStdin(w, lambda: None))
                await broken.write(b"lost")
    finally:
        os.close(w)
    assert broken.closed == "closed"


def test_only_the_starter_or_the_operator_may_write() -> None:
    stream = StdinStream("agent:1000")
    stream.check_writer("agent:1000", operator=False)
    stream.check_writer("operator:0", operator=True)
    with pytest.raises(Unauthorized):
        stream.check_writer("agent:1001", operator=False)


# --- through the runner and the driver (fake engine) ----------------------------------------


@pytest.fixture
async def layer(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> AsyncIterator[Layer]:
    root = make_workspace("stdin", {"a.txt": "a\n"})
    with fake_layer(root, tmp_path / "state", adopt_root) as made:
        async with trio.open_nursery() as nursery:
            await nursery.start(made.processes.serve)
            yield made
            for ex in made.engine.running_execs():
                ex.exit(0)
            nursery.cancel_scope.cancel()


async def test_a_streamed_stdin_reaches_the_exec_and_ends_with_the_run(layer: Layer) -> None:
    stream = StdinStream("agent:1")
    proc = await layer.processes.start(layer.request(["sleep", "1"], stdin=stream))
    entry = layer.processes.live(proc)
    assert entry is not None and entry.stdin is stream
    ex = layer.exec_of(proc)
    assert ex.stdin  # the exec was created with stdin attached
    assert ex.peer is not None
    await stream.write(b"hello\n")
    peer = ex.peer
    peer.settimeout(10)
    assert await trio.to_thread.run_sync(recv_exactly, peer, 6) == b"hello\n"
    ex.exit(0)
    await entry.done.wait()
    assert stream.closed == "ended"
    with pytest.raises(StdinClosed):
        await stream.write(b"late")


# --- the proc.write handler ------------------------------------------------------------------


def caller(actor: str = "agent", uid: int = 1000) -> Caller:
    async def notify(method: str, params: Any) -> None:
        pass

    return Caller(actor=actor, uid=uid, connection=1, notify=notify)  # type: ignore[arg-type]


def daemon_of(layer: Layer) -> Any:
    return SimpleNamespace(processes=layer.processes)


async def test_proc_write_refusals(layer: Layer) -> None:
    d = daemon_of(layer)
    with pytest.raises(ProcessUnknown):
        await proc_api.write(d, caller(), WriteParams(proc="p_0000000000000000", data="x"))
    plain = await layer.processes.start(layer.request(["sleep", "1"]))
    with pytest.raises(StdinClosed) as caught:
        await proc_api.write(d, caller(), WriteParams(proc=plain, data="x"))
    assert caught.value.data == {"reason": "not_streamed"}
    streamed = await layer.processes.start(
        layer.request(["sleep", "1"], stdin=StdinStream("agent:1000"))
    )
    with pytest.raises(InvalidParams):
        await proc_api.write(d, caller(), WriteParams(proc=streamed, data="x", data_b64="eA=="))
    with pytest.raises(TooLarge):
        # Within the schema's character bound, over the byte bound once encoded.
        big = WriteParams(proc=streamed, data="é" * (MAX_WRITE_BYTES // 2 + 1))
        await proc_api.write(d, caller(), big)
    with pytest.raises(Unauthorized):
        await proc_api.write(d, caller(uid=1001), WriteParams(proc=streamed, data="x"))
    done = await proc_api.write(d, caller(actor="operator", uid=0), WriteParams(proc=streamed))
    assert (done.accepted, done.eof) == (0, False)
    sent = await proc_api.write(d, caller(), WriteParams(proc=streamed, data_b64="AAE=", eof=True))
    assert (sent.accepted, sent.eof) == (2, True)
    layer.exec_of(streamed).exit(0)
    layer.exec_of(plain).exit(0)
    for proc in (streamed, plain):
        result = await proc_api.wait(d, caller(), proc_api.WaitParams(proc=proc))
        assert isinstance(result, ProcResult)
    with pytest.raises(StdinClosed) as caught:
        await proc_api.write(d, caller(), WriteParams(proc=streamed, data="x"))
    assert caught.value.data == {"reason": "ended"}


def test_stdin_stream_is_for_proc_start_only() -> None:
    start = StartParams(workspace="w", profile="p", argv=["cat"], stdin="stream")
    made = proc_api.stdin_of(caller(), start)
    assert isinstance(made, StdinStream) and made.owner == "agent:1000"
    with pytest.raises(InvalidParams):
        proc_api.stdin_of(
            caller(), RunParams(workspace="w", profile="p", argv=["cat"], stdin="stream")
        )
    text = StartParams(workspace="w", profile="p", argv=["cat"], stdin="streams")
    assert proc_api.stdin_of(caller(), text) == b"streams"
