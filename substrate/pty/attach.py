"""`substrate attach`: a person's terminal client for a grant-gated session (docs/protocol.md §7).

`attach(token, url, session=None, mode="control")` connects to the daemon's `/pty`,
puts the local terminal in raw mode (restored on every way out: `try/finally`), sends
keystrokes as `input` frames, forwards window-size changes (SIGWINCH) as `resize`, writes
`output` to the screen (a `resync` clears it first) and returns the remote exit code.
Other outcomes: 0 after a detach (Ctrl-] — the session lives on and can be re-joined
with `--session`), 1 for a refusal (printed), 255 when the connection drops.

The token is a secret: prefer the `SUBSTRATE_TOKEN` environment variable to `--token`,
which other local users can see in the process list. Without `--url`, the URL comes from
the daemon itself (`daemon.status` → `listen`, through `--state-dir` or
`$SUBSTRATE_STATE_DIR`), never from a default port: a token sent to whatever else
listens on 7681 would be a leak. When the daemon cannot say, attach refuses to guess.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from typing import Literal

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
)

from substrate.protocol.client import Client, ConnectionLost, RpcError, socket_path
from substrate.pty import frames
from substrate.pty.client import open_terminal

#: Ctrl-]: leave the session running and exit (as telnet does).
DETACH_KEY = b"\x1d"
EXIT_REFUSED = 1
EXIT_DROPPED = 255

Mode = Literal["control", "observe"]


class NoTerminalUrl(Exception):
    """The daemon could not be asked where its terminals are, or serves none."""


def terminal_listen(client: Client) -> str:
    """The daemon's terminal `HOST:PORT` (`daemon.status` → `listen`); `NoTerminalUrl` if none."""
    listen = client.call("daemon.status").get("listen")
    if not isinstance(listen, str) or not listen:
        raise NoTerminalUrl("the daemon serves no terminals (its log says why)")
    return listen


def daemon_terminal_url(state: str | os.PathLike[str] | None = None) -> str:
    """The `/pty` URL of the daemon at state dir `state` (default: $SUBSTRATE_STATE_DIR...).

    Asks the daemon over its agent socket; raises `NoTerminalUrl` when it cannot be
    reached or serves no terminals, so that a caller never falls back to a guess.
    """
    path = socket_path(state)
    try:
        with Client(path, timeout=30.0) as client:
            return f"ws://{terminal_listen(client)}/pty"
    except (OSError, RpcError, ConnectionLost) as exc:
        raise NoTerminalUrl(
            f"cannot ask the daemon at {path} for its terminal address: {exc}"
        ) from None


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[bool]:
    """Raw mode on `fd` if it is a terminal (yields whether it is); always restored."""
    if not os.isatty(fd):
        yield False
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return max(1, min(size.columns, 1000)), max(1, min(size.lines, 1000))


def _note(text: str) -> None:
    # The terminal is raw: a line end needs its carriage return.
    os.write(2, f"\r\n[substrate] {text}\r\n".encode())


