"""`substrate.mcp.output`: `proc_output` collected from notifications (sans-IO)."""

from __future__ import annotations

import base64
from typing import Any

import msgspec

from substrate.mcp.output import OutputCollector


def piece(stream: str, offset: int, data: bytes, **extra: Any) -> dict[str, Any]:
    try:
        body: dict[str, Any] = {"data": data.decode()}
    except UnicodeDecodeError:
        body = {"data_b64": base64.b64encode(data).decode()}
    params = {"proc": "p", "stream": stream, "offset": offset, **body, **extra}
    return {"method": "proc.output", "params": params}


def test_each_stream_from_its_own_start_up_to_the_size_asked() -> None:
    c = OutputCollector("p", {"stdout": 4, "stderr": 0}, {"stdout": 10, "stderr": 3}, 100)
    assert c.subscribe_since == 0
    assert not c.feed(piece("stdout", 0, b"0123456"))  # bytes below 4 are dropped
    assert not c.feed(piece("other", 0, b"x"))
    assert not c.feed({"method": "proc.output", "params": {"proc": "q", "stream": "stdout"}})
    assert not c.feed(piece("stderr", 0, b"ab"))
    assert not c.feed(piece("stdout", 7, b"789"))
    assert c.feed(piece("stderr", 2, b"cdef"))  # past the size asked: kept to it
    out = c.result("running", 1 << 20)
    assert (out.stdout.offset, out.stdout.data, out.stdout.next) == (4, "456789", 10)
    assert (out.stderr.data, out.stderr.next) == ("abc", 3)
    assert out.more is False and out.state == "running"


def test_an_empty_stream_does_not_hold_the_other_back() -> None:
    c = OutputCollector("p", {"stdout": 6, "stderr": 0}, {"stdout": 9, "stderr": 0}, 100)
    assert c.subscribe_since == 6  # stderr wants nothing
    assert c.feed(piece("stdout", 6, b"xyz"))


def test_budget_and_a_character_cut_at_the_end() -> None:
    data = "aé" * 10  # 3 bytes each pair
    c = OutputCollector("p", {"stdout": 0, "stderr": 0}, {"stdout": 30, "stderr": 0}, 4)
    assert c.feed(piece("stdout", 0, data.encode()))
    out = c.result("exited", 1 << 20)
    # 4 bytes would end inside "é": the answer stops before it, `next` says where.
    assert out.stdout.data == "aéa" and out.stdout.next == 4
    c = OutputCollector("p", {"stdout": 0, "stderr": 0}, {"stdout": 30, "stderr": 0}, 5)
    assert c.feed(piece("stdout", 0, data.encode()))
    assert c.result("exited", 1 << 20).stdout.next == 4
    assert c.result("exited", 1 << 20).more is True


def test_a_skip_by_the_daemon_is_reported() -> None:
    c = OutputCollector("p", {"stdout": 0, "stderr": 0}, {"stdout": 100, "stderr": 0}, 10)
    assert not c.feed(piece("stdout", 80, b"abc", skipped_from=0))
    out = c.result("running", 1 << 20)
    assert (out.stdout.offset, out.stdout.skipped_from, out.stdout.data) == (80, 0, "abc")


def test_exit_ends_collection_and_the_answer_fits_its_limit() -> None:
    c = OutputCollector("p", {"stdout": 0, "stderr": 0}, {"stdout": 5000, "stderr": 0}, 5000)
    c.feed(piece("stdout", 0, b"\x01" * 5000))  # each byte escapes to 6 in JSON
    assert c.feed({"method": "proc.exit", "params": {"proc": "p"}})
    out = c.result("exited", 2000)
    assert len(msgspec.json.encode(out)) <= 2000
    assert out.stdout.next == len(out.stdout.data) and out.more is True
