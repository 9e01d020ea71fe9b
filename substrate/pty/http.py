"""The terminal HTTP endpoint: the page, its static files, and `GET /pty` (WebSocket).

Theory of operation: each TCP connection's request head (at most 16 KiB, within 10 s) is
parsed with h11. `GET /` and `/static/...` are answered from files shipped in
`substrate/web/` (loaded once) and the connection closes. `GET /pty` must carry an
allowed `Origin` (default: the daemon's own `http://<listen>` and
`http://localhost:<port>`; `null`, a foreign site or no Origin at all are refused with
403 `origin_denied`), then the head is replayed into trio-websocket, which does the
handshake. The query string is never looked at: a token in the URL is ignored (it would
leak into logs and history; the token travels only in the `open` frame).

Messages are capped at 64 KiB: a larger one is refused with an `error` frame and close
4413 as soon as its 64 KiB + 1st byte arrives, so a 16 MiB frame is never buffered.

Every connection ends with a lingering close (`linger`): our FIN first, then what the
peer still sends is read and dropped (at most `LINGER_BYTES`, `LINGER_S`) before the
socket is closed. A socket closed with unread input sends a reset instead, which fails
the peer's write and may discard our last frames before it read them: a client still
writing the rest of a refused 1 MiB frame would see a dropped connection, not the 4413.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
from collections.abc import Callable
from importlib import resources
from typing import Any

import h11
import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, TextMessage

from substrate.pty import frames
from substrate.pty.connection import serve_client
from substrate.pty.terminals import Terminals

log = logging.getLogger("substrate.pty")

MAX_HEAD_BYTES = 16 * 1024
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    426: b"Upgrade Required",
}
HEAD_TIMEOUT_S = 10.0
#: After our last byte, how long the peer may go on sending before we close, seconds.
LINGER_S = 2.0
#: ... and how many bytes of it are read and dropped, at most.
LINGER_BYTES = 64 << 20

_STATIC_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "terminal.js": "text/javascript; charset=utf-8",
    "xterm.js": "text/javascript; charset=utf-8",
    "xterm.css": "text/css; charset=utf-8",
    "addon-fit.js": "text/javascript; charset=utf-8",
    "LICENSE-xterm.txt": "text/plain; charset=utf-8",
}


def load_static() -> dict[str, tuple[bytes, str]]:
    """The shipped page and assets: URL path → (bytes, content type). Missing ones skip."""
    out: dict[str, tuple[bytes, str]] = {}
    web = resources.files("substrate").joinpath("web")
    for name, ctype in _STATIC_TYPES.items():
        f = web.joinpath(name)
        if f.is_file():
            out["/" if name == "index.html" else f"/static/{name}"] = (f.read_bytes(), ctype)
    return out


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 in brackets) → (host, port). Refuses a non-loopback host."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"listen: expected HOST:PORT, got {listen!r}")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"listen: {host} is not a loopback address")
    return host, int(port)


def default_origins(host: str, port: int) -> list[str]:
    """The daemon's own origins for a bound loopback address."""
    shown = f"[{host}]" if ":" in host else host
    return sorted({f"http://{shown}:{port}", f"http://localhost:{port}"})


class _CappedWebSocket(WebSocketConnection):
    """trio-websocket with our frame cap: over it, an `error` frame and close 4413.

    trio-websocket's own cap closes with 1009 and no explanation; docs/protocol.md §7 wants a 44xx
    code. This overrides the one method that counts message bytes (pinned to the
    trio-websocket 0.12 internals; `tests/pty/test_pty_server.py` checks the behaviour).
    """

    async def _handle_message_event(self, event: Any) -> None:
        if self._message_size + len(event.data) <= self._max_message_size:
            await super()._handle_message_event(event)
            return
        message = f"frame exceeds {frames.MAX_FRAME_BYTES} bytes"
        self._message_parts = []
        self._message_size = 0
        self._close_reason = CloseReason(frames.CLOSE_TOO_LARGE, message)
        error = frames.encode(frames.Error(refusal="too_large", message=message))
        # Only while open: we may already be closing (e.g. the first-frame timeout fired).
        if self._wsproto.state == ConnectionState.OPEN:
            with trio.move_on_after(2), contextlib.suppress(ConnectionClosed):
                await self._send(TextMessage(data=error))
                await self._send(CloseConnection(code=frames.CLOSE_TOO_LARGE, reason="too_large"))
        await self._recv_channel.aclose()
        self._reader_running = False


