"""Secret injection (`substrate.egress.inject`, `authority`) on loopback: a client that
trusts only its sandbox's CA, the proxy, and a TLS "upstream" that records the headers
it receives (its certificate from a CA the proxy is told to trust). Nothing leaves this
host: the upstream's name resolves through the proxy's test resolver to 127.0.0.1."""

from __future__ import annotations

import functools
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11
import pytest
import trio

from substrate.egress.allow import AllowList
from substrate.egress.authority import SandboxAuthority
from substrate.egress.inject import Injection
from substrate.egress.proxy import Addresses, EgressProxy, Gate
from substrate.errors import SecretUnknown

API = "api.example.com"
SECRET = "sk-test-0123456789-never-in-the-sandbox"


@dataclass
class Upstream:
    port: int = 0
    connections: int = 0
    requests: list[tuple[bytes, dict[bytes, list[bytes]], bytes]] = field(default_factory=list)


async def _upstream(nursery: trio.Nursery, authority: SandboxAuthority) -> Upstream:
    """A TLS server for API: records each request (target, headers, body) and answers
    with a body, and a header that echoes the key (the proxy must not pass it back)."""
    found = Upstream()
    context = authority.server_context(API)

    async def handler(raw: trio.SocketStream) -> None:
        found.connections += 1
        stream = trio.SSLStream(raw, context, server_side=True)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                body = b""
                event = await _next(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                headers: dict[bytes, list[bytes]] = {}
                for name, value in event.headers:
                    headers.setdefault(name, []).append(value)
                while isinstance(event := await _next(conn, stream), h11.Data):
                    body += event.data
                found.requests.append((event_target(conn), headers, body))
                key = headers.get(b"x-api-key", [b""])[0]
                answer = b"streamed answer " * 100
                await stream.send_all(
                    conn.send(h11.Response(status_code=200, headers=[(b"x-echo", key)]))
                )
                for part in (answer[:700], answer[700:]):
                    await stream.send_all(conn.send(h11.Data(data=part)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
                conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.ProtocolError):
            return

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    found.port = listeners[0].socket.getsockname()[1]
    return found


_targets: dict[int, bytes] = {}


def event_target(conn: h11.Connection) -> bytes:
    return _targets.pop(id(conn), b"")


async def _next(conn: h11.Connection, stream: trio.abc.ReceiveStream) -> object:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data:
                return h11.ConnectionClosed()
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            _targets[id(conn)] = event.target
        return event


@dataclass
class Setup:
    proxy_port: int
    sandbox_ca: SandboxAuthority
    upstream: Upstream
    secret_reads: list[str]


async def _setup(
    nursery: trio.Nursery,
    *,
    upstream_trusted: bool = True,
    secret: Callable[[str], Awaitable[str]] | None = None,
) -> Setup:
    upstream_ca = SandboxAuthority([API])
    upstream = await _upstream(nursery, upstream_ca)
    trusted = upstream_ca if upstream_trusted else SandboxAuthority([API])
    # The test's CA only, where the daemon's default is this host's store.
    tls = ssl.create_default_context(cadata=trusted.cert_pem.decode())
    tls.set_alpn_protocols(["http/1.1"])

    async def resolve(host: str, port: int) -> Addresses:
        assert host == API
        return [(socket.AF_INET, ("127.0.0.1", upstream.port))]

    reads: list[str] = []

    async def read_secret(name: str) -> str:
        reads.append(name)
        return SECRET

    async def denied(peer_port: int, host: str, port: int) -> None:
        raise AssertionError(f"{host}:{port} denied")

    proxy = EgressProxy(resolve=resolve, allow_local=True, upstream_tls=tls)
    await nursery.start(proxy.serve)
    sandbox_ca = SandboxAuthority([API])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    gate = Gate(
        allow=AllowList.of([API]),
        label="t",
        denied=denied,
        inject={API: Injection(header="X-API-Key", secret="model-key")},
        authority=sandbox_ca,
        secret=secret or read_secret,
    )
    proxy.attach(sock, gate)
    return Setup(sock.getsockname()[1], sandbox_ca, upstream, reads)


async def _tunnel(setup: Setup) -> tuple[trio.SocketStream, bytes]:
    raw = await trio.open_tcp_stream("127.0.0.1", setup.proxy_port)
    await raw.send_all(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\n\r\n".encode())
    answer = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in answer and (data := await raw.receive_some(4096)):
            answer += data
    return raw, answer


def _client_context(setup: Setup) -> ssl.SSLContext:
    """What the sandbox trusts: its own CA only (as its bundle would say)."""
    context = ssl.create_default_context(cadata=setup.sandbox_ca.cert_pem.decode())
    context.set_alpn_protocols(["h2", "http/1.1"])  # h2 offered; only http/1.1 answered
    return context


class Recording(trio.abc.Stream):
    """A stream that keeps every byte it received (to search them for the secret)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.seen = b""

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.stream.receive_some(max_bytes)
        self.seen += data
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_the_secret_header_is_set_on_each_request_and_never_seen_by_the_client(
    nursery: trio.Nursery,
) -> None:
    setup = await _setup(nursery)
    raw, answer = await _tunnel(setup)
    assert answer.startswith(b"HTTP/1.1 200 ")
    seen = Recording(raw)
    tls = trio.SSLStream(seen, _client_context(setup), server_hostname=API)
    await tls.do_handshake()
    assert tls.selected_alpn_protocol() == "http/1.1"
    conn = h11.Connection(h11.CLIENT)
    bodies = []
    for headers, body in (
        ([(b"host", API.encode())], b""),
        # A key of the client's own is replaced, whatever its case; another Host too.
        ([(b"host", b"other.example"), (b"X-Api-Key", b"forged")], b'{"q": 1}'),
    ):
        framing = [(b"content-length", b"%d" % len(body))] if body else []
        method = b"POST" if body else b"GET"
        request = h11.Request(method=method, target=b"/v1/messages", headers=headers + framing)
        await tls.send_all(conn.send(request))
        if body:
            await tls.send_all(conn.send(h11.Data(data=body)))
        await tls.send_all(conn.send(h11.EndOfMessage()))
        response = await _next(conn, tls)
        assert isinstance(response, h11.Response) and response.status_code == 200
        assert b"x-echo" not in dict(response.headers)
        data = b""
        while isinstance(event := await _next(conn, tls), h11.Data):
            data += event.data
        bodies.append(data)
        conn.start_next_cycle()
    await tls.aclose()
    assert bodies == [b"streamed answer " * 100] * 2
    assert [(t, h[b"x-api-key"], h[b"host"], b) for t, h, b in setup.upstream.requests] == [
        (b"/v1/messages", [SECRET.encode()], [API.encode()], b""),
        (b"/v1/messages", [SECRET.encode()], [API.encode()], b'{"q": 1}'),
    ]
    assert setup.upstream.connections == 1  # kept alive through the proxy
    assert SECRET.encode() not in seen.seen  # nor, in TLS, could it be: checked in clear
    assert setup.secret_reads == ["model-key"]


async def test_an_upgrade_is_answered_501_and_goes_nowhere(nursery: trio.Nursery) -> None:
    setup = await _setup(nursery)
    raw, _ = await _tunnel(setup)
    tls = trio.SSLStream(raw, _client_context(setup), server_hostname=API)
    conn = h11.Connection(h11.CLIENT)
    headers = [(b"host", API.encode()), (b"upgrade", b"websocket"), (b"connection", b"upgrade")]
    await tls.send_all(conn.send(h11.Request(method=b"GET", target=b"/ws", headers=headers)))
    await tls.send_all(conn.send(h11.EndOfMessage()))
    response = await _next(conn, tls)
    await tls.aclose()
    assert isinstance(response, h11.Response) and response.status_code == 501
    assert setup.upstream.requests == []


async def test_an_upstream_whose_certificate_is_not_trusted_is_a_bad_gateway(
    nursery: trio.Nursery,
) -> None:
    setup = await _setup(nursery, upstream_trusted=False)
    raw, answer = await _tunnel(setup)
    await raw.aclose()
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert b"X-Substrate-Refusal: upstream_failed" in answer
    assert setup.upstream.requests == []


async def test_a_secret_that_is_not_set_refuses_the_tunnel(nursery: trio.Nursery) -> None:
    async def missing(name: str) -> str:
        raise SecretUnknown(f"no secret {name!r} is set", secrets=[name])

    setup = await _setup(nursery, secret=missing)
    raw, answer = await _tunnel(setup)
    await raw.aclose()
    assert b"X-Substrate-Refusal: secret_unknown" in answer
    assert setup.upstream.connections == 0


def test_the_sandbox_ca_vouches_for_its_hosts_only() -> None:
    ca = SandboxAuthority([API])
    assert ca.server_context(API) is ca.server_context(API)  # made once, kept
    with pytest.raises(ValueError):
        ca.server_context("other.example.com")
    assert ca.fingerprint.startswith("sha256:") and len(ca.fingerprint) == 71
    assert b"PRIVATE KEY" not in ca.cert_pem
