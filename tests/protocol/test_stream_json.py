"""`substrate.protocol.stream_json`: an agent CLI's stream-json joined from `proc.output`
pieces (sans-IO; the real CLI flow is tests/integration/test_agent_turn_engine.py)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from substrate.protocol.stream_json import (
    StreamJsonReader,
    StreamLine,
    decode_line,
    result_event,
    session_id,
)

EVENTS: list[dict[str, Any]] = [
    {"type": "system", "subtype": "init", "session_id": "s-1", "cwd": "/workspace"},
    {"type": "assistant", "message": {"content": [{"type": "text", "text": "héllo ✓"}]}},
    {"type": "result", "subtype": "success", "is_error": False, "session_id": "s-2"},
]
STREAM = b"".join(json.dumps(e, ensure_ascii=False).encode() + b"\n" for e in EVENTS)


def events(lines: list[StreamLine]) -> list[dict[str, Any] | None]:
    return [line.event for line in lines]


def test_every_split_of_the_stream_gives_the_same_lines() -> None:
    whole = StreamJsonReader().feed(STREAM)
    assert events(whole) == EVENTS
    assert [line.offset for line in whole] == [0, STREAM.index(b"\n") + 1, whole[2].offset]
    assert all(STREAM[line.offset + line.size] == ord("\n") for line in whole)
    for cut in range(len(STREAM) + 1):
        reader = StreamJsonReader()
        got = reader.feed(STREAM[:cut]) + reader.feed(STREAM[cut:]) + reader.finish()
        assert got == whole, cut
        assert reader.offset == len(STREAM)


def test_byte_by_byte_with_explicit_offsets() -> None:
    reader = StreamJsonReader()
    got: list[StreamLine] = []
    for i in range(len(STREAM)):
        got += reader.feed(STREAM[i : i + 1], i)
    assert events(got) == EVENTS


def test_crlf_blank_lines_and_a_last_line_without_newline() -> None:
    reader = StreamJsonReader()
    lines = reader.feed(b'{"a":1}\r\n\n   \n{"b":2}')
    assert events(lines) == [{"a": 1}]
    last = reader.finish()
    assert events(last) == [{"b": 2}] and last[0].offset == 14 and last[0].size == 7
    assert reader.finish() == []


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json", "not_json"),
        (b"[1, 2]", "not_object"),
        (b'"text"', "not_object"),
        (b'{"a": "\xff"}', "not_json"),  # not UTF-8
        (b"[" * 100_000 + b"]" * 100_000, "not_json"),  # deeper than the decoder goes
    ],
)
def test_lines_that_are_not_events_say_why(line: bytes, error: str) -> None:
    reader = StreamJsonReader()
    (got, ok) = reader.feed(line + b'\n{"ok":1}\n')
    assert got == StreamLine(offset=0, size=len(line), error=error)  # type: ignore[arg-type]
    assert ok.event == {"ok": 1} and ok.offset == len(line) + 1
    assert decode_line(line).error == error


def test_a_line_past_the_bound_is_reported_once_and_never_held() -> None:
    reader = StreamJsonReader(max_line_bytes=1024)
    big = b'{"x":"' + b"a" * 5000 + b'"}'
    lines: list[StreamLine] = []
    for i in range(0, len(big), 700):  # in pieces, as the daemon sends it
        lines += reader.feed(big[i : i + 700])
        assert len(reader._buf) <= 1024  # the bound holds while the line grows
    lines += reader.feed(b'\n{"after":1}\n')
    assert lines == [
        StreamLine(offset=0, size=len(big), error="too_long"),
        StreamLine(offset=len(big) + 1, size=11, event={"after": 1}),
    ]
    exact = StreamJsonReader(max_line_bytes=9).feed(b'{"a":123}\n')
    assert events(exact) == [{"a": 123}]
    with pytest.raises(ValueError):
        StreamJsonReader(max_line_bytes=0)


def piece(offset: int, data: bytes, **extra: Any) -> dict[str, Any]:
    """A `proc.output` notification's params, as the daemon sends them."""
    params: dict[str, Any] = {"proc": "p_1", "stream": "stdout", "offset": offset, **extra}
    try:
        params["data"] = data.decode("utf-8")
    except UnicodeDecodeError:
        params["data_b64"] = base64.b64encode(data).decode()
    return params


