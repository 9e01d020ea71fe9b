"""The daemon's side of one stream supervisor: a gVisor sandbox's commands over one
engine exec's attach stream (docs/fast-exec.md "Under gVisor").

A `StreamLink` holds the started exec's stream socket (`stream_agent` on the other end).
One reader task per link (`run_reader`) demultiplexes the engine's framing
(`process`-free: the same 8-byte header as `substrate.process.stream.Demuxer`, parsed
here), decodes the supervisor's frames (`stream_agent.Decoder`) and hands each to its
command (`StreamCommand`, by id). Output goes straight into the command's sinks, in
order: the reader waits until the command's run attached them (`attach`), and writes on
the event loop while a command's output is small, in a worker thread beyond
(`LOOP_BYTES`); meanwhile it reads nothing more, so a command that writes 200 MiB is
held back by the sink's disk writes, never by the daemon's memory (the socket, the
engine and the supervisor's pipes fill, and the command blocks in `write`).

Every frame is tagged with a key of the start's secret, both ways (`stream_agent.keys`):
a frame the supervisor did not send — a process of its uid can write to its stdout
under runsc — breaks the link (`protocol`) instead of being read as a command's result.
Requests go out under one lock (`send`); a command's stdin is sent a piece at a time
(at most `stream_agent.MAX_STDIN` bytes), the next only once the supervisor said
`drained`. The link breaks (EOF, an engine error, a garbled frame): every command on it
ends without an exit code (`exited` set, `code` None), and `broken` names why.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

from substrate.sandbox.supervisor import stream_agent

log = logging.getLogger("substrate.sandbox.supervisor")

#: Bytes read from the stream at a time.
RECV_BYTES = 1 << 18
#: A command's output is written to its sinks on the event loop up to this many bytes,
#: then in a worker thread (one chunk at a time: the reader waits for it).
LOOP_BYTES = 1 << 20
#: The engine's multiplexed frame header: stream, 3 zero bytes, payload length.
MUX = struct.Struct(">BxxxI")


class Sink(Protocol):
    """Where a command's stream goes (`substrate.artifacts.sink.OutputSink`)."""

    def write(self, data: bytes) -> None: ...


class LinkBroken(Exception):
    """The stream is gone: nothing more can be sent on it."""


class StreamCommand:
    """One command on a link, from its `run` to its `exited` (or the link's end)."""

    def __init__(self, link: StreamLink, ident: str) -> None:
        self.link = link
        self.id = ident
        self.started = trio.Event()  # `started` or `exited` came (or the link broke)
        self.exited = trio.Event()
        self.code: int | None = None
        self.errno: int | None = None
        self.ran = False  # `started` came: the program runs (or ran)
        self.drained = trio.Event()
        self._attached = trio.Event()
        self._sinks: Mapping[int, Sink] | None = None
        self._limiter: trio.CapacityLimiter | None = None
        self._moved = 0

    def attach(self, sinks: Mapping[int, Sink], limiter: trio.CapacityLimiter) -> None:
        """Output from now on goes into `sinks` (what came before waited for this)."""
        self._sinks, self._limiter = sinks, limiter
        self._attached.set()

    def detach(self) -> None:
        """The run gave up on the output: the rest is read and dropped."""
        self._sinks = None
        self._attached.set()

    @property
    def forgotten(self) -> bool:
        """Detached: nothing more of it is wanted."""
        return self._sinks is None and self._attached.is_set()

    async def deliver(self, stream: int, data: bytes) -> None:
        await self._attached.wait()
        sink = self._sinks.get(stream) if self._sinks is not None else None
        if sink is None:
            return
        self._moved += len(data)
        try:
            if self._moved <= LOOP_BYTES:
                sink.write(data)  # a spool append: microseconds at this size
            else:
                await trio.to_thread.run_sync(sink.write, data, limiter=self._limiter)
        except Exception:  # the run closed its sinks meanwhile (it gave up on them)
            self.detach()  # its output is dropped; the stream and its other commands go on

    def end(self, code: int | None, err: int | None) -> None:
        self.code, self.errno = code, err
        self.started.set()
        self.exited.set()
        self.drained.set()


