"""The egress proxy: the only way out of an egress sandbox (Trio; docs/egress.md).

Theory of operation. The daemon runs one `EgressProxy` (`serve`, in its nursery). For
each egress sandbox, `substrate.sandbox.proxy_link` hands it a listening TCP socket that
lives inside that sandbox's network namespace (127.0.0.1:3128 there) together with a
`Gate`: the sandbox's allow-list and what to do with a refusal. `attach` starts accepting
on it; every connection is then handled here, in the daemon, and the connection onwards
is made from the daemon's own namespace. The sandbox itself keeps only `lo`.

One connection: read the request head (at most `max_head_bytes`, within
`head_timeout_s`), parse it (`substrate.egress.request`), and check the host and port
against the gate's allow-list *before anything is resolved*. A refusal is reported
(`Gate.denied`: the sandbox side finds the command and journals it) and answered with
403 `egress_denied`; then the connection closes. An allowed request is connected
directly (resolve; judge every answer, `substrate.egress.destination`, and refuse the
name if any is this host's own or its containers'; only then connect, to those answers,
within `connect_timeout_s`) or
through the upstream proxy the daemon's environment names (`substrate.egress.upstream`;
no resolution here then); a tunnel is answered 200, a plain request is sent on in origin
form with exactly its declared body (`substrate.egress.body`: what the client sends after
it, a pipelined second request, is dropped, never relayed); then bytes are relayed both
ways (for a plain request: the answer), half-closes passed on, until both sides are done
or nothing moved for `idle_timeout_s`. A tunnel to port 443 of a host in the gate's
`inject` table is the exception: the proxy verifies the real server's TLS, then speaks
TLS with the client itself as that host (the sandbox's own CA) and relays HTTP/1.1
exchanges, setting the secret header on each (`substrate.egress.inject`). Nothing is
cached, nothing is logged of paths, headers or bytes.

Bounds and named refusals (the answer's `X-Substrate-Refusal`): a head too large
(`request_too_large`, 431), malformed (`invalid_params`, 400), not complete in time
(`timeout`, 408); more than `per_gate` connections of one sandbox or `total` of all
(`limit_exceeded`, 503); a host or port not allowed (`egress_denied`, 403); no answer
from the name or the server (`upstream_failed`, 502; `upstream_timeout`, 504); an
injecting host's secret not set (`secret_unknown`, 503).

Supervision: a failing connection is logged and closed, never the proxy; an accept
that fails for lack of descriptors or memory is retried after a pause.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from substrate.egress import authority, destination, inject, splice
from substrate.egress.allow import AllowList
from substrate.egress.authority import SandboxAuthority
from substrate.egress.body import RequestBody
from substrate.egress.inject import Injection
from substrate.egress.request import (
    CONNECTED,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    HeadReader,
    ProxyRequest,
    origin_head,
    parse_request,
    refusal_response,
    response_status,
    upstream_head,
)
from substrate.egress.upstream import Upstream, UpstreamConfig
from substrate.errors import EgressDenied, InvalidParams, Refusal, RuntimeUnavailable
from substrate.metrics import METRICS

log = logging.getLogger("substrate.egress")

#: (address family, socket address) pairs, as `getaddrinfo` gives them.
Addresses = list[tuple[int, tuple[Any, ...]]]
Resolver = Callable[[str, int], Awaitable[Addresses]]
#: Errors of `accept` that mean "not now" (no descriptors, no memory), not "broken".
_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: What a side that went away raises.
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass(frozen=True)
class Limits:
    """The proxy's bounds (seconds, bytes, connections)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    max_headers: int = MAX_HEADERS
    head_timeout_s: float = 15.0
    resolve_timeout_s: float = 10.0
    connect_timeout_s: float = 15.0
    idle_timeout_s: float = 300.0
    per_gate: int = 64  # open connections of one sandbox
    total: int = 1024  # open connections of all sandboxes
    chunk: int = 256 << 10  # bytes read at once when relaying


