"""`substrate.egress.proxy` on loopback: a client, the proxy, origin servers and an
upstream proxy, all on 127.0.0.1 in this process. Names resolve through the proxy's own
(test) resolver, which records every question: a refusal must come before any."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import trio

from substrate.egress.allow import AllowList
from substrate.egress.proxy import Addresses, EgressProxy, Gate, Limits
from substrate.egress.upstream import Upstream, UpstreamConfig
from tests.harness.waiting import wait_until_async

MIRROR = "mirror.test"


@dataclass
class Origin:
    """A loopback server: records what it was sent, answers with `respond`."""

    port: int = 0
    heads: list[bytes] = field(default_factory=list)
    respond: Callable[[trio.SocketStream, bytes], Awaitable[None]] | None = None


async def _read_head(stream: trio.abc.ReceiveStream) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return buf, b""
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


async def http_answer(stream: trio.SocketStream, rest: bytes) -> None:
    body = b"hello from the origin\n"
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    )


async def echo(stream: trio.SocketStream, rest: bytes) -> None:
    """Echo everything until EOF, then say how many bytes came and close."""
    total = len(rest)
    await stream.send_all(rest)
    while data := await stream.receive_some(1 << 16):
        total += len(data)
        await stream.send_all(data)
    await stream.send_all(b"|%d" % total)


@dataclass
class World:
    proxy: EgressProxy
    port: int
    denied: list[tuple[int, str, int]]
    resolved: list[tuple[str, int]]
    origins: dict[str, Origin]
    nursery: trio.Nursery

    async def client(self) -> trio.SocketStream:
        return await trio.open_tcp_stream("127.0.0.1", self.port)

    async def ask(self, request: bytes) -> bytes:
        """Send a request and read the whole answer (until the proxy closes)."""
        stream = await self.client()
        async with stream:
            await stream.send_all(request)
            return await read_all(stream)

    async def origin(self, name: str, respond: Callable[..., Awaitable[None]]) -> Origin:
        found = Origin(respond=respond)

        async def handler(stream: trio.SocketStream) -> None:
            head, rest = (b"", b"")
            if respond is http_answer:
                head, rest = await _read_head(stream)
                found.heads.append(head)
            await respond(stream, rest)

        listeners = await self.nursery.start(
            functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
        )
        found.port = listeners[0].socket.getsockname()[1]
        self.origins[name] = found
        return found


async def read_all(stream: trio.abc.ReceiveStream) -> bytes:
    out = b""
    with trio.fail_after(10):
        while data := await stream.receive_some(1 << 16):
            out += data
    return out


def refusal_of(answer: bytes) -> str | None:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b": ")
        if name == b"X-Substrate-Refusal":
            return value.decode()
    return None


async def _world(
    nursery: trio.Nursery, *, allow: list[str], limits: Limits | None = None, **kw: object
) -> World:
    denied: list[tuple[int, str, int]] = []
    resolved: list[tuple[str, int]] = []
    origins: dict[str, Origin] = {}

    async def resolve(host: str, port: int) -> Addresses:
        resolved.append((host, port))
        if host not in origins:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET, ("127.0.0.1", origins[host].port))]

    async def on_denied(peer_port: int, host: str, port: int) -> None:
        denied.append((peer_port, host, port))

    proxy = EgressProxy(limits=limits, resolve=resolve, **kw)  # type: ignore[arg-type]
    await nursery.start(proxy.serve)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    proxy.attach(sock, Gate(allow=AllowList.of(allow), label="test", denied=on_denied))
    return World(proxy, port, denied, resolved, origins, nursery)


@pytest.fixture
async def world(nursery: trio.Nursery) -> AsyncIterator[World]:
    yield await _world(nursery, allow=[MIRROR, "*.pkg.test"], allow_local=True)


# -- refusals before resolution -----------------------------------------------------------


async def test_a_name_not_allowed_is_refused_before_any_resolution(world: World) -> None:
    stream = await world.client()
    local_port = stream.socket.getsockname()[1]
    async with stream:
        await stream.send_all(b"GET http://blocked.invalid/path HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await read_all(stream)
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert refusal_of(answer) == "egress_denied"
    assert b"blocked.invalid:80" in answer
    answer = await world.ask(b"CONNECT blocked.invalid:443 HTTP/1.1\r\n\r\n")
    assert refusal_of(answer) == "egress_denied"
    assert world.resolved == []  # never looked up
    assert world.denied == [
        (local_port, "blocked.invalid", 80),
        (world.denied[1][0], "blocked.invalid", 443),
    ]


async def test_an_allowed_name_on_another_port_is_refused_unresolved(world: World) -> None:
    for request in (
        b"CONNECT mirror.test:22 HTTP/1.1\r\n\r\n",
        b"GET http://mirror.test:8080/ HTTP/1.1\r\n\r\n",
        b"CONNECT pkg.test:443 HTTP/1.1\r\n\r\n",  # the wildcard's own apex
    ):
        assert refusal_of(await world.ask(request)) == "egress_denied"
    assert world.resolved == []
    assert [d[1:] for d in world.denied] == [(MIRROR, 22), (MIRROR, 8080), ("pkg.test", 443)]


# -- allowed traffic ----------------------------------------------------------------------


async def test_plain_http_reaches_the_origin_in_origin_form(world: World) -> None:
    origin = await world.origin(MIRROR, http_answer)
    answer = await world.ask(
        b"GET http://mirror.test/simple/six/ HTTP/1.1\r\nHost: elsewhere.test\r\n"
        b"Proxy-Authorization: Basic c2VjcmV0\r\nUser-Agent: t\r\n\r\n"
    )
    assert answer.endswith(b"hello from the origin\n")
    assert refusal_of(answer) is None
    assert origin.heads == [
        b"GET /simple/six/ HTTP/1.1\r\nHost: mirror.test\r\nUser-Agent: t\r\nConnection: close"
    ]
    assert world.resolved == [(MIRROR, 80)]
    assert world.denied == []


async def test_a_tunnel_carries_bytes_both_ways_and_passes_the_half_close(world: World) -> None:
    await world.origin("a.pkg.test", echo)
    payload = os.urandom(3 << 20)
    stream = await world.client()
    async with stream:
        # The first bytes ride along with the CONNECT, as a client's TLS hello may.
        await stream.send_all(b"CONNECT a.pkg.test:443 HTTP/1.1\r\n\r\n" + payload[:100])

        async def send() -> None:
            await stream.send_all(payload[100:])
            await stream.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            answer = await read_all(stream)
    established = b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert answer.startswith(established)
    body = answer[len(established) :]
    assert hashlib.sha256(body[: len(payload)]).digest() == hashlib.sha256(payload).digest()
    assert body[len(payload) :] == b"|%d" % len(payload)
    assert world.resolved == [("a.pkg.test", 443)]


async def test_a_name_resolving_to_this_host_is_refused_by_default(nursery: trio.Nursery) -> None:
    world = await _world(nursery, allow=[MIRROR])
    await world.origin(MIRROR, http_answer)
    answer = await world.ask(b"GET http://mirror.test/ HTTP/1.1\r\n\r\n")
    assert refusal_of(answer) == "egress_denied"
    assert b"address of this host" in answer
    assert world.resolved == [(MIRROR, 80)]
    assert [d[1:] for d in world.denied] == [(MIRROR, 80)]


async def test_a_name_that_does_not_resolve_is_a_bad_gateway(world: World) -> None:
    answer = await world.ask(b"CONNECT nowhere.pkg.test:443 HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert refusal_of(answer) == "upstream_failed"
    assert world.denied == []


# -- bounds -------------------------------------------------------------------------------


async def test_bounds_are_named_refusals(nursery: trio.Nursery) -> None:
    limits = Limits(max_head_bytes=256, max_headers=4, head_timeout_s=0.3)
    world = await _world(nursery, allow=[MIRROR], limits=limits, allow_local=True)
    big = b"GET http://mirror.test/" + b"x" * 300 + b" HTTP/1.1\r\n\r\n"
    assert refusal_of(await world.ask(big)) == "request_too_large"
    many = b"GET http://mirror.test/ HTTP/1.1\r\n" + b"X: 1\r\n" * 5 + b"\r\n"
    assert refusal_of(await world.ask(many)) == "request_too_large"
    assert refusal_of(await world.ask(b"GET / HTTP/1.1\r\n\r\n")) == "invalid_params"
    # Half a head, then silence: the proxy gives up and says so.
    assert refusal_of(await world.ask(b"GET http://mirror.test/ HTTP/1.1\r\n")) == "timeout"
    assert world.resolved == []


async def test_connections_past_the_bound_are_refused_at_once(nursery: trio.Nursery) -> None:
    world = await _world(nursery, allow=[MIRROR], limits=Limits(per_gate=1), allow_local=True)
    await world.origin(MIRROR, echo)
    held = await world.client()
    async with held:
        await held.send_all(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n")
        assert (await held.receive_some(1024)).startswith(b"HTTP/1.1 200 ")
        answer = await world.ask(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert refusal_of(answer) == "limit_exceeded"
    # The held one is gone: there is room again.
    await wait_until_async(lambda: world.proxy.open_connections == 0, 10)
    answer = await world.ask(b"GET http://blocked.invalid/ HTTP/1.1\r\n\r\n")
    assert refusal_of(answer) == "egress_denied"


async def test_an_idle_tunnel_is_closed(nursery: trio.Nursery) -> None:
    world = await _world(
        nursery, allow=[MIRROR], limits=Limits(idle_timeout_s=0.3), allow_local=True
    )
    await world.origin(MIRROR, echo)
    stream = await world.client()
    async with stream:
        await stream.send_all(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\nping")
        answer = await read_all(stream)  # ends: the proxy closed the idle tunnel
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\nping"


async def test_a_closed_attachment_stops_accepting(nursery: trio.Nursery) -> None:
    proxy = EgressProxy()
    await nursery.start(proxy.serve)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    port = sock.getsockname()[1]

    async def on_denied(peer_port: int, host: str, port: int) -> None:
        pass

    attachment = proxy.attach(sock, Gate(allow=AllowList.of([]), label="t", denied=on_denied))
    assert (
        refusal_of(await _ask(port, b"CONNECT x.invalid:443 HTTP/1.1\r\n\r\n")) == "egress_denied"
    )
    await attachment.aclose()
    assert attachment.done.is_set()
    assert attachment.listener.fileno() == -1
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def _ask(port: int, request: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        return await read_all(stream)


# -- an upstream proxy --------------------------------------------------------------------


async def _upstream(nursery: trio.Nursery, status: bytes = b"200 OK") -> tuple[int, list[bytes]]:
    """A parent proxy: records each request head; answers CONNECT with `status` then
    echoes; answers a plain request with a fixed body."""
    heads: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        head, rest = await _read_head(stream)
        heads.append(head)
        if head.startswith(b"CONNECT "):
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\n\r\n")
            if status.startswith(b"200"):
                await echo(stream, rest)
        else:
            await http_answer(stream, rest)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1], heads


async def test_through_an_upstream_proxy_nothing_is_resolved_here(nursery: trio.Nursery) -> None:
    port, heads = await _upstream(nursery)
    up = Upstream("127.0.0.1", port, authorization="Basic dTpw")
    world = await _world(
        nursery, allow=["pkg.example.org"], upstream=UpstreamConfig(https=up, http=up)
    )
    stream = await world.client()
    async with stream:
        await stream.send_all(b"CONNECT pkg.example.org:443 HTTP/1.1\r\n\r\nhello")
        await stream.send_eof()
        answer = await read_all(stream)
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\nhello|5"
    answer = await world.ask(b"GET http://pkg.example.org/x HTTP/1.1\r\nAccept: */*\r\n\r\n")
    assert answer.endswith(b"hello from the origin\n")
    assert heads == [
        b"CONNECT pkg.example.org:443 HTTP/1.1\r\nHost: pkg.example.org:443\r\n"
        b"Proxy-Authorization: Basic dTpw",
        b"GET http://pkg.example.org/x HTTP/1.1\r\nProxy-Authorization: Basic dTpw\r\n"
        b"Host: pkg.example.org\r\nAccept: */*\r\nConnection: close",
    ]
    assert world.resolved == []
    # Still: the allow-list comes first, and a refused name never reaches the upstream.
    assert refusal_of(await world.ask(b"CONNECT blocked.invalid:443 HTTP/1.1\r\n\r\n")) == (
        "egress_denied"
    )
    assert len(heads) == 2


async def test_an_upstream_that_refuses_or_cannot_be_used_is_a_bad_gateway(
    nursery: trio.Nursery,
) -> None:
    port, _ = await _upstream(nursery, status=b"407 Proxy Authentication Required")
    world = await _world(
        nursery, allow=[MIRROR], upstream=UpstreamConfig(https=Upstream("127.0.0.1", port))
    )
    answer = await world.ask(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n")
    assert refusal_of(answer) == "upstream_failed"
    assert b"407" in answer
    broken = await _world(
        nursery, allow=[MIRROR], upstream=UpstreamConfig(unusable="socks is not supported")
    )
    assert refusal_of(await broken.ask(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n")) == (
        "upstream_failed"
    )
    assert broken.resolved == []


# -- one request per plain connection: nothing after it is relayed ------------------------


@dataclass
class Recorder:
    """A loopback server that keeps every byte it is sent until the client's EOF, then
    answers once and closes."""

    port: int = 0
    received: list[bytes] = field(default_factory=list)


async def _recorder(nursery: trio.Nursery) -> Recorder:
    found = Recorder()

    async def handler(stream: trio.SocketStream) -> None:
        buf = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(65536):
                buf += data
        found.received.append(buf)
        with contextlib.suppress(trio.BrokenResourceError):  # the proxy may have gone
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
            )

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    found.port = listeners[0].socket.getsockname()[1]
    return found


SMUGGLED = b"GET http://evil.invalid/steal HTTP/1.1\r\nHost: evil.invalid\r\n\r\n"


async def _send_and_close(world: World, request: bytes) -> bytes:
    stream = await world.client()
    async with stream:
        await stream.send_all(request)
        await stream.send_eof()
        return await read_all(stream)


async def test_a_pipelined_second_request_never_reaches_the_origin(world: World) -> None:
    recorder = await _recorder(world.nursery)
    world.origins[MIRROR] = Origin(port=recorder.port)
    first = b"GET http://mirror.test/a HTTP/1.1\r\nHost: mirror.test\r\n\r\n"
    answer = await _send_and_close(world, first + SMUGGLED)
    assert answer.endswith(b"\r\n\r\nok")
    assert recorder.received == [
        b"GET /a HTTP/1.1\r\nHost: mirror.test\r\nConnection: close\r\n\r\n"
    ]
    assert world.resolved == [(MIRROR, 80)]


@pytest.mark.parametrize(
    ("head", "body", "relayed"),
    [
        (b"Content-Length: 5", b"hello", b"hello"),
        (b"Content-Length: 5, 5", b"hello", b"hello"),
        (
            b"Transfer-Encoding: chunked",
            b"2\r\nhe\r\n3;x=y\r\nllo\r\n0\r\nT: 1\r\n\r\n",
            b"2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n",
        ),
    ],
)
async def test_exactly_the_declared_body_is_relayed(
    world: World, head: bytes, body: bytes, relayed: bytes
) -> None:
    recorder = await _recorder(world.nursery)
    world.origins[MIRROR] = Origin(port=recorder.port)
    request = b"POST http://mirror.test/up HTTP/1.1\r\n" + head + b"\r\n\r\n" + body
    answer = await _send_and_close(world, request + SMUGGLED)
    assert answer.endswith(b"\r\n\r\nok")
    (received,) = recorder.received
    assert received.endswith(b"\r\n\r\n" + relayed)
    assert b"evil.invalid" not in received


async def test_through_an_upstream_proxy_a_second_request_goes_nowhere(
    nursery: trio.Nursery,
) -> None:
    recorder = await _recorder(nursery)
    up = Upstream("127.0.0.1", recorder.port)
    world = await _world(nursery, allow=[MIRROR], upstream=UpstreamConfig(http=up))
    first = b"GET http://mirror.test/a HTTP/1.1\r\nHost: mirror.test\r\n\r\n"
    answer = await _send_and_close(world, first + SMUGGLED)
    assert answer.endswith(b"\r\n\r\nok")
    assert recorder.received == [
        b"GET http://mirror.test/a HTTP/1.1\r\nHost: mirror.test\r\nConnection: close\r\n\r\n"
    ]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST http://mirror.test/ HTTP/1.1\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST http://mirror.test/ HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 40\r\n\r\nabc",
        b"POST http://mirror.test/ HTTP/1.1\r\nContent-Length: 3, 4\r\n\r\nabc",
        b"POST http://mirror.test/ HTTP/1.1\r\nContent-Length: -3\r\n\r\nabc",
        b"POST http://mirror.test/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"POST http://mirror.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: identity\r\n\r\n0\r\n\r\n",
        b"POST http://mirror.test/ HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET http://mirror.test/ HTTP/1.1\r\nX-A: 1\r\n folded: 2\r\n\r\n",
        b"GET http://mirror.test/a\nX-Smuggled:1 HTTP/1.1\r\n\r\n",
        b"GET http://mirror.test/ HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
    ],
)
async def test_ambiguous_framing_is_refused_before_anything_is_sent(
    world: World, request_bytes: bytes
) -> None:
    recorder = await _recorder(world.nursery)
    world.origins[MIRROR] = Origin(port=recorder.port)
    answer = await _send_and_close(world, request_bytes)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert refusal_of(answer) == "invalid_params"
    assert recorder.received == []


async def test_a_malformed_chunk_ends_the_request(world: World) -> None:
    recorder = await _recorder(world.nursery)
    world.origins[MIRROR] = Origin(port=recorder.port)
    request = b"POST http://mirror.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    await _send_and_close(world, request + SMUGGLED)
    # The head went before the body's fault showed; no byte of the body or after it did.
    assert recorder.received in (
        [],
        [
            b"POST / HTTP/1.1\r\nHost: mirror.test\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        ],
    )


# -- addresses are judged before any connection -------------------------------------------


def _own_address() -> str:
    """An IPv4 address of one of this host's interfaces that is not loopback (the
    docker bridge's, the machine's own): the kernel delivers it locally."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = [
            str(a.get_attr("IFA_ADDRESS"))
            for a in ipr.get_addr(family=socket.AF_INET)
            if not str(a.get_attr("IFA_ADDRESS")).startswith("127.")
        ]
    assert found, "this host has no IPv4 address but loopback"
    return found[0]