def test_output_notifications_text_and_base64() -> None:
    reader = StreamJsonReader()
    cut = STREAM.index("✓".encode()) + 1  # inside the character: base64, like the daemon
    first, second = STREAM[:cut], STREAM[cut:]
    assert "data_b64" in piece(0, first)
    lines = reader.feed_output(piece(0, first)) + reader.feed_output(piece(cut, second))
    assert events(lines) == EVENTS


def test_a_hole_drops_the_cut_line_and_the_rest_up_to_the_next_newline() -> None:
    reader = StreamJsonReader()
    one = b'{"n":1}\n{"n":2,"cut'
    lines = reader.feed_output(piece(0, one))
    # Bytes [len(one), 100) never came (the subscriber fell behind: skipped_from).
    lines += reader.feed_output(piece(100, b'tail"}\n{"n":3}\n', skipped_from=len(one)))
    assert lines == [
        StreamLine(offset=0, size=7, event={"n": 1}),
        StreamLine(offset=8, size=len(one) - 8, error="gap"),
        StreamLine(offset=107, size=7, event={"n": 3}),
    ]


def test_a_hole_at_a_line_boundary_still_drops_the_partial_line_after_it() -> None:
    reader = StreamJsonReader()
    lines = reader.feed(b'{"n":1}\n')
    lines += reader.feed(b'rest of a lost line"}\n{"n":2}\n', 50)
    assert lines == [
        StreamLine(offset=0, size=7, event={"n": 1}),
        StreamLine(offset=8, size=0, error="gap"),
        StreamLine(offset=72, size=7, event={"n": 2}),
    ]


def test_holes_before_the_end_are_reported_once() -> None:
    reader = StreamJsonReader()
    lines = reader.feed(b'{"partial"')
    lines += reader.feed(b"", 40)  # the empty piece before proc.exit, skipped_from set
    lines += reader.feed(b"", 60)
    lines += reader.finish()
    assert lines == [StreamLine(offset=0, size=10, error="gap")]


def test_an_older_since_does_not_repeat_lines() -> None:
    reader = StreamJsonReader()
    first = reader.feed(STREAM[:40])
    again = reader.feed(STREAM, 0)  # resubscribed with since=0: the first 40 bytes again
    assert events(first + again) == EVENTS
    assert reader.feed(STREAM[:10], 0) == []


def test_since_starts_the_reader_at_that_offset() -> None:
    reader = StreamJsonReader(since=1000)
    assert events(reader.feed(b'{"a":1}\n', 1000)) == [{"a": 1}]
    assert reader.offset == 1008


@pytest.mark.parametrize(
    "params",
    [
        {"offset": 0, "data_b64": "!!not base64!!"},
        {"data": "x"},
        {"offset": -1, "data": "x"},
        {"offset": 0, "data": 5},
    ],
)
def test_an_unreadable_piece_is_reported_and_treated_as_a_hole(params: dict[str, Any]) -> None:
    reader = StreamJsonReader()
    lines = reader.feed(b'{"a":')
    lines += reader.feed_output(params)
    assert [line.error for line in lines] == ["gap", "bad_piece"]
    # Whatever follows up to the next newline is dropped: its line's start is unknown.
    assert events(reader.feed(b'1}\n{"b":2}\n')) == [{"b": 2}]


def test_session_id_and_result_event() -> None:
    lines = StreamJsonReader().feed(STREAM + b"junk\n")
    assert session_id(lines) == "s-2"
    assert result_event(lines) == EVENTS[2]
    assert session_id([]) is None and result_event(lines[:2]) is None
