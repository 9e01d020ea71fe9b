"""`GET /metrics` over TCP from a Trio task: the Prometheus text page, bounded (docs/fleet.md).

Theory of operation. One listener; each accepted connection gets one request (h11,
`Connection: close`): `GET /metrics` (or `HEAD`) answers the page, any other path 404,
any other method 405. What a scrape storm can cost is capped: at most `MAX_SCRAPERS`
connections are served at once (one more is closed as soon as it is accepted, so the
accept queue drains and no fd or memory piles up), a request head must arrive within
`HEAD_TIMEOUT_S` and fit `MAX_HEAD_BYTES`, and the page is rendered at most once per
`CACHE_S` in a worker thread of its own (a limiter of one): scrapers inside that window
share the bytes. Requests on the daemon's sockets never wait for any of it: the page's
work runs on none of their threads or limiters.

prometheus_client's own server is not used: it serves from threads of its own, with no
cap on connections, and renders the page once per request.
"""

from __future__ import annotations

import ipaddress
import logging

import h11
import trio
from prometheus_client import CONTENT_TYPE_LATEST

from substrate.metrics.registry import Metrics

__all__ = ["CACHE_S", "MAX_SCRAPERS", "parse_metrics_listen", "serve_metrics"]

log = logging.getLogger("substrate.metrics")

#: Connections served at once; more are closed at accept.
MAX_SCRAPERS = 8
#: A request head must be whole within this, seconds, and within this many bytes.
HEAD_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8 << 10
#: Sending the page must finish within this, seconds.
SEND_TIMEOUT_S = 10.0
#: A rendered page is served again for this long, seconds.
CACHE_S = 1.0


def parse_metrics_listen(listen: str, *, allow_remote: bool) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 in brackets) → (host, port). Raises ValueError for anything
    else, and for a host that is not loopback unless `allow_remote`. Pure."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics_listen: expected HOST:PORT, got {listen!r}")
    if host == "localhost":
        return host, int(port)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"metrics_listen: {host!r} is not an IP address or localhost") from None
    if not address.is_loopback and not allow_remote:
        raise ValueError(
            f"metrics_listen: {host} is not a loopback address (set metrics_allow_remote = true"
            " to serve the page beyond this host)"
        )
    return host, int(port)


class _Page:
    """The rendered page, shared by the scrapers of one `CACHE_S` window."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._limiter = trio.CapacityLimiter(1)
        self._lock = trio.Lock()
        self._body = b""
        self._at = -CACHE_S

    async def body(self) -> bytes:
        async with self._lock:
            if trio.current_time() - self._at >= CACHE_S:
                self._body = await trio.to_thread.run_sync(
                    self._metrics.render, limiter=self._limiter
                )
                self._at = trio.current_time()
            return self._body


async def serve_metrics(
    listen: str,
    metrics: Metrics,
    *,
    allow_remote: bool = False,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `metrics` at `http://listen/metrics` until cancelled; `task_status` gets
    the bound port (`:0` picks one). Raises ValueError (`parse_metrics_listen`) before
    binding, OSError when the address cannot be bound."""
    host, port = parse_metrics_listen(listen, allow_remote=allow_remote)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    page = _Page(metrics)
    slots = trio.Semaphore(MAX_SCRAPERS)
    task_status.started(bound)
    async with trio.open_nursery() as nursery:
        for listener in listeners[1:]:
            nursery.start_soon(_accept, listener, page, slots, nursery)
        await _accept(listeners[0], page, slots, nursery)


async def _accept(
    listener: trio.SocketListener, page: _Page, slots: trio.Semaphore, nursery: trio.Nursery
) -> None:
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and the like: wait, never spin or die
                log.warning("metrics: accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            try:
                slots.acquire_nowait()
            except trio.WouldBlock:
                await trio.aclose_forcefully(stream)
                continue
            nursery.start_soon(_serve_one, stream, page, slots)


async def _serve_one(stream: trio.SocketStream, page: _Page, slots: trio.Semaphore) -> None:
    try:
        request = None
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        with trio.move_on_after(HEAD_TIMEOUT_S):
            request = await _read_request(stream, conn)
        if request is None:
            return
        with trio.move_on_after(SEND_TIMEOUT_S):
            await _answer(stream, conn, request, page)
    except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    except Exception:  # one scrape's failure never takes the listener down
        log.exception("metrics: a scrape failed")
    finally:
        slots.release()
        await trio.aclose_forcefully(stream)


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            conn.receive_data(data)  # b"": EOF, next_event says so
            continue
        return None


async def _answer(
    stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, page: _Page
) -> None:
    path = request.target.split(b"?", 1)[0]
    if request.method not in (b"GET", b"HEAD"):
        status, body, ctype = 405, b"method not allowed\n", b"text/plain"
    elif path != b"/metrics":
        status, body, ctype = 404, b"not found: the page is /metrics\n", b"text/plain"
    else:
        status, body, ctype = 200, await page.body(), CONTENT_TYPE_LATEST.encode()
    headers = [
        (b"content-type", ctype),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"cache-control", b"no-store"),
    ]
    if status == 405:
        headers.append((b"allow", b"GET, HEAD"))
    out = conn.send(h11.Response(status_code=status, headers=headers))
    if request.method != b"HEAD":
        out = (out or b"") + (conn.send(h11.Data(data=body)) or b"")
    out = (out or b"") + (conn.send(h11.EndOfMessage()) or b"")
    await stream.send_all(out)