async def _counting_listener(nursery: trio.Nursery) -> tuple[int, list[int]]:
    """A listener on every address of this host (0.0.0.0) that counts its accepts."""
    accepted: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        accepted.append(1)
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="0.0.0.0"))
    return listeners[0].socket.getsockname()[1], accepted


async def _world_resolving_to(
    nursery: trio.Nursery, answers: Callable[[int], Addresses], **kw: object
) -> tuple[World, int, list[int]]:
    port, accepted = await _counting_listener(nursery)
    world = await _world(nursery, allow=[MIRROR], **kw)

    async def resolve(host: str, want: int) -> Addresses:
        world.resolved.append((host, want))
        return answers(port)

    world.proxy.resolve = resolve
    return world, port, accepted


async def test_a_name_resolving_to_an_own_interface_address_is_refused_unconnected(
    nursery: trio.Nursery,
) -> None:
    own = _own_address()
    world, port, accepted = await _world_resolving_to(
        nursery, lambda port: [(socket.AF_INET, (own, port))]
    )
    for request in (
        b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n",
        b"GET http://mirror.test/ HTTP/1.1\r\n\r\n",
    ):
        answer = await world.ask(request)
        assert refusal_of(answer) == "egress_denied"
        assert b"address of this host" in answer
        assert own.encode() not in answer  # the sandbox does not learn what it resolved to
    assert accepted == []  # no connection was made, not even to be dropped
    assert [d[1:] for d in world.denied] == [(MIRROR, 443), (MIRROR, 80)]
    # The listener does accept from this host: the refusal above was the proxy's.
    await (await trio.open_tcp_stream(own, port)).aclose()
    await wait_until_async(lambda: accepted == [1], 10)


async def test_one_own_address_among_the_answers_refuses_the_name(nursery: trio.Nursery) -> None:
    own = _own_address()
    world, _, accepted = await _world_resolving_to(
        nursery,
        lambda port: [(socket.AF_INET, (own, port)), (socket.AF_INET, ("127.0.0.1", port))],
    )
    assert refusal_of(await world.ask(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n")) == (
        "egress_denied"
    )
    assert accepted == []
