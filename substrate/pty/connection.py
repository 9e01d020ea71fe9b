"""One terminal client over a WebSocket: first frame, then input in, output out.

Theory of operation: after the upgrade the client has `first_frame_timeout_s` to send
`open` (else 4408). Once attached, three tasks run until the first of them finishes the
connection: the *receiver* (client frames → `Terminals`), the *sender* (the session's ring
→ `output`/`resync`/`exit` frames through this client's own cursor) and the *pinger*.
Whatever ends the connection records `(close code, error frame)` once and cancels the
others; then the error frame (if any) and the close are sent, each bounded in time, and
the client is detached. A client that does not take a frame within `send_timeout_s`, or
does not answer a ping within `ping_timeout_s`, is disconnected: its backlog never grows
past the ring, and it never slows the PTY or anyone else.
"""

from __future__ import annotations

import logging
import re

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from substrate.errors import Refusal
from substrate.pty import frames
from substrate.pty.frames import (
    CLOSE_NORMAL,
    CLOSE_TIMEOUT,
    CLOSE_TOO_SLOW,
    Close,
    Error,
    FrameRefused,
    Input,
    Open,
    Resize,
    close_code_for,
)
from substrate.pty.ring import Cursor
from substrate.pty.terminals import Attached, Terminals

log = logging.getLogger("substrate.pty")
_GRANT_ID = re.compile(r"^g-[0-9a-f]{16}$")


class _Client:
    def __init__(self, ws: WebSocketConnection, terminals: Terminals) -> None:
        self.ws = ws
        self.terminals = terminals
        self.settings = terminals.settings
        self.scope = trio.CancelScope()
        self.final: tuple[int, Error | None] | None = None
        self.reason = "disconnected"

    def finish(self, code: int, error: Error | None, reason: str) -> None:
        """End the connection with this close code (the first call wins)."""
        if self.final is None:
            self.final = (code, error)
            self.reason = reason
        self.scope.cancel()

    def refuse(self, exc: Refusal | FrameRefused, opening: Open | None = None) -> None:
        """End the connection with a refusal's error frame and close code; journal it."""
        if isinstance(exc, FrameRefused):
            name, code, error = exc.refusal, exc.code, exc.frame()
        else:
            name, code = exc.name, close_code_for(exc.name)
            error = Error(refusal=name, message=exc.message)
        data: dict[str, object] = {"refusal": name}
        if opening is not None:
            data["mode"] = opening.mode
            if opening.session is not None:
                data["session"] = opening.session
            grant = opening.token.split(".", 1)[0]
            if _GRANT_ID.match(grant):
                data["grant"] = grant  # the id only: never the token
        self.terminals.record("pty.refused", data, actor="web")
        self.finish(code, error, name)

    async def send(self, frame: frames.ServerFrame) -> None:
        with trio.move_on_after(self.settings.send_timeout_s) as timer:
            await self.ws.send_message(frames.encode(frame))
        if timer.cancelled_caught:
            self.finish(CLOSE_TOO_SLOW, None, "too_slow")
            await trio.sleep_forever()

    async def run(self) -> None:
        attached: Attached | None = None
        try:
            with self.scope:
                first: Open | None = None
                try:
                    first = await self._first_frame()
                    attached = await self.terminals.open(first, self.finish)
                except (Refusal, FrameRefused) as exc:
                    self.refuse(exc, first)
                except ConnectionClosed:
                    self.finish(CLOSE_NORMAL, None, "disconnected")
                except Exception:
                    # Ours, not the peer's: keep the daemon up, tell the client, log why.
                    log.exception("terminal open failed")
                    self.finish(
                        frames.CLOSE_FAILED,
                        Error(refusal="internal", message="the session could not start"),
                        "internal",
                    )
                if attached is not None:
                    await self._attached(attached)
        finally:
            # Detach first: the session must not wait for a polite close with a dead peer.
            if attached is not None:
                self.terminals.detach(attached, self.reason)
        await self._close()

    async def _attached(self, attached: Attached) -> None:
        try:
            await self.send(
                frames.Opened(
                    session=attached.live.session.id, mode=attached.mode, seq=attached.start
                )
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receiver, attached)
                nursery.start_soon(self._pinger)
                await self._sender(attached)
        except ConnectionClosed:
            # It went away while the session was starting: the session lives on.
            self.finish(CLOSE_NORMAL, None, "disconnected")

    async def _first_frame(self) -> Open:
        with trio.move_on_after(self.settings.first_frame_timeout_s):
            return frames.decode_first_frame(await self.ws.get_message())
        raise FrameRefused(
            "invalid_params",
            f"no open frame within {self.settings.first_frame_timeout_s:g} s",
            CLOSE_TIMEOUT,
        )

    async def _close(self) -> None:
        code, error = self.final or (CLOSE_NORMAL, None)
        if code == CLOSE_TOO_SLOW:
            # It does not read: a close handshake would only wait. Drop the stream.
            return
        with trio.move_on_after(2):
            if error is not None:
                await self.ws.send_message(frames.encode(error))
            await self.ws.aclose(code, error.refusal if error else None)

    async def _receiver(self, attached: Attached) -> None:
        try:
            while True:
                message = await self.ws.get_message()
                frame = frames.decode_client_frame(message)
                if isinstance(frame, Input):
                    await self.terminals.input(attached, frame.data)
                elif isinstance(frame, Resize):
                    self.terminals.resize(attached, frame.cols, frame.rows)
                elif isinstance(frame, Close):
                    await self.terminals.close_frame(attached)
                    self.finish(CLOSE_NORMAL, None, "close")
                    return
                else:
                    raise FrameRefused(
                        "invalid_params", "open may only be the first frame", frames.CLOSE_BAD_FRAME
                    )
        except (Refusal, FrameRefused) as exc:
            self.refuse(exc)
        except ConnectionClosed as exc:
            code = exc.reason.code if exc.reason is not None else CLOSE_NORMAL
            if code == frames.CLOSE_TOO_LARGE:
                self.finish(code, None, "too_large")
            else:
                self.finish(CLOSE_NORMAL, None, "disconnected")

    async def _pinger(self) -> None:
        while True:
            await trio.sleep(self.settings.ping_interval_s)
            with trio.move_on_after(self.settings.ping_timeout_s) as timer:
                try:
                    await self.ws.ping()
                except ConnectionClosed:
                    self.finish(CLOSE_NORMAL, None, "disconnected")
                    return
            if timer.cancelled_caught:
                self.finish(CLOSE_TIMEOUT, None, "ping_timeout")
                return

    async def _sender(self, attached: Attached) -> None:
        live = attached.live
        cursor = Cursor(live.session.ring, attached.start)
        try:
            while True:
                changed = live.changed
                chunk = cursor.pull(self.settings.frame_bytes)
                if chunk is not None:
                    if chunk.resync:
                        await self.send(frames.Resync(seq=chunk.seq))
                    elif chunk.text:
                        await self.send(frames.Output(seq=chunk.seq, data=chunk.text))
                    continue
                if live.session.state != "running":
                    break
                await changed.wait()
            last = cursor.flush()
            if last is not None:
                await self.send(frames.Output(seq=last.seq, data=last.text))
            code = live.session.exit_code
            await self.send(frames.Exit(code=code if code is not None else -1))
            self.finish(CLOSE_NORMAL, None, live.session.end_reason or "exit")
        except ConnectionClosed:
            self.finish(CLOSE_NORMAL, None, "disconnected")


async def serve_client(ws: WebSocketConnection, terminals: Terminals) -> None:
    """Run one accepted WebSocket until it ends; never raises for the peer's faults."""
    await _Client(ws, terminals).run()