class ProxyFailure(Exception):
    """The proxy could not serve an allowed request: `name` is `timeout`,
    `upstream_failed` or `upstream_timeout` (the answer's refusal header)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


@dataclass(eq=False)
class Gate:
    """One sandbox's side of the proxy: its allow-list, a label for the log (the short
    container id) and `denied(peer_port, host, port)`, awaited before a refusal is
    answered (the connecting socket still exists then, so its process can be found)."""

    allow: AllowList
    label: str
    denied: Callable[[int, str, int], Awaitable[None]]
    connections: int = 0
    #: Hosts (normalised) whose HTTPS requests get a secret header (`substrate.egress.
    #: inject`), the sandbox's CA that answers as them, and `secret(name)`: the value
    #: (refusing `secret_unknown`), read when a connection to such a host opens.
    inject: Mapping[str, Injection] = field(default_factory=dict)
    authority: SandboxAuthority | None = None
    secret: Callable[[str], Awaitable[str]] | None = None


@dataclass(eq=False)
class Attachment:
    """A listener the proxy accepts on for one gate; `aclose` ends it and its
    connections and closes the socket (the sandbox's namespace is then released)."""

    listener: trio.socket.SocketType
    gate: Gate
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)

    async def aclose(self) -> None:
        self.scope.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await self.done.wait()
        self.listener.close()