class StreamLink:
    """One running stream supervisor (see the module doc)."""

    def __init__(
        self,
        container: str,
        generation: int,
        exec_id: str,
        sock: trio.socket.SocketType,
        initial: bytes,
        secret: bytes,
    ) -> None:
        self.container = container
        self.generation = generation
        self.exec_id = exec_id
        self._sock = sock
        self._initial = initial
        self._send_lock = trio.Lock()
        down, self._up = stream_agent.keys(secret)
        self._encoder = stream_agent.Encoder(down)
        self._commands: dict[str, StreamCommand] = {}
        self.ready = trio.Event()
        self.pid: int | None = None  # the supervisor's pid in the sandbox (its `ready`)
        self.broken: str | None = None
        self.gone = trio.Event()
        self.on_broken: Callable[[StreamLink], None] | None = None

    @property
    def commands(self) -> int:
        return len(self._commands)

    async def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        """One request. Raises LinkBroken."""
        if self.broken is not None:
            raise LinkBroken(self.broken)
        async with self._send_lock:  # frames are tagged in the order they are sent
            frame = self._encoder.encode(message, payload)
            try:
                view = memoryview(frame)
                while view:
                    view = view[await self._sock.send(view) :]
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                self.close("closed")
                raise LinkBroken("closed") from None

    async def run(
        self,
        ident: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        stdin: bool,
    ) -> StreamCommand:
        """Ask for `argv` to run as command `ident`; its state. Raises LinkBroken."""
        command = StreamCommand(self, ident)
        self._commands[ident] = command
        try:
            await self.send(
                {"op": "run", "id": ident, "argv": argv, "env": env, "cwd": cwd, "stdin": stdin}
            )
        except LinkBroken:
            self._commands.pop(ident, None)
            raise
        return command

    async def send_stdin(self, command: StreamCommand, data: bytes) -> bool:
        """Write `data` to the command's stdin, a piece at a time (each `drained` before
        the next); False once the command or the link ended."""
        view = memoryview(data)
        while view:
            if command.exited.is_set():
                return False
            command.drained = trio.Event()
            try:
                await self.send(
                    {"op": "in", "id": command.id}, bytes(view[: stream_agent.MAX_STDIN])
                )
            except LinkBroken:
                return False
            view = view[stream_agent.MAX_STDIN :]
            await command.drained.wait()
        return not command.exited.is_set()

    async def close_stdin(self, command: StreamCommand) -> None:
        if not command.exited.is_set():
            with contextlib.suppress(LinkBroken):
                await self.send({"op": "close", "id": command.id})

    async def signal(self, command: StreamCommand, signum: int) -> bool:
        """`signum` to the command's process group (the supervisor's `killpg`); False
        once the command or the link ended. A command that ends meanwhile is not
        signalled: the supervisor forgets it as it reports its exit."""
        if command.exited.is_set():
            return False
        try:
            await self.send({"op": "signal", "id": command.id, "sig": signum})
        except LinkBroken:
            return False
        return True

    def forget(self, command: StreamCommand) -> None:
        """The run is over: later frames for it are dropped."""
        command.detach()
        if self._commands.get(command.id) is command and command.exited.is_set():
            del self._commands[command.id]

    # -- the reader ------------------------------------------------------------------------

    async def run_reader(self) -> None:
        """Read the stream until it ends; then every command on it ends (code None)."""
        reason = "closed"
        try:
            await self._read()
        except stream_agent.ProtocolError:
            reason = "protocol"
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            reason = "closed"
        finally:
            self.close(self.broken or reason)

    async def _read(self) -> None:
        decoder = stream_agent.Decoder(stream_agent.MAX_REPORT, stream_agent.CHUNK)
        decoder.key = self._up  # every frame the supervisor sends is tagged, `ready` first
        header = bytearray()
        kind, left = 0, 0
        data = self._initial
        self._initial = b""
        while True:
            if not data:
                data = await self._sock.recv(RECV_BYTES)
                if not data:
                    return
            pos, end = 0, len(data)
            while pos < end:
                if left == 0:
                    take = min(MUX.size - len(header), end - pos)
                    header += data[pos : pos + take]
                    pos += take
                    if len(header) == MUX.size:
                        kind, left = MUX.unpack(header)
                        header.clear()
                    continue
                take = min(left, end - pos)
                piece = data[pos : pos + take]
                pos += take
                left -= take
                if kind != 1:
                    continue  # the supervisor's stderr is /dev/null: nothing is expected
                for message, payload in decoder.feed(piece):
                    await self._dispatch(message, payload)
            data = b""

    async def _dispatch(self, message: dict[str, Any], payload: bytes) -> None:
        op, ident = message.get("op"), message.get("id")
        if op == "ready":
            if message.get("v") != stream_agent.VERSION or self.ready.is_set():
                raise stream_agent.ProtocolError("ready")
            pid = message.get("pid")
            self.pid = pid if isinstance(pid, int) else None
            self.ready.set()
            return
        command = self._commands.get(ident) if isinstance(ident, str) else None
        if command is None:
            return  # a command the daemon forgot (its run ended): dropped
        if op == "out":
            fd = message.get("fd")
            if fd in (1, 2):
                assert isinstance(fd, int)
                await command.deliver(fd, payload)
        elif op == "started":
            command.ran = True
            command.started.set()
        elif op == "drained":
            command.drained.set()
        elif op == "exited":
            code, err = message.get("code"), message.get("errno")
            command.end(
                code if isinstance(code, int) else None, err if isinstance(err, int) else None
            )
            if command.forgotten:
                del self._commands[command.id]
        else:
            raise stream_agent.ProtocolError("op")

    # -- the end ---------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Stop using the stream: its socket closes (the supervisor reads EOF: it kills its
        commands' process groups and exits), every command on it ends without a code."""
        if self.broken is None:
            self.broken = reason
        self._sock.close()
        commands, self._commands = self._commands, {}
        for command in commands.values():
            if not command.exited.is_set():
                command.end(None, None)
            command.detach()
        self.ready.set()
        if not self.gone.is_set():
            self.gone.set()
            if self.on_broken is not None:
                self.on_broken(self)
