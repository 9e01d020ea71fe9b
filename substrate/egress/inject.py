"""Setting a secret header on every request to one host: an HTTP/1.1 relay over h11.

Theory of operation (docs/egress.md, "Secret injection"). For a host in a profile's
`egress_inject` table, the proxy answers the sandbox's CONNECT, speaks TLS with it as
that host (`substrate.egress.authority`) and opens its own verified TLS connection to the
real server. Between the two, `relay` reads each request with h11 (the sandbox's side in
the SERVER role, the server's in the CLIENT role), one exchange after another on a
kept-alive connection:

1. the request head: `Host` set to the host (the secret goes to that virtual host only),
   the injected header set to the secret's value (whatever the client sent under that
   name is dropped), hop-by-hop headers, `Expect` and `Upgrade` dropped (a client that
   waits for `100 Continue` gets it from here); a body framed ambiguously is refused
   (`substrate.egress.body.framing`);
2. the request body, event by event (h11 frames it again for the server);
3. the answer, event by event as it comes (a streamed answer streams), any header
   whose value holds the secret dropped; informational answers are not passed on.

A request that asks to switch protocols (WebSocket) is answered 501: nothing but
HTTP/1.1 exchanges passes here. Nothing of a request or an answer is logged or kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import h11
import trio

from substrate.egress.body import framing
from substrate.egress.request import MAX_HEAD_BYTES
from substrate.errors import InvalidParams

#: Request headers never passed on: one hop's, and those this relay sets itself.
_DROPPED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
        b"host",
    }
)
#: What a side that went away (or broke TLS) raises.
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass(frozen=True)
class Injection:
    """One host's rule: set `header` (lower case) to the value of the secret `secret`."""

    header: str
    secret: str


class Prefixed(trio.abc.Stream):
    """`stream`, with `first` given back before anything it receives (the bytes that
    came after a CONNECT head, a TLS hello's start)."""

    def __init__(self, stream: trio.abc.Stream, first: bytes) -> None:
        self._stream = stream
        self._first = first

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._first:
            data, self._first = self._first, b""
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def relay(
    client: trio.abc.Stream,
    server: trio.abc.Stream,
    *,
    host: str,
    header: str,
    value: str,
    idle_s: float,
    chunk: int,
) -> None:
    """Relay exchanges between `client` and `server` (both TLS already), setting
    `header: value` on each request, until either side closes, breaks, breaks the
    protocol, or says nothing for `idle_s`. Never raises but Cancelled."""
    down = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    secret = (header.lower().encode("ascii"), value.encode("latin-1"))
    try:
        while await _exchange(client, server, down, up, host, secret, idle_s, chunk):
            down.start_next_cycle()
            up.start_next_cycle()
    except (*_GONE, h11.ProtocolError, UnicodeEncodeError):
        pass  # a side went away, broke HTTP, or the value cannot be a header: over


async def _exchange(
    client: trio.abc.Stream,
    server: trio.abc.Stream,
    down: h11.Connection,
    up: h11.Connection,
    host: str,
    secret: tuple[bytes, bytes],
    idle_s: float,
    chunk: int,
) -> bool:
    """One request and its answer; True when the connection may carry another."""
    request = await _next(down, client, idle_s, chunk)
    if not isinstance(request, h11.Request):
        return False
    headers = [(n.lower(), v) for n, v in request.headers.raw_items()]
    if any(n == b"upgrade" for n, _ in headers):
        await _answer(client, down, 501, b"substrate: this proxy relays HTTP/1.1 only\n")
        return False
    try:
        framing(headers, b"HTTP/" + request.http_version)
    except InvalidParams:
        await _answer(client, down, 400, b"substrate: invalid_params: ambiguous framing\n")
        return False
    if down.they_are_waiting_for_100_continue:
        await client.send_all(down.send(h11.InformationalResponse(status_code=100, headers=[])))
    dropped = _DROPPED | {secret[0]} | _listed(headers)
    forwarded = [(n, v) for n, v in headers if n not in dropped]
    forwarded = [(b"host", host.encode("ascii")), *forwarded, secret]
    await server.send_all(
        up.send(h11.Request(method=request.method, target=request.target, headers=forwarded))
    )
    while True:
        event = await _next(down, client, idle_s, chunk)
        if isinstance(event, h11.Data):
            await server.send_all(up.send(h11.Data(data=event.data)))
        elif isinstance(event, h11.EndOfMessage):
            await server.send_all(up.send(h11.EndOfMessage()))
            break
        else:
            return False
    while True:
        event = await _next(up, server, idle_s, chunk)
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            kept = [(n, v) for n, v in event.headers.raw_items() if secret[1] not in v]
            response = h11.Response(
                status_code=event.status_code, headers=kept, reason=event.reason
            )
            await client.send_all(down.send(response))
        elif isinstance(event, h11.Data):
            await client.send_all(down.send(h11.Data(data=event.data)))
        elif isinstance(event, h11.EndOfMessage):
            await client.send_all(down.send(h11.EndOfMessage()))
            return down.our_state is h11.DONE and up.our_state is h11.DONE
        else:
            return False


async def _next(
    conn: h11.Connection, stream: trio.abc.ReceiveStream, idle_s: float, chunk: int
) -> object:
    """The next event of `conn`, reading `stream` as needed; ConnectionClosed at its end
    or after `idle_s` without a byte."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = b""
        with trio.move_on_after(idle_s):
            data = bytes(await stream.receive_some(chunk))
        if not data:
            return h11.ConnectionClosed()
        conn.receive_data(data)


async def _answer(client: trio.abc.Stream, down: h11.Connection, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    headers.append((b"connection", b"close"))
    await client.send_all(down.send(h11.Response(status_code=status, headers=headers)))
    await client.send_all(down.send(h11.Data(data=body)))
    await client.send_all(down.send(h11.EndOfMessage()))


def _listed(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """The headers a `Connection` header names (one hop's too)."""
    return {
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    }
