"""What a terminal session runs: the `PtyProcess` interface and an in-memory fake.

The daemon's real backend is `substrate.pty.docker.DockerPtys` (a TTY exec in the
workspace's confined container). `FakePtys` ships inside the library, as httpcore ships
its mock streams, so the protocol, server and client are tested without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from substrate.errors import GrantInvalid


class PtyProcess(Protocol):
    """A running process on a pseudo-terminal."""

    #: What the journal records about how it was started (facts, container), no bytes.
    info: dict[str, Any]
    #: What the journal records about how it ended, filled by `terminate`: on a layer
    #: sandbox, `changes` (the generation's change summary, counts only). No bytes.
    ended: dict[str, Any]

    async def read(self, max_bytes: int) -> bytes:
        """The next output bytes; b"" once the process closed its terminal."""
        ...

    async def write(self, data: bytes) -> None:
        """Send keystrokes."""
        ...

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal size (the process gets SIGWINCH)."""
        ...

    async def wait(self) -> int:
        """After `read` returned b"": the exit code (128+N for signal N)."""
        ...

    async def terminate(self) -> None:
        """End the process and release its terminal (on a layer sandbox, conclude its
        generation if it was the last user: docs/terminals.md). Idempotent."""
        ...


class PtySpawner(Protocol):
    """Starts the process of a new session (`session` its id, `actor` who opened it, for
    the journal). Refuses like any command would."""

    async def __call__(
        self, *, workspace: str, profile: str, cols: int, rows: int, session: str, actor: str
    ) -> PtyProcess: ...


@dataclass
class FakePty:
    """A tiny line-oriented shell on an in-memory terminal.

    It echoes input (CR becomes CRLF) and runs one command per line: `echo WORDS`,
    `size` (prints "ROWS COLS"), `flood N` (prints N bytes), `bytes HEX` (prints raw
    bytes), `exit [N]`. The prompt is "$ ".
    """

    cols: int
    rows: int
    info: dict[str, Any] = field(default_factory=lambda: {"backend": "fake"})
    ended: dict[str, Any] = field(default_factory=dict)
    _out: bytearray = field(default_factory=bytearray)
    _line: bytearray = field(default_factory=bytearray)
    _ready: trio.Event = field(default_factory=trio.Event)
    _code: int | None = None
    _closed: bool = False

    def __post_init__(self) -> None:
        self._emit(b"$ ")

    def _emit(self, data: bytes) -> None:
        self._out += data
        self._ready.set()

    async def read(self, max_bytes: int) -> bytes:
        while not self._out and not self._closed:
            self._ready = trio.Event()
            await self._ready.wait()
        await trio.lowlevel.checkpoint()
        data = bytes(self._out[:max_bytes])
        del self._out[:max_bytes]
        return data

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            return
        for b in data:
            if b in (0x0D, 0x0A):
                self._emit(b"\r\n")
                self._run(self._line.decode("utf-8", errors="replace"))
                self._line.clear()
                if self._closed:
                    return
                self._emit(b"$ ")
            else:
                self._line.append(b)
                self._emit(bytes([b]))

    def _run(self, line: str) -> None:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "echo":
            self._emit(arg.encode() + b"\r\n")
        elif cmd == "size":
            self._emit(f"{self.rows} {self.cols}\r\n".encode())
        elif cmd == "flood":
            n = int(arg)
            self._emit((b"0123456789abcdef" * (n // 16 + 1))[:n])
        elif cmd == "bytes":
            self._emit(bytes.fromhex(arg))
        elif cmd == "exit":
            self._code = int(arg or "0")
            self._closed = True
            self._ready.set()
        elif cmd:
            self._emit(f"{cmd}: not found\r\n".encode())

    async def resize(self, cols: int, rows: int) -> None:
        await trio.lowlevel.checkpoint()
        self.cols, self.rows = cols, rows

    async def wait(self) -> int:
        await trio.lowlevel.checkpoint()
        return self._code if self._code is not None else 137

    async def terminate(self) -> None:
        await trio.lowlevel.checkpoint()
        if not self._closed:
            self._closed = True
            self._code = 137 if self._code is None else self._code
            self._ready.set()


@dataclass
class FakePtys:
    """A `PtySpawner` of `FakePty`s. Profiles named in `non_interactive` are refused."""

    non_interactive: set[str] = field(default_factory=set)
    spawned: list[FakePty] = field(default_factory=list)

    async def __call__(
        self, *, workspace: str, profile: str, cols: int, rows: int, session: str, actor: str
    ) -> FakePty:
        await trio.lowlevel.checkpoint()
        if profile in self.non_interactive:
            raise GrantInvalid(f"profile {profile} is not interactive", profile=profile)
        pty = FakePty(cols=cols, rows=rows)
        self.spawned.append(pty)
        return pty
