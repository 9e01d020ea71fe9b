"""The stream supervisor's wire and program without Docker (docs/fast-exec.md "Under gVisor").

The tagged frames (`stream_agent.Encoder`/`Decoder`: sans-IO), the program run on the
host as a subprocess over pipes, and the daemon's `StreamLink` reading a stream in the
engine's multiplexed framing from a socket pair.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from substrate.sandbox.supervisor import stream_agent as A
from substrate.sandbox.supervisor.stream_link import StreamLink

SECRET = bytes(range(32))


def pair() -> tuple[A.Encoder, A.Decoder]:
    down, _ = A.keys(SECRET)
    decoder = A.Decoder(A.MAX_REQUEST)
    decoder.key = down
    return A.Encoder(down), decoder


def test_tagged_frames_round_trip_in_any_pieces() -> None:
    enc, dec = pair()
    frames = [
        ({"op": "run", "id": "a", "argv": ["true"]}, b""),
        ({"op": "in", "id": "a"}, b"x" * 999),
    ]
    data = b"".join(enc.encode(m, p) for m, p in frames)
    got: list[tuple[dict[str, Any], bytes]] = []
    for i in range(len(data)):
        got += dec.feed(data[i : i + 1])
    assert got == frames
    assert dec.buffered == 0


def test_a_frame_not_tagged_with_the_key_breaks_the_wire() -> None:
    _, dec = pair()
    with pytest.raises(A.ProtocolError, match="tag"):
        dec.feed(A.encode({"op": "exited", "id": "x", "code": 0}))
    other = A.Encoder(A.keys(secrets.token_bytes(32))[0])
    _, dec = pair()
    with pytest.raises(A.ProtocolError, match="tag"):
        dec.feed(other.encode({"op": "exited", "id": "x", "code": 0}))


def test_a_replayed_or_reordered_frame_breaks_the_wire() -> None:
    enc, dec = pair()
    first = enc.encode({"op": "started", "id": "a"})
    second = enc.encode({"op": "exited", "id": "a", "code": 0})
    assert dec.feed(first)
    with pytest.raises(A.ProtocolError):
        dec.feed(first)
    _, dec = pair()
    with pytest.raises(A.ProtocolError):
        dec.feed(second)


def test_the_directions_have_their_own_keys() -> None:
    down, up = A.keys(SECRET)
    assert down != up
    dec = A.Decoder(A.MAX_REPORT)
    dec.key = up
    with pytest.raises(A.ProtocolError):  # a request reflected back as a report
        dec.feed(A.Encoder(down).encode({"op": "ready", "v": A.VERSION, "pid": 1}))


def test_before_the_key_one_frame_is_read() -> None:
    dec = A.Decoder(A.MAX_REQUEST)
    down, _ = A.keys(SECRET)
    data = A.encode({"op": "key", "key": SECRET.hex()}) + A.Encoder(down).encode({"op": "x"})
    assert dec.feed(data) == [({"op": "key", "key": SECRET.hex()}, b"")]
    dec.key = down
    assert dec.feed(b"") == [({"op": "x"}, b"")]


@pytest.mark.parametrize(
    "frame",
    [
        A.HEADER.pack(A.MAX_REPORT + 1, 0) + bytes(A.TAG_BYTES),
        A.HEADER.pack(2, A.CHUNK + 1) + bytes(A.TAG_BYTES),
        A.HEADER.pack(2, 0) + bytes(A.TAG_BYTES) + b"[]",
        A.HEADER.pack(2, 0) + bytes(A.TAG_BYTES) + b"{x",
    ],
)
def test_oversized_or_garbled_frames_are_refused(frame: bytes) -> None:
    with pytest.raises(A.ProtocolError):
        A.Decoder(A.MAX_REPORT, A.CHUNK).feed(frame)


def test_exit_codes_read_as_the_engine_reports_them() -> None:
    assert [A.exit_code_of(c) for c in (0, 3, -9, -15)] == [0, 3, 137, 143]


# -- the program, on the host ------------------------------------------------------------


class Program:
    """The program as a subprocess over pipes, keyed like the daemon keys it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", A.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        down, up = A.keys(SECRET)
        self.enc = A.Encoder(down)
        self.dec = A.Decoder(A.MAX_REPORT, A.CHUNK)
        self.dec.key = up
        self.frames: list[tuple[dict[str, Any], bytes]] = []
        self.write(A.encode({"op": "key", "key": SECRET.hex()}))

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        self.write(self.enc.encode(message, payload))

    def next(self) -> tuple[dict[str, Any], bytes]:
        assert self.proc.stdout is not None
        while not self.frames:
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            assert data, "the program ended"
            self.frames += self.dec.feed(data)
        return self.frames.pop(0)

    def run(
        self, ident: str, argv: list[str], stdin: bytes | None = None
    ) -> tuple[dict[str, Any], dict[int, bytes]]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        request = {"op": "run", "id": ident, "argv": argv, "env": env, "cwd": "/"}
        self.send({**request, "stdin": stdin is not None})
        if stdin is not None:
            self.send({"op": "in", "id": ident}, stdin)
            self.send({"op": "close", "id": ident})
        out: dict[int, bytes] = {1: b"", 2: b""}
        while True:
            message, payload = self.next()
            assert message["id"] == ident
            if message["op"] == "out":
                out[message["fd"]] += payload
            elif message["op"] == "exited":
                return message, out


