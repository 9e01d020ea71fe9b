"""`substrate.egress.request` (sans-IO): request heads in, requests and answers out."""

from __future__ import annotations

import pytest

from substrate.egress.request import (
    HeadReader,
    basic_authorization,
    origin_head,
    parse_request,
    refusal_response,
    response_status,
    upstream_head,
)
from substrate.errors import InvalidParams, RequestTooLarge


def head(*lines: str) -> bytes:
    return "\r\n".join(lines).encode()


def test_the_reader_returns_the_head_and_what_followed_it() -> None:
    reader = HeadReader(64)
    assert reader.feed(b"CONNECT a.example:443 HTTP/1.1\r\nHost: a") is None
    assert reader.feed(b".example:443\r") is None
    # The blank line split across two reads is still found.
    done = reader.feed(b"\n\r\n\x16\x03\x01")
    assert done == (b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443", b"\x16\x03\x01")


def test_the_reader_refuses_a_head_past_its_bound() -> None:
    reader = HeadReader(32)
    with pytest.raises(RequestTooLarge):
        reader.feed(b"GET http://a.example/" + b"x" * 40)
    with pytest.raises(RequestTooLarge):
        HeadReader(8).feed(b"GET http://a.example/ HTTP/1.1\r\n\r\n")


def test_connect_names_host_and_port() -> None:
    req = parse_request(head("CONNECT pkg.example.org:443 HTTP/1.1", "Host: pkg.example.org:443"))
    assert (req.method, req.host, req.port, req.tunnel) == ("CONNECT", "pkg.example.org", 443, True)
    assert req.authority == "pkg.example.org:443"
    v6 = parse_request(head("CONNECT [::1]:443 HTTP/1.1"))
    assert (v6.host, v6.port, v6.authority) == ("::1", 443, "[::1]:443")


def test_a_plain_request_goes_on_in_origin_form_with_the_uri_host() -> None:
    req = parse_request(
        head(
            "GET http://pkg.example.org/simple/six/?q=1 HTTP/1.1",
            "Host: other.example",
            "Accept: */*",
            "Proxy-Authorization: Basic c2VjcmV0",
            "Proxy-Connection: keep-alive",
            "Connection: keep-alive, X-Hop",
            "X-Hop: 1",
            "Content-Length: 3",
        )
    )
    assert (req.host, req.port, req.tunnel) == ("pkg.example.org", 80, False)
    assert origin_head(req) == head(
        "GET /simple/six/?q=1 HTTP/1.1",
        "Host: pkg.example.org",
        "Accept: */*",
        "Content-Length: 3",
        "Connection: close",
        "",
        "",
    )


@pytest.mark.parametrize(
    ("target", "host", "port", "path"),
    [
        ("http://a.example", "a.example", 80, b"/"),
        ("http://a.example?x", "a.example", 80, b"/?x"),
        ("http://a.example:8080/p", "a.example", 8080, b"/p"),
        ("HTTP://A.example/p", "A.example", 80, b"/p"),
        ("http://[::1]:443/", "::1", 443, b"/"),
    ],
)
def test_absolute_targets(target: str, host: str, port: int, path: bytes) -> None:
    req = parse_request(head(f"GET {target} HTTP/1.0"))
    assert (req.host, req.port, req.path, req.version) == (host, port, path, b"HTTP/1.0")


@pytest.mark.parametrize(
    "line",
    [
        "GET / HTTP/1.1",  # origin form: not a proxy request
        "GET https://a.example/ HTTP/1.1",  # https without CONNECT
        "GET ftp://a.example/ HTTP/1.1",
        "GET http://user:pw@a.example/ HTTP/1.1",
        "GET http://a.example/ HTTP/2.0",
        "GET http://a.example/ HTTP/1.1 extra",
        "GET  http://a.example/ HTTP/1.1",
        "CONNECT a.example HTTP/1.1",  # no port
        "CONNECT a.example:0 HTTP/1.1",
        "CONNECT a.example:99999 HTTP/1.1",
        "CONNECT a.example:44x HTTP/1.1",
        "CONNECT a_b.example:443 HTTP/1.1",
        "CONNECT [::1:443 HTTP/1.1",
        "G@T http://a.example/ HTTP/1.1",
        "GET http://a.example/a\nX-Smuggled:1 HTTP/1.1",  # a bare LF inside the target
        "GET http://a.example/\x00 HTTP/1.1",
        "GET http://a.example/\x7f HTTP/1.1",
        "POST http://a.example/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked",
    ],
)
def test_malformed_requests_are_invalid(line: str) -> None:
    with pytest.raises(InvalidParams):
        parse_request(head(line))


@pytest.mark.parametrize(
    "header", ["NoColon", "Bad Name: x", " folded: x", "\tfolded", "X: a\rb", "X: a\x00b"]
)
def test_malformed_headers_are_invalid(header: str) -> None:
    with pytest.raises(InvalidParams):
        parse_request(head("GET http://a.example/ HTTP/1.1", header))


def test_too_many_headers_are_refused() -> None:
    lines = [f"X-{i}: {i}" for i in range(11)]
    with pytest.raises(RequestTooLarge):
        parse_request(head("GET http://a.example/ HTTP/1.1", *lines), max_headers=10)
    parse_request(head("GET http://a.example/ HTTP/1.1", *lines[:10]), max_headers=10)


def test_an_upstream_proxy_gets_connect_or_the_absolute_form_with_its_own_credentials() -> None:
    auth = basic_authorization("u", "p w")
    assert auth == "Basic dTpwIHc="
    tunnel = parse_request(head("CONNECT a.example:443 HTTP/1.1", "Proxy-Authorization: mine"))
    assert upstream_head(tunnel, auth) == head(
        "CONNECT a.example:443 HTTP/1.1",
        "Host: a.example:443",
        f"Proxy-Authorization: {auth}",
        "",
        "",
    )
    plain = parse_request(head("GET http://a.example/x HTTP/1.1", "Accept: */*"))
    assert upstream_head(plain, None) == head(
        "GET http://a.example/x HTTP/1.1",
        "Host: a.example",
        "Accept: */*",
        "Connection: close",
        "",
        "",
    )


def test_a_refusal_names_itself_in_a_header_and_the_body() -> None:
    answer = refusal_response("egress_denied", "blocked.invalid:80 is not allowed")
    head_part, _, body = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"\r\nX-Substrate-Refusal: egress_denied" in head_part
    assert b"\r\nConnection: close" in head_part
    assert body == b"substrate: egress_denied: blocked.invalid:80 is not allowed\n"
    assert f"Content-Length: {len(body)}".encode() in head_part
    assert refusal_response("request_too_large", "x").startswith(b"HTTP/1.1 431 ")
    assert refusal_response("limit_exceeded", "x").startswith(b"HTTP/1.1 503 ")


def test_response_status() -> None:
    assert response_status(b"HTTP/1.1 200 Connection established") == 200
    assert response_status(b"HTTP/1.0 407 Proxy Authentication Required\r\nX: y") == 407
    for bad in (b"", b"SSH-2.0-x", b"HTTP/1.1 abc", b"HTTP/3 200 ok"):
        with pytest.raises(ValueError):
            response_status(bad)


def test_the_body_is_framed_anew_for_the_server() -> None:
    chunked = parse_request(
        head("POST http://a.example/ HTTP/1.1", "Transfer-Encoding: chunked", "X: 1")
    )
    assert chunked.body is None
    assert origin_head(chunked) == (
        b"POST / HTTP/1.1\r\nHost: a.example\r\nX: 1\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
    )
    sized = parse_request(head("PUT http://a.example/f HTTP/1.1", "Content-Length: 5, 5"))
    assert sized.body == 5
    assert b"\r\nContent-Length: 5\r\nConnection: close" in origin_head(sized)
    assert parse_request(head("GET http://a.example/ HTTP/1.1")).body == 0
