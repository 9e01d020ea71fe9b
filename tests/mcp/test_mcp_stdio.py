"""`substrate.mcp.stdio`: each line from the MCP host decided before the SDK sees it.

Pure: no pipes (the same over real pipes: tests/mcp/test_mcp.py, "malformed ... lines").
"""

from __future__ import annotations

import mcp.types as types
import pytest
from mcp.shared.message import SessionMessage

from substrate.mcp.stdio import Lines, decide


def error_of(line: bytes) -> tuple[int | str | None, int]:
    decided = decide(line)
    assert isinstance(decided, types.JSONRPCError), decided
    return decided.id, decided.error.code


def test_a_message_goes_on_to_the_session() -> None:
    decided = decide(b'{"jsonrpc": "2.0", "id": 7, "method": "tools/list"}')
    assert isinstance(decided, SessionMessage)
    assert isinstance(decided.message, types.JSONRPCRequest) and decided.message.id == 7


@pytest.mark.parametrize(
    "line",
    [
        b'{"jsonrpc": "2.0", "id": 1, "method": ',
        b"\xff\xfe",
        b"not json",
        b'{"jsonrpc": "2.0", "id": 1, "params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"id": 9, "x": ' + b"{" * 65 + b"}" * 65 + b"}",
    ],
)
def test_what_is_not_json_or_nests_too_deep_is_a_parse_error_with_a_null_id(line: bytes) -> None:
    assert error_of(line) == (None, -32700)


@pytest.mark.parametrize(
    ("line", "request_id"),
    [
        (b'{"jsonrpc": "2.0", "id": 3}', 3),
        (b'{"jsonrpc": "1.0", "id": "a", "method": "ping"}', "a"),
        (b"[1, 2]", None),
        (b'{"id": true, "method": 5}', None),
    ],
)
def test_json_that_is_no_message_is_an_invalid_request(
    line: bytes, request_id: int | str | None
) -> None:
    assert error_of(line) == (request_id, -32600)


def test_lines_are_split_and_a_long_one_skipped_to_its_newline() -> None:
    lines = Lines(limit=8)
    assert lines.feed(b"abc\n\n  de") == [b"abc"]
    assert lines.feed(b"f\n0123456") == [b"def"]
    assert lines.feed(b"789") == [None]  # past the limit: reported once, never buffered
    assert lines.feed(b"more and more") == []
    assert lines.feed(b"end\nok\nlast") == [b"ok"]
    assert lines.finish() == [b"last"]