class _Replay(trio.abc.Stream):
    """A stream that first returns bytes already read (the request head)."""

    def __init__(self, stream: trio.abc.Stream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            await trio.lowlevel.checkpoint()
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def linger(stream: trio.SocketStream) -> None:
    """End our side politely: send our FIN, then read and drop what the peer still sends
    until it closes, at most `LINGER_BYTES` within `LINGER_S` (then the close may reset)."""
    dropped = 0
    with (
        trio.move_on_after(LINGER_S),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.send_eof()
        while dropped < LINGER_BYTES:
            data = await stream.receive_some(65536)
            if not data:
                return
            dropped += len(data)


async def _read_head(stream: trio.abc.Stream) -> bytes | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD_BYTES:
            return None
        data = await stream.receive_some(4096)
        if not data:
            return None
        buf += data
    return buf


class TerminalHttp:
    """The HTTP/WebSocket front of the terminals; one per daemon."""

    def __init__(
        self,
        terminals: Terminals,
        *,
        allowed_origins: list[str] | None = None,
        on_refusal: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.terminals = terminals
        self.allowed_origins = list(allowed_origins or [])
        self.static = load_static()
        self._on_refusal = on_refusal
        self.port = 0
        self._csp = b"default-src 'self'"

    async def serve(
        self, listen: str, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on `listen` (loopback only; port 0 picks one) and serve until cancelled.

        `task_status.started` gets the bound port. Refuses a non-loopback address
        (ValueError) before binding.
        """
        host, port = parse_listen(listen)
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        if not self.allowed_origins:
            self.allowed_origins = default_origins(host, self.port)
        sockets = " ".join(o.replace("http://", "ws://", 1) for o in self.allowed_origins)
        self._csp = (
            f"default-src 'self'; connect-src 'self' {sockets}; "
            "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"
        ).encode()
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        head: bytes | None = None
        upgrade = False
        try:
            with trio.move_on_after(HEAD_TIMEOUT_S):
                head = await _read_head(stream)
                if head is None:
                    return
                conn = h11.Connection(h11.SERVER)
                conn.receive_data(head)
                event = conn.next_event()
                if not isinstance(event, h11.Request):
                    await self._respond(stream, conn, 400, b"bad request\n")
                elif event.target.split(b"?", 1)[0] != b"/pty":
                    await self._page(stream, conn, event)
                else:
                    upgrade = await self._upgrade_allowed(stream, conn, event)
            if upgrade and head is not None:
                await self._websocket(_Replay(stream, head))
            await linger(stream)
        except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            # One connection's bug must not take the listener (and the daemon) down.
            log.exception("terminal connection failed")
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _page(self, stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request) -> None:
        if req.method not in (b"GET", b"HEAD"):
            await self._respond(stream, conn, 405, b"method not allowed\n", allow=b"GET, HEAD")
            return
        path = req.target.split(b"?", 1)[0].decode("ascii", errors="replace")
        found = self.static.get(path)
        if found is None:
            await self._respond(stream, conn, 404, b"not found\n")
            return
        body, ctype = found
        await self._respond(
            stream,
            conn,
            200,
            body if req.method == b"GET" else b"",
            ctype=ctype.encode(),
            length=len(body),
        )

    async def _upgrade_allowed(
        self, stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request
    ) -> bool:
        origin = next((v for k, v in req.headers if k == b"origin"), None)
        text = origin.decode("latin-1") if origin is not None else None
        if text not in self.allowed_origins:
            message = f"origin {text!r} is not allowed" if text is not None else "no Origin header"
            body = json.dumps({"refusal": "origin_denied", "message": message}).encode() + b"\n"
            if self._on_refusal is not None:
                self._on_refusal("origin_denied", {"origin": (text or "")[:200]})
            await self._respond(stream, conn, 403, body, ctype=b"application/json")
            return False
        upgrade = next((v for k, v in req.headers if k == b"upgrade"), b"")
        if upgrade.lower() != b"websocket":
            await self._respond(stream, conn, 426, b"websocket upgrade required\n")
            return False
        return True

    async def _respond(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        status: int,
        body: bytes,
        *,
        ctype: bytes = b"text/plain; charset=utf-8",
        length: int | None = None,
        allow: bytes | None = None,
    ) -> None:
        headers = [
            (b"content-type", ctype),
            (b"content-length", str(len(body) if length is None else length).encode()),
            (b"connection", b"close"),
            (b"cache-control", b"no-store"),
            (b"x-content-type-options", b"nosniff"),
            # A terminal page must not be framed by another site (clickjacking keystrokes).
            (b"x-frame-options", b"DENY"),
            (b"content-security-policy", self._csp),
            (b"referrer-policy", b"no-referrer"),
        ]
        if allow is not None:
            headers.append((b"allow", allow))
        reason = _REASONS.get(status, b"")
        data = conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
        if body:
            data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
        data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
        await stream.send_all(data)

    async def _websocket(self, stream: trio.abc.Stream) -> None:
        async with trio.open_nursery() as nursery:
            ws = _CappedWebSocket(
                stream,
                WSConnection(ConnectionType.SERVER),
                max_message_size=frames.MAX_FRAME_BYTES,
                message_queue_size=4,
            )
            nursery.start_soon(ws._reader_task)
            with trio.move_on_after(HEAD_TIMEOUT_S) as timer:
                request = await ws._get_request()
            if timer.cancelled_caught:
                nursery.cancel_scope.cancel()
                return
            conn = await request.accept()
            try:
                await serve_client(conn, self.terminals)
            finally:
                nursery.cancel_scope.cancel()
