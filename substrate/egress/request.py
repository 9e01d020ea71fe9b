"""What a client asks the egress proxy, read from bytes (sans-IO: no socket, no clock).

Theory of operation. A connection starts with a request head (the request line and the
headers, up to the blank line). `HeadReader` collects it, refusing one larger than
`max_head_bytes` (`request_too_large`); `parse_request` reads it into a `ProxyRequest`:

- `CONNECT host:port HTTP/1.x` asks for a tunnel (HTTPS): the proxy answers 200 and then
  relays bytes both ways, seeing nothing of what passes;
- `METHOD http://host[:port]/path HTTP/1.x` (absolute form) is plain HTTP: the proxy
  sends the origin server the same request in origin form (`/path`), with `Host` taken
  from the URI (a client cannot name another virtual host than the one it was allowed),
  hop-by-hop headers dropped, the body's framing checked and written anew
  (`substrate.egress.body`) and `Connection: close`: one request per connection. The
  proxy relays that request's body and nothing after it (a pipelined second request
  would otherwise reach the server, or through an upstream proxy any host, unchecked).

Anything that could be framed two ways is refused rather than passed on for the server
to read differently: a target with a control byte or a bare LF, a header value with NUL,
CR or LF, obsolete line folding, and the ambiguous bodies `framing` refuses.

Anything else (origin-form requests, `https://` without CONNECT, malformed lines or
headers, more than `max_headers` headers) is `invalid_params`. Nothing here decides
whether the host is allowed (`substrate.egress.allow`) or resolves it.

`refusal_response` is the proxy's answer to a refused request: a short `text/plain` body
naming the refusal, and the header `X-Substrate-Refusal: <name>`.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass

from substrate.egress.body import framing
from substrate.errors import InvalidParams, RequestTooLarge

#: Bounds of a request head (request line + headers), and of an upstream proxy's answer.
MAX_HEAD_BYTES = 16 << 10
MAX_HEADERS = 100

_TOKEN_RE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION_RE = re.compile(rb"HTTP/1\.[01]")
#: A request target: visible ASCII only (no control byte, no bare LF or CR, no space).
_TARGET_RE = re.compile(rb"[\x21-\x7e]+")
#: A header value: visible characters, spaces and tabs (RFC 9110 §5.5); no NUL, CR or LF.
_VALUE_RE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_HOST_RE = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
_PORT_RE = re.compile(r"[0-9]{1,5}")
#: Headers never forwarded: those of one hop only (RFC 9110 §7.6.1), proxy credentials
#: (a sandbox's are none of the origin's business) and `Host` (set from the URI).
_NOT_FORWARDED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        # The body's framing: checked (`substrate.egress.body.framing`) and written anew.
        b"content-length",
        b"transfer-encoding",
    }
)


@dataclass(frozen=True)
class ProxyRequest:
    """One parsed request head: a CONNECT (`tunnel`) or a plain HTTP request."""

    method: str
    host: str  # as written (not normalised: the allow-list does that), IPv6 without []
    port: int
    tunnel: bool  # CONNECT
    version: bytes = b"HTTP/1.1"
    target: bytes = b""  # plain HTTP: the absolute-form target (for an upstream proxy)
    path: bytes = b"/"  # plain HTTP: the origin-form target (for the origin server)
    headers: tuple[tuple[bytes, bytes], ...] = ()  # plain HTTP: the forwarded headers
    body: int | None = 0  # plain HTTP: the body's length in bytes, None when chunked

    @property
    def authority(self) -> str:
        """`host:port` (`[v6]:port`), as CONNECT names it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def host_header(self) -> bytes:
        """The `Host` value of the URI: the port only when it is not 80."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == 80 else f"{host}:{self.port}").encode("ascii")


class HeadReader:
    """Collects bytes up to the end of a request (or response) head.

    `feed(data)` returns None while the head is incomplete, then `(head, rest)`: the head
    without its final blank line, and whatever followed it (the start of a body, or of a
    TLS handshake). Refuses `request_too_large` past `max_bytes`. Cost: one search of
    the new bytes (plus 3 bytes of overlap).
    """

    def __init__(self, max_bytes: int = MAX_HEAD_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_bytes

    def feed(self, data: bytes | bytearray) -> tuple[bytes, bytes] | None:
        start = max(0, len(self._buf) - 3)
        self._buf += data
        end = self._buf.find(b"\r\n\r\n", start)
        if end < 0:
            if len(self._buf) > self._max:
                raise RequestTooLarge(f"the request head is larger than {self._max} bytes")
            return None
        if end > self._max:
            raise RequestTooLarge(f"the request head is larger than {self._max} bytes")
        return bytes(self._buf[:end]), bytes(self._buf[end + 4 :])

    @property
    def buffered(self) -> int:
        return len(self._buf)


def parse_request(head: bytes, *, max_headers: int = MAX_HEADERS) -> ProxyRequest:
    """Read a request head (without its blank line) into a `ProxyRequest`.

    Refuses `invalid_params`: a malformed request line, header or host; an HTTP version
    other than 1.0/1.1; an origin-form target (this is a proxy); `https://` without
    CONNECT; more than `max_headers` headers (`request_too_large`). Pure.
    """
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN_RE.fullmatch(parts[0]) or not _VERSION_RE.fullmatch(parts[2]):
        raise InvalidParams("malformed request line (METHOD target HTTP/1.x)")
    method, target, version = parts[0].decode("ascii"), parts[1], parts[2]
    if not _TARGET_RE.fullmatch(target):
        raise InvalidParams("malformed request target (a control byte or a bare LF)")
    headers = _headers(lines[1:], max_headers)
    if method == "CONNECT":
        host, port = _authority(target, default_port=None)
        return ProxyRequest(method=method, host=host, port=port, tunnel=True, version=version)
    lowered = target[:8].lower()
    if lowered.startswith(b"https://"):
        raise InvalidParams("an https:// URL goes through CONNECT, not as a plain request")
    if not lowered.startswith(b"http://"):
        raise InvalidParams("not a proxy request: the target must be http://host/... or CONNECT")
    rest = target[7:]
    cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    host, port = _authority(rest[:cut], default_port=80)
    path = rest[cut:] or b"/"
    if path.startswith(b"?"):
        path = b"/" + path
    dropped = _not_forwarded(headers)
    length = framing(headers, version)
    return ProxyRequest(
        method=method,
        host=host,
        port=port,
        tunnel=False,
        version=version,
        target=target,
        path=path,
        headers=tuple((n, v) for n, v in headers if n.lower() not in dropped),
        body=length,
    )


def origin_head(req: ProxyRequest) -> bytes:
    """The head sent to the origin server for a plain HTTP `req`: origin form, `Host`
    from the URI, the forwarded headers, `Connection: close`. Pure."""
    lines = [b" ".join((req.method.encode("ascii"), req.path, req.version))]
    return _head(lines, req)


def upstream_head(req: ProxyRequest, authorization: str | None) -> bytes:
    """The head sent to an upstream (parent) proxy for `req`: a CONNECT for a tunnel, the
    absolute-form request for plain HTTP; `authorization` is the `Proxy-Authorization`
    value of the upstream's own credentials (never the client's). Pure."""
    auth = [f"Proxy-Authorization: {authorization}".encode("latin-1")] if authorization else []
    if req.tunnel:
        authority = req.authority.encode("ascii")
        lines = [b"CONNECT " + authority + b" HTTP/1.1", b"Host: " + authority, *auth]
        return b"\r\n".join(lines) + b"\r\n\r\n"
    first = [b" ".join((req.method.encode("ascii"), req.target, req.version)), *auth]
    return _head(first, req)


def _head(first: list[bytes], req: ProxyRequest) -> bytes:
    lines = [*first, b"Host: " + req.host_header]
    lines += [name + b": " + value for name, value in req.headers]
    if req.body is None:
        lines.append(b"Transfer-Encoding: chunked")
    elif req.body or req.method in ("POST", "PUT", "PATCH"):  # an empty body says so
        lines.append(b"Content-Length: %d" % req.body)
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def basic_authorization(user: str, password: str) -> str:
    """The `Proxy-Authorization` value for HTTP Basic credentials."""
    raw = f"{user}:{password}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


def response_status(head: bytes) -> int:
    """The status code of a response head (an upstream proxy's answer to CONNECT).
    Raises ValueError for anything but `HTTP/1.x NNN ...`."""
    first = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(first) < 2 or not _VERSION_RE.fullmatch(first[0]) or not first[1].isdigit():
        raise ValueError("malformed status line")
    return int(first[1])


#: HTTP status of each refusal the proxy answers with (others: 400).
STATUS = {
    "egress_denied": (403, "Forbidden"),
    "invalid_params": (400, "Bad Request"),
    "request_too_large": (431, "Request Header Fields Too Large"),
    "limit_exceeded": (503, "Service Unavailable"),
    "timeout": (408, "Request Timeout"),
    "upstream_failed": (502, "Bad Gateway"),
    "upstream_timeout": (504, "Gateway Timeout"),
    "secret_unknown": (503, "Service Unavailable"),
}


def refusal_response(name: str, message: str) -> bytes:
    """The proxy's whole answer to a refused request: status, `X-Substrate-Refusal`, and
    `substrate: <name>: <message>` as the body; then the connection closes. Pure."""
    status, reason = STATUS.get(name, (400, "Bad Request"))
    body = f"substrate: {name}: {message}\n".encode("utf-8", "replace")
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        f"X-Substrate-Refusal: {name}\r\n\r\n"
    )
    return head.encode("ascii") + body


#: The answer that opens a tunnel.
CONNECTED = b"HTTP/1.1 200 Connection established\r\n\r\n"


def _headers(lines: list[bytes], max_headers: int) -> list[tuple[bytes, bytes]]:
    if len(lines) > max_headers:
        raise RequestTooLarge(f"more than {max_headers} request headers")
    out = []
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN_RE.fullmatch(name) or not _VALUE_RE.fullmatch(value):
            # Obsolete line folding, bare CR/LF and NUL included: refused, never re-framed.
            raise InvalidParams("malformed request header")
        out.append((name, value.strip(b" \t")))
    return out


def _not_forwarded(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """`_NOT_FORWARDED`, plus every header the `Connection` header lists."""
    listed = {
        token.strip().lower()
        for name, value in headers
        if name.lower() in (b"connection", b"proxy-connection")
        for token in value.split(b",")
    }
    return _NOT_FORWARDED | frozenset(listed)


def _authority(raw: bytes, *, default_port: int | None) -> tuple[str, int]:
    """(host, port) of `host[:port]` / `[v6]:port`; `invalid_params` when malformed."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidParams("the host is not ASCII") from None
    if "@" in text:
        raise InvalidParams("credentials in a proxy URL are not passed on")
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        host, port_text = text[: end + 1], text[end + 1 :].removeprefix(":")
        if end < 0 or (port_text == "" and text[end + 1 :] != ""):
            raise InvalidParams("malformed host")
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    if not _HOST_RE.fullmatch(host):
        raise InvalidParams("malformed host")
    if port_text == "":
        if default_port is None:
            raise InvalidParams("CONNECT needs host:port")
        return host.strip("[]"), default_port
    if not _PORT_RE.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        raise InvalidParams("malformed port")
    return host.strip("[]"), int(port_text)