async def system_resolve(host: str, port: int) -> Addresses:
    """The host's resolver (`getaddrinfo` in a thread), TCP addresses only."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [(int(family), tuple(sockaddr)) for family, _, _, _, sockaddr in infos]


class EgressProxy:
    """The daemon's allow-listing proxy (see the module's theory of operation)."""

    def __init__(
        self,
        *,
        upstream: UpstreamConfig | None = None,
        limits: Limits | None = None,
        resolve: Resolver | None = None,
        allow_local: bool = False,
        refuse_private: bool = False,
        route: destination.RouteLookup | None = None,
        upstream_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.upstream = upstream if upstream is not None else UpstreamConfig()
        self.limits = limits if limits is not None else Limits()
        #: Replaceable in tests only (a name mapped to a loopback server), with
        #: `allow_local`: connections to this host's own addresses are then allowed.
        self.resolve: Resolver = resolve if resolve is not None else system_resolve
        self.allow_local = allow_local
        #: The operator's `egress_refuse_private`: non-global ranges are refused too.
        self.refuse_private = refuse_private
        #: The kernel's route to an address (`destination.route_to`; replaceable in tests).
        self.route: destination.RouteLookup = route if route is not None else destination.route_to
        #: How an injecting host's real server is verified (default: this host's store).
        self.upstream_tls = upstream_tls
        self.open_connections = 0
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Service task: holds every listener's accept loop and connection until
        cancelled (the daemon stops); then every listener is closed."""
        log.info("egress proxy: %s", self.upstream.describe())
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def attach(self, sock: socket.socket, gate: Gate) -> Attachment:
        """Accept on `sock` (a listening TCP socket, non-blocking or not) for `gate`.
        The proxy owns the socket from now on. Refuses `runtime_unavailable` when the
        proxy is not serving (the socket is closed then)."""
        listener = trio.socket.from_stdlib_socket(sock)
        if self._nursery is None:
            listener.close()
            raise RuntimeUnavailable("the egress proxy is not running")
        attachment = Attachment(listener, gate)
        self._nursery.start_soon(self._accept_loop, attachment)
        return attachment

    async def _accept_loop(self, att: Attachment) -> None:
        try:
            with att.scope:
                async with trio.open_nursery() as connections:
                    await self._accept(att, connections)
        finally:
            att.listener.close()
            att.done.set()

    async def _accept(self, att: Attachment, connections: trio.Nursery) -> None:
        """Accept until the listener closes or breaks (never raises but Cancelled)."""
        while True:
            try:
                conn, peer = await att.listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_RETRY:
                    log.warning("egress %s: the listener failed: %s", att.gate.label, exc)
                    return
                log.warning("egress %s: accept: %s", att.gate.label, exc.strerror)
                await trio.sleep(0.1)
                continue
            except trio.ClosedResourceError:
                return
            if await self._busy(conn, att.gate):
                continue
            connections.start_soon(self._connection, conn, int(peer[1]), att.gate)

    async def _busy(self, conn: trio.socket.SocketType, gate: Gate) -> bool:
        """Over a connection bound: answer `limit_exceeded` at once and close (a short,
        bounded send: the answer fits an empty socket buffer)."""
        if gate.connections < self.limits.per_gate and self.open_connections < self.limits.total:
            return False
        with conn, trio.move_on_after(1.0):
            await conn.send(
                refusal_response("limit_exceeded", "too many open connections through the proxy")
            )
        return True

    async def _connection(self, conn: trio.socket.SocketType, peer_port: int, gate: Gate) -> None:
        self.open_connections += 1
        gate.connections += 1
        stream = trio.SocketStream(conn)
        try:
            await self.handle(stream, peer_port, gate)
        except Exception:  # one connection's failure never ends the proxy
            log.exception("egress %s: a connection failed", gate.label)
        finally:
            self.open_connections -= 1
            gate.connections -= 1
            with trio.CancelScope(shield=True):
                await _close(stream)

    async def handle(self, client: trio.abc.HalfCloseableStream, peer_port: int, gate: Gate) -> str:
        """Serve one client connection through `gate`; returns how it ended: "relayed"
        or the name of the refusal answered. The caller closes `client`."""
        try:
            req, rest = await self._read_request(client)
            if not gate.allow.allows(req.host, req.port):
                await _denied(gate, peer_port, req.host, req.port)
                raise EgressDenied(
                    f"{req.authority} is not in this sandbox's egress_allow (ports 80, 443)"
                )
            injection = _injection(gate, req)
            if injection is not None:
                return await self._inject(client, req, rest, gate, peer_port, injection)
            server, to_server, to_client = await self._open(req, gate, peer_port)
        except (Refusal, ProxyFailure) as exc:
            with trio.move_on_after(self.limits.head_timeout_s):
                await _send_quietly(client, refusal_response(exc.name, exc.message))
            return exc.name
        try:
            if req.tunnel:
                await client.send_all(CONNECTED + to_client)
                await server.send_all(to_server + rest)
                await self._relay(client, server)
            else:
                await server.send_all(to_server)
                await self._relay_request(client, server, RequestBody(req.body), rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # a side went away: the relay is over
        finally:
            with trio.CancelScope(shield=True):
                await _close(server)
        return "relayed"

    async def _inject(
        self,
        client: trio.abc.HalfCloseableStream,
        req: ProxyRequest,
        rest: bytes,
        gate: Gate,
        peer_port: int,
        injection: Injection,
    ) -> str:
        """A tunnel to a host of `gate.inject`: the real server is reached and its
        certificate verified first (`upstream_failed` otherwise, answered plainly); then
        the tunnel is opened, TLS is spoken with the client as that host (the sandbox's
        CA), and `inject.relay` sets the secret header on each request. Refuses as
        `_open`, and `secret_unknown` when the secret is not set."""
        assert gate.authority is not None and gate.secret is not None  # `_injection` says so
        host = req.host.lower().rstrip(".")
        value = await gate.secret(injection.secret)
        server, _, to_client = await self._open(req, gate, peer_port)
        if self.upstream_tls is None:
            self.upstream_tls = authority.upstream_context()
        upstream = trio.SSLStream(
            inject.Prefixed(server, to_client),
            self.upstream_tls,
            server_hostname=host,
            https_compatible=True,
        )
        try:
            try:
                with trio.fail_after(self.limits.connect_timeout_s):
                    await upstream.do_handshake()
            except (*_GONE, trio.TooSlowError):
                raise ProxyFailure(
                    "upstream_failed", f"no verified TLS with {req.authority}"
                ) from None
            await client.send_all(CONNECTED)
            downstream = trio.SSLStream(
                inject.Prefixed(client, rest),
                gate.authority.server_context(host),
                server_side=True,
                https_compatible=True,
            )
            with trio.move_on_after(self.limits.head_timeout_s) as handshake:
                await downstream.do_handshake()
            if handshake.cancelled_caught:
                return "timeout"
            await inject.relay(
                downstream,
                upstream,
                host=host,
                header=injection.header,
                value=value,
                idle_s=self.limits.idle_timeout_s,
                chunk=self.limits.chunk,
            )
        except _GONE:
            pass  # a side went away (or its TLS failed): the relay is over
        finally:
            with trio.CancelScope(shield=True):
                await _close(server)
        return "injected"

    async def _read_request(self, client: trio.abc.ReceiveStream) -> tuple[ProxyRequest, bytes]:
        reader = HeadReader(self.limits.max_head_bytes)
        with trio.move_on_after(self.limits.head_timeout_s):
            while True:
                try:
                    data = await client.receive_some(self.limits.max_head_bytes)
                except (trio.BrokenResourceError, OSError):
                    data = b""
                if not data:
                    raise ProxyFailure("invalid_params", "the connection ended before a request")
                done = reader.feed(data)
                if done is not None:
                    head, rest = done
                    return parse_request(head, max_headers=self.limits.max_headers), rest
        raise ProxyFailure("timeout", f"no whole request within {self.limits.head_timeout_s:g} s")

    async def _open(
        self, req: ProxyRequest, gate: Gate, peer_port: int
    ) -> tuple[trio.SocketStream, bytes, bytes]:
        """(server stream, head still to send it, bytes already due to the client)."""
        if self.upstream.unusable:
            raise ProxyFailure("upstream_failed", "the daemon's upstream proxy is unusable")
        via = self.upstream.for_request(req.host, req.tunnel)
        if via is not None:
            return await self._via(via, req)
        server = await self._direct(req, gate, peer_port)
        return server, (b"" if req.tunnel else origin_head(req)), b""

    async def _direct(self, req: ProxyRequest, gate: Gate, peer_port: int) -> trio.SocketStream:
        found: Addresses | None = None
        with trio.move_on_after(self.limits.resolve_timeout_s):
            try:
                found = await self.resolve(req.host, req.port)
            except OSError:
                raise ProxyFailure("upstream_failed", f"{req.host} does not resolve") from None
        if found is None:
            raise ProxyFailure("upstream_timeout", f"resolving {req.host} took too long")
        if not self.allow_local:
            # Every answer is judged before any connection (destination: no port
            # oracle), and only the answers judged are connected to (no second lookup).
            why = await trio.to_thread.run_sync(self._refusal, [str(a[0]) for _, a in found])
            if why is not None:
                await _denied(gate, peer_port, req.host, req.port)
                raise EgressDenied(f"{req.host} resolves to {why}")
        server = await self._connect(req, found)
        if not self.allow_local and _to_itself(server.socket):
            # Judged not to be this host's, yet delivered here: an address added since.
            await _close(server)
            await _denied(gate, peer_port, req.host, req.port)
            raise EgressDenied(f"{req.host} resolves to an address of this host")
        return server

    def _refusal(self, addresses: list[str]) -> str | None:
        """The first refusal among `addresses` (`destination.refusal`), or None. Blocking."""
        for address in addresses:
            why = destination.refusal(
                address, refuse_private=self.refuse_private, lookup=self.route
            )
            if why is not None:
                return why
        return None

    async def _connect(self, req: ProxyRequest, addresses: Addresses) -> trio.SocketStream:
        for family, addr in addresses:
            sock = trio.socket.socket(family, socket.SOCK_STREAM)
            try:
                with trio.fail_after(self.limits.connect_timeout_s):
                    await sock.connect(addr)
                return trio.SocketStream(sock)
            except (OSError, trio.TooSlowError):
                sock.close()
            except BaseException:
                sock.close()
                raise
        raise ProxyFailure("upstream_failed", f"could not connect to {req.authority}")

    async def _via(self, up: Upstream, req: ProxyRequest) -> tuple[trio.SocketStream, bytes, bytes]:
        """Through the upstream proxy: a tunnel is opened there first (its answer read,
        bounded); a plain request is sent on in absolute form."""
        try:
            with trio.fail_after(self.limits.connect_timeout_s):
                server = await trio.open_tcp_stream(up.host, up.port)
        except (OSError, trio.TooSlowError):
            raise ProxyFailure("upstream_failed", "the upstream proxy does not answer") from None
        if not req.tunnel:
            return server, upstream_head(req, up.authorization), b""
        try:
            with trio.fail_after(self.limits.connect_timeout_s):
                await server.send_all(upstream_head(req, up.authorization))
                head, extra = await _read_head(server, self.limits.max_head_bytes)
            status = response_status(head)
        except (OSError, trio.BrokenResourceError, trio.TooSlowError, ValueError, Refusal):
            await _close(server)
            raise ProxyFailure(
                "upstream_failed", "the upstream proxy did not open a tunnel"
            ) from None
        if not 200 <= status < 300:
            await _close(server)
            raise ProxyFailure("upstream_failed", f"the upstream proxy answered {status}")
        return server, b"", extra

    async def _relay(
        self, a: trio.abc.HalfCloseableStream, b: trio.abc.HalfCloseableStream
    ) -> None:
        """Copy both ways until both directions ended (each end's EOF passed on as a
        half-close) or nothing moved for `idle_timeout_s`. Between two sockets the bytes
        never enter Python (`substrate.egress.splice`)."""
        idle_s = self.limits.idle_timeout_s
        chunk = self.limits.chunk
        with trio.move_on_after(idle_s) as idle:

            def moved() -> None:
                idle.deadline = trio.current_time() + idle_s

            async with trio.open_nursery() as nursery:

                async def pump(
                    src: trio.abc.HalfCloseableStream, dst: trio.abc.HalfCloseableStream
                ) -> None:
                    try:
                        await _pump(src, dst, moved, chunk)
                    except _GONE:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(pump, a, b)
                nursery.start_soon(pump, b, a)

    async def _relay_request(
        self,
        client: trio.abc.HalfCloseableStream,
        server: trio.abc.HalfCloseableStream,
        body: RequestBody,
        rest: bytes,
    ) -> None:
        """A plain request whose head was sent: relay its body and nothing after it
        (`substrate.egress.body`: a pipelined second request is dropped, never relayed),
        pass the client's EOF on, and relay the answer until the server ends it. A body
        whose framing breaks ends both directions at once: no byte from the fault on is
        relayed (the caller closes both sides)."""
        idle_s = self.limits.idle_timeout_s
        chunk = self.limits.chunk
        with trio.move_on_after(idle_s) as idle:

            def moved() -> None:
                idle.deadline = trio.current_time() + idle_s

            async with trio.open_nursery() as nursery:

                async def request() -> None:
                    data: bytes | bytearray = rest
                    try:
                        while True:
                            if out := body.feed(data):
                                await server.send_all(out)
                                moved()
                            data = await client.receive_some(chunk)
                            if not data:
                                body.end()
                                await server.send_eof()
                                return
                    except (*_GONE, InvalidParams):
                        nursery.cancel_scope.cancel()  # the framing broke: abandon both

                async def answer() -> None:
                    with contextlib.suppress(*_GONE):
                        await _pump(server, client, moved, chunk)
                    nursery.cancel_scope.cancel()  # answered: what the client sends is moot

                nursery.start_soon(request)
                nursery.start_soon(answer)


async def _pump(
    src: trio.abc.HalfCloseableStream,
    dst: trio.abc.HalfCloseableStream,
    moved: Callable[[], None],
    chunk: int,
) -> None:
    """Copy `src` to `dst` until `src`'s EOF, then pass it on as a half-close; between
    two sockets with `splice(2)`. Raises what a broken side raises (`_GONE`)."""
    if isinstance(src, trio.SocketStream) and isinstance(dst, trio.SocketStream):
        await splice.pump(src.socket, dst.socket, moved)
        return
    while data := await src.receive_some(chunk):
        await dst.send_all(data)
        moved()
    await dst.send_eof()


def _injection(gate: Gate, req: ProxyRequest) -> Injection | None:
    """The rule for `req` when it is a tunnel to port 443 of an injecting host (a plain
    request or port 80 never carries the secret: it would cross in clear)."""
    if not req.tunnel or req.port != 443 or gate.authority is None or gate.secret is None:
        return None
    return gate.inject.get(req.host.lower().rstrip("."))


def _to_itself(sock: trio.socket.SocketType) -> bool:
    """Did a connection end up on this host (peer address = local address)?"""
    try:
        return bool(sock.getpeername()[0] == sock.getsockname()[0])
    except OSError:
        return False


async def _read_head(stream: trio.abc.ReceiveStream, limit: int) -> tuple[bytes, bytes]:
    reader = HeadReader(limit)
    while True:
        data = await stream.receive_some(limit)
        if not data:
            raise OSError(errno.ECONNRESET, "closed before a whole head")
        done = reader.feed(data)
        if done is not None:
            return done


async def _send_quietly(stream: trio.abc.SendStream, data: bytes) -> None:
    with contextlib.suppress(*_GONE):
        await stream.send_all(data)


async def _close(stream: trio.abc.AsyncResource) -> None:
    with contextlib.suppress(*_GONE):
        await trio.aclose_forcefully(stream)


async def _denied(gate: Gate, peer_port: int, host: str, port: int) -> None:
    """Count one `egress_denied` (docs/fleet.md), then let the gate journal it."""
    METRICS.egress_denied.inc()
    await gate.denied(peer_port, host, port)
