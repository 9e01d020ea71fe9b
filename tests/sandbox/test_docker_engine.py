"""Pure-ish parts of `substrate.sandbox.docker_engine`: error mapping and the upgraded exec
stream head."""

from __future__ import annotations

import socket

import docker.errors
import pytest
import requests

from substrate.errors import ImageMissing, RuntimeUnavailable
from substrate.sandbox.docker_engine import _read_response_head, map_exceptions
from substrate.sandbox.engine import EngineError


def api_error(status: int) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError("boom", response=response, explanation="host path /x")


def test_errors_are_mapped_by_status_code() -> None:
    missing = {404: lambda: ImageMissing("missing")}
    with pytest.raises(ImageMissing), map_exceptions("x", missing):
        raise api_error(404)
    with pytest.raises(EngineError) as caught, map_exceptions("x", missing):
        raise api_error(500)
    assert caught.value.status == 500
    with pytest.raises(RuntimeUnavailable) as unreachable, map_exceptions("x"):
        raise requests.exceptions.ConnectionError("no socket at /var/run/docker.sock")
    assert "/var/run" not in unreachable.value.message  # no host paths in refusals


def test_response_head_keeps_the_bytes_after_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(
            b"HTTP/1.1 101 UPGRADED\r\nUpgrade: tcp\r\n\r\n\x01\x00\x00\x00\x00\x00\x00\x02hi"
        )
        status, rest = _read_response_head(a)
    assert status == 101
    assert rest == b"\x01\x00\x00\x00\x00\x00\x00\x02hi"


def test_response_head_cut_short_is_an_engine_error() -> None:
    a, b = socket.socketpair()
    with a:
        b.sendall(b"HTTP/1.1 404 Not")
        b.close()
        with pytest.raises(EngineError):
            _read_response_head(a)