@pytest.fixture
def program() -> Iterator[Program]:
    p = Program()
    ready, _ = p.next()
    assert (ready["op"], ready["v"]) == ("ready", A.VERSION)
    yield p
    if p.proc.poll() is None:
        p.proc.kill()
    p.proc.wait()
    for f in (p.proc.stdin, p.proc.stdout):
        if f is not None and not f.closed:
            f.close()


def test_the_program_runs_commands(program: Program) -> None:
    done, out = program.run("a", ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (done["code"], out) == (3, {1: b"out\n", 2: b"err\n"})
    done, out = program.run("b", ["no-such-program-here"])
    assert (done["code"], done["errno"]) == (A.EXEC_FAILED, errno.ENOENT)
    done, _ = program.run("c", ["sh", "-c", "kill -9 $$"])
    assert done["code"] == 128 + signal.SIGKILL
    data = os.urandom(600_000)  # more than one stdin piece
    program.send({"op": "run", "id": "d", "argv": ["cat"], "env": {}, "cwd": "/", "stdin": True})
    assert program.next()[0] == {"op": "started", "id": "d"}
    got = b""
    for start in range(0, len(data), A.MAX_STDIN):
        # Written from a thread: the program's echoed output must be read meanwhile.
        frame = program.enc.encode({"op": "in", "id": "d"}, data[start : start + A.MAX_STDIN])
        writer = threading.Thread(target=program.write, args=(frame,))
        writer.start()
        while True:
            message, payload = program.next()
            if message["op"] == "drained":
                break
            got += payload
        writer.join()
    program.send({"op": "close", "id": "d"})
    while True:
        message, payload = program.next()
        if message["op"] == "exited":
            break
        got += payload
    assert (message["code"], got) == (0, data)


def test_commands_get_default_signals_and_their_own_group(program: Program) -> None:
    # The supervisor catches TERM; its command must not inherit that.
    done, out = program.run("a", ["sh", "-c", "ps -o pgid= -p $$; ps -o sid= -p $$; kill -TERM $$"])
    assert done["code"] == 128 + signal.SIGTERM
    pgid, sid = out[1].split()
    assert pgid == sid and int(pgid) != os.getpgid(program.proc.pid)


def test_commands_inherit_no_descriptor_of_the_supervisor(program: Program) -> None:
    done, out = program.run("a", ["ls", "/proc/self/fd"])
    assert (done["code"], out[1].split()) == (0, [b"0", b"1", b"2", b"3"])  # 3: ls's own


def test_a_frame_without_the_tag_ends_the_program(program: Program) -> None:
    program.send({"op": "run", "id": "a", "argv": ["sleep", "100"], "env": {}, "cwd": "/"})
    assert program.next()[0]["op"] == "started"
    program.write(A.encode({"op": "signal", "id": "a", "sig": 9}))  # untagged
    assert program.proc.wait(timeout=10) == 0  # and its command was killed with it
    assert program.proc.stdout is not None
    assert program.proc.stdout.read() == b""


def test_stdin_closed_ends_the_program_and_its_commands(program: Program) -> None:
    program.send({"op": "run", "id": "a", "argv": ["sleep", "100"], "env": {}, "cwd": "/"})
    assert program.next()[0]["op"] == "started"
    assert program.proc.stdin is not None
    program.proc.stdin.close()
    assert program.proc.wait(timeout=10) == 0


# -- the daemon's link, over a socket pair -------------------------------------------------


def mux(data: bytes, stream: int = 1) -> bytes:
    return struct.pack(">BxxxI", stream, len(data)) + data


class Sink:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


async def test_the_link_demultiplexes_output_into_sinks() -> None:
    ours, theirs = socket.socketpair()
    link = StreamLink("c" * 64, 1, "exec", trio.socket.from_stdlib_socket(ours), b"", SECRET)
    _, up = A.keys(SECRET)
    enc = A.Encoder(up)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run_reader)
        theirs.sendall(mux(enc.encode({"op": "ready", "v": A.VERSION, "pid": 7})))
        await link.ready.wait()
        assert link.pid == 7
        command = await link.run("a", ["x"], {}, "/", False)
        sinks = {1: Sink(), 2: Sink()}
        command.attach(sinks, trio.CapacityLimiter(1))
        reply = enc.encode({"op": "out", "id": "a", "fd": 1}, b"hello")
        reply += enc.encode({"op": "out", "id": "a", "fd": 2}, b"oops")
        reply += enc.encode({"op": "exited", "id": "a", "code": 3})
        wire = mux(reply)
        for i in range(0, len(wire), 5):  # engine frames and ours cut anywhere
            theirs.sendall(wire[i : i + 5])
            await trio.lowlevel.checkpoint()
        await command.exited.wait()
        assert (command.code, sinks[1].data, sinks[2].data) == (3, b"hello", b"oops")
        # A frame another process wrote into the stream: the link breaks, its commands end.
        second = await link.run("b", ["y"], {}, "/", False)
        theirs.sendall(mux(A.encode({"op": "exited", "id": "b", "code": 0})))
        await link.gone.wait()
        assert (link.broken, second.code, second.exited.is_set()) == ("protocol", None, True)
    theirs.close()
