"""Where a plain HTTP request ends: its body's framing, read from bytes (sans-IO, h11).

Theory of operation. The proxy sends a plain (absolute-form) request on to exactly one
server, so it must relay that request and its declared body and *nothing after it*: the
bytes that follow are a second request (a pipelined `GET http://elsewhere/`), and
relayed verbatim they would reach the allowed server, or through an upstream proxy any
host at all, without ever being checked against the allow-list. `framing` reads from
the request's headers how its body is delimited; `RequestBody` is then fed whatever the client sends; `feed` returns only the
bytes of this request's body (to relay), and `done` turns true at its end. Whatever
follows is the caller's to drop.

The framing is decided from the headers alone, and any doubt is refused
(`invalid_params`, 400) rather than resolved one way while the server resolves it
another (request smuggling, RFC 9112 §6.3 and §11.2):

- `Transfer-Encoding` and `Content-Length` together; more than one `Transfer-Encoding`,
  or one that is not exactly `chunked`; `Transfer-Encoding` in an HTTP/1.0 request;
- `Content-Length` that is not digits, or several that differ (`5, 5` is 5);
- no framing header: no body (a request has no read-until-close body).

A chunked body is decoded by h11's reader (given a head made here, with only the
framing header) and framed again here, one chunk per piece h11 gives, trailers dropped:
the server reads exactly the chunks the proxy read. Malformed chunks are
`invalid_params`. Nothing is buffered beyond h11's bound of one chunk-size line.
"""

from __future__ import annotations

from collections.abc import Iterable

import h11

from substrate.errors import InvalidParams

#: Longest `Content-Length` accepted (digits): 10^18 bytes is beyond any upload.
_MAX_LENGTH_DIGITS = 18
#: The last chunk of a chunked body, without trailers.
_LAST_CHUNK = b"0\r\n\r\n"


def framing(headers: Iterable[tuple[bytes, bytes]], version: bytes) -> int | None:
    """The body of a request with `headers`: its length, None for chunked, 0 for none.
    Refuses `invalid_params` for ambiguous or unsupported framing (see the module). Pure."""
    lengths: set[bytes] = set()
    encodings: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            lengths.update(v.strip(b" \t") for v in value.split(b","))
        elif lowered == b"transfer-encoding":
            encodings.append(value.strip(b" \t").lower())
    if encodings:
        if lengths:
            raise InvalidParams("both Transfer-Encoding and Content-Length: ambiguous framing")
        if encodings != [b"chunked"]:
            raise InvalidParams("only Transfer-Encoding: chunked is relayed")
        if version != b"HTTP/1.1":
            raise InvalidParams("Transfer-Encoding in an HTTP/1.0 request")
        return None
    if not lengths:
        return 0
    if len(lengths) != 1:
        raise InvalidParams("Content-Length values that differ: ambiguous framing")
    (text,) = lengths
    if not text.isdigit() or len(text) > _MAX_LENGTH_DIGITS:
        raise InvalidParams("malformed Content-Length")
    return int(text)


class RequestBody:
    """The body of one request, fed as it comes (see the module's theory of operation).

    `feed(data)` returns the bytes to relay to the server (possibly empty); once `done`,
    it returns nothing more (what follows is not this request's). Refuses
    `invalid_params` for malformed chunked framing. Cost: linear in the bytes fed.
    """

    def __init__(self, length: int | None) -> None:
        """`length`: the body's, as `framing` read it (None: chunked)."""
        self.chunked = length is None
        self._left = 0 if length is None else length
        self._h11: h11.Connection | None = None
        if self.chunked:
            self._h11 = h11.Connection(h11.SERVER)
            self._h11.receive_data(
                b"POST / HTTP/1.1\r\nHost: body\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            if not isinstance(self._h11.next_event(), h11.Request):  # pragma: no cover
                raise AssertionError("h11 did not read the head made for it")
        self.done = not self.chunked and self._left == 0

    def feed(self, data: bytes | bytearray) -> bytes:
        if self.done or not data:
            return b""
        if self._h11 is None:
            taken = data[: self._left]
            self._left -= len(taken)
            self.done = self._left == 0
            return bytes(taken)
        self._h11.receive_data(bytes(data))
        out = bytearray()
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError:
                raise InvalidParams("malformed chunked request body") from None
            if isinstance(event, h11.Data):
                if event.data:  # an empty chunk would end the body
                    out += b"%x\r\n%s\r\n" % (len(event.data), bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                out += _LAST_CHUNK
                self.done = True
                return bytes(out)
            else:  # NEED_DATA
                return bytes(out)

    def end(self) -> None:
        """The client's input ended: refuses `invalid_params` when the body is not whole."""
        if not self.done:
            raise InvalidParams("the connection ended inside the request body")