class _Attach:
    def __init__(self, ws: WebSocketConnection, mode: Mode, stdin: int) -> None:
        self.ws = ws
        self.mode = mode
        self.stdin = stdin
        self.result = EXIT_DROPPED

    async def keys(self) -> None:
        src = trio.lowlevel.FdStream(os.dup(self.stdin))
        async with src:
            while True:
                data = await src.receive_some(4096)
                if not data:
                    # End of input (a pipe): keep watching until the session ends.
                    await trio.sleep_forever()
                if DETACH_KEY in data:
                    before = data.split(DETACH_KEY, 1)[0]
                    if before and self.mode == "control":
                        await self._input(before)
                    self.result = 0
                    _note("detached; the session keeps running")
                    await self.ws.aclose()
                    return
                if self.mode == "control":
                    await self._input(data)

    async def _input(self, data: bytes) -> None:
        text = data.decode("utf-8", errors="replace")
        # Stay far below the 64 KiB frame cap, whatever is pasted.
        for i in range(0, len(text), 8192):
            await self.ws.send_message(frames.encode_client(frames.Input(data=text[i : i + 8192])))

    async def winch(self) -> None:
        with trio.open_signal_receiver(signal.SIGWINCH) as signals:
            async for _ in signals:
                cols, rows = _size(self.stdin)
                with contextlib.suppress(ConnectionClosed):
                    await self.ws.send_message(
                        frames.encode_client(frames.Resize(cols=cols, rows=rows))
                    )

    async def screen(self, out: trio.lowlevel.FdStream) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return
            f = frames.decode_server_frame(message)
            if isinstance(f, frames.Output):
                await out.send_all(f.data.encode("utf-8"))
            elif isinstance(f, frames.Resync):
                await out.send_all(b"\x1bc")  # the bytes in between are lost: reset
            elif isinstance(f, frames.Opened):
                if self.mode == "observe":
                    _note(f"observing {f.session} (Ctrl-] to leave)")
            elif isinstance(f, frames.Exit):
                self.result = f.code
                return
            elif isinstance(f, frames.Error):
                _note(f"refused: {f.refusal}: {f.message}")
                self.result = EXIT_REFUSED
                return


async def attach_async(
    token: str,
    url: str,
    session: str | None = None,
    mode: Mode = "control",
    *,
    stdin: int = 0,
    stdout: int = 1,
) -> int:
    """The client loop, with the terminal already prepared. Returns the exit status."""
    cols, rows = _size(stdin)
    try:
        async with open_terminal(url) as ws:
            client = _Attach(ws, mode, stdin)
            opener = frames.Open(token=token, cols=cols, rows=rows, mode=mode, session=session)
            await ws.send_message(frames.encode_client(opener))
            out = trio.lowlevel.FdStream(os.dup(stdout))
            async with out, trio.open_nursery() as nursery:
                nursery.start_soon(client.keys)
                nursery.start_soon(client.winch)
                await client.screen(out)
                nursery.cancel_scope.cancel()
            return client.result
    except ConnectionRejected as exc:
        _note(
            f"refused by the server: HTTP {exc.status_code} {(exc.body or b'').decode(errors='replace').strip()}"
        )
        return EXIT_REFUSED
    except (HandshakeError, OSError) as exc:
        _note(f"cannot connect to {url}: {exc}")
        return EXIT_DROPPED


def attach(token: str, url: str, session: str | None = None, mode: Mode = "control") -> int:
    """Attach this process's terminal to a session; return the exit status (see above)."""
    blocking = {fd: os.get_blocking(fd) for fd in (0, 1)}
    try:
        with raw_terminal(0):
            return trio.run(attach_async, token, url, session, mode)
    finally:
        # The streams made the shared terminal description non-blocking: undo it.
        for fd, was in blocking.items():
            with contextlib.suppress(OSError):
                os.set_blocking(fd, was)


def main(argv: list[str] | None = None) -> int:
    """`python -m substrate.pty.attach` (the same options as `substrate attach`)."""
    parser = argparse.ArgumentParser(prog="substrate attach", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--token",
        default=os.environ.get("SUBSTRATE_TOKEN"),
        help="the grant token (default $SUBSTRATE_TOKEN; --token shows in ps)",
    )
    parser.add_argument("--url", help="the terminal URL (default: asked of the daemon)")
    parser.add_argument("--state-dir", help="the daemon's state dir, to ask it for the URL")
    parser.add_argument("--session", help="join an existing session")
    parser.add_argument("--observe", action="store_true", help="watch without typing")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("--token or SUBSTRATE_TOKEN is required")
    url = args.url
    if url is None:
        try:
            url = daemon_terminal_url(args.state_dir)
        except NoTerminalUrl as exc:
            print(f"substrate: {exc}; give --url", file=sys.stderr)
            return EXIT_REFUSED
    return attach(args.token, url, args.session, "observe" if args.observe else "control")


if __name__ == "__main__":
    sys.exit(main())
