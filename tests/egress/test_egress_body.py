"""`substrate.egress.body` (sans-IO): where a plain request's body ends, and nothing after."""

from __future__ import annotations

import pytest

from substrate.egress.body import RequestBody, framing
from substrate.errors import InvalidParams


@pytest.mark.parametrize(
    ("headers", "version", "length"),
    [
        ([], b"HTTP/1.1", 0),
        ([(b"Content-Length", b"12")], b"HTTP/1.0", 12),
        ([(b"content-length", b"7, 7"), (b"Content-Length", b"7")], b"HTTP/1.1", 7),
        ([(b"Transfer-Encoding", b"Chunked")], b"HTTP/1.1", None),
    ],
)
def test_framing_read_from_the_headers(
    headers: list[tuple[bytes, bytes]], version: bytes, length: int | None
) -> None:
    assert framing(headers, version) == length


@pytest.mark.parametrize(
    ("headers", "version"),
    [
        ([(b"Content-Length", b"3"), (b"Transfer-Encoding", b"chunked")], b"HTTP/1.1"),
        ([(b"Content-Length", b"3"), (b"Content-Length", b"4")], b"HTTP/1.1"),
        ([(b"Content-Length", b"3, 4")], b"HTTP/1.1"),
        ([(b"Content-Length", b"+3")], b"HTTP/1.1"),
        ([(b"Content-Length", b"")], b"HTTP/1.1"),
        ([(b"Content-Length", b"9" * 19)], b"HTTP/1.1"),
        ([(b"Transfer-Encoding", b"gzip, chunked")], b"HTTP/1.1"),
        ([(b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"chunked")], b"HTTP/1.1"),
        ([(b"Transfer-Encoding", b"chunked")], b"HTTP/1.0"),
    ],
)
def test_ambiguous_framing_is_refused(headers: list[tuple[bytes, bytes]], version: bytes) -> None:
    with pytest.raises(InvalidParams):
        framing(headers, version)


def test_a_length_body_gives_exactly_its_bytes() -> None:
    body = RequestBody(5)
    assert body.feed(b"he") == b"he" and not body.done
    assert body.feed(b"lloGET http://evil.invalid/ HTTP/1.1\r\n\r\n") == b"llo"
    assert body.done
    assert body.feed(b"more") == b""
    body.end()


def test_no_body_is_done_at_once() -> None:
    body = RequestBody(0)
    assert body.done and body.feed(b"GET http://evil.invalid/ HTTP/1.1\r\n\r\n") == b""


def test_a_chunked_body_is_framed_again_without_extensions_or_trailers() -> None:
    body = RequestBody(None)
    out = body.feed(b"3;ext=1\r\nabc\r\n4\r")
    out += body.feed(b"\ndefg\r\n0\r\nTrailer: x\r\n\r\nGET http://evil.invalid/ HTTP/1.1\r\n\r\n")
    assert body.done
    assert out == b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    assert body.feed(b"5\r\nhello\r\n") == b""


@pytest.mark.parametrize("data", [b"zz\r\n", b"3\r\nabcX\r\n", b"-1\r\n"])
def test_a_malformed_chunk_is_refused(data: bytes) -> None:
    with pytest.raises(InvalidParams):
        RequestBody(None).feed(data)


def test_input_that_ends_inside_the_body_is_refused() -> None:
    body = RequestBody(None)
    body.feed(b"3\r\nab")
    with pytest.raises(InvalidParams):
        body.end()
    with pytest.raises(InvalidParams):
        RequestBody(4).end()
