"""`substrate exec`'s pure parts: output pieces printed once each, in order, with the
holes named; the exit code of a result."""

from __future__ import annotations

import base64

from substrate.cli.exec import OutputTracker, exit_code_of


def piece(stream: str, offset: int, data: bytes, **kw: object) -> dict[str, object]:
    try:
        return {"stream": stream, "offset": offset, "data": data.decode(), **kw}
    except UnicodeDecodeError:
        return {
            "stream": stream,
            "offset": offset,
            "data_b64": base64.b64encode(data).decode(),
            **kw,
        }


def test_pieces_print_once_each_per_stream() -> None:
    t = OutputTracker()
    assert t.feed(piece("stdout", 0, b"one\n")) == ("stdout", b"one\n", None)
    assert t.feed(piece("stderr", 0, b"\xff\xfe")) == ("stderr", b"\xff\xfe", None)
    # A replayed piece that overlaps what was printed: only the new part.
    assert t.feed(piece("stdout", 2, b"e\ntwo\n")) == ("stdout", b"two\n", None)
    assert t.feed(piece("stdout", 0, b"one\n")) == ("stdout", b"", None)
    assert t.pos == {"stdout": 8, "stderr": 2}


def test_a_skip_is_named_and_printing_goes_on_after_it() -> None:
    t = OutputTracker()
    t.feed(piece("stdout", 0, b"a"))
    stream, data, note = t.feed(piece("stdout", 100, b"z", skipped_from=1))
    assert (stream, data) == ("stdout", b"z")
    assert note is not None and "1..100" in note and "artifact" in note
    assert t.pos["stdout"] == 101
    _, _, gap = t.feed(piece("stdout", 200, b"!"))
    assert gap is not None and "101..200" in gap


def test_the_exit_code_is_the_commands_or_128_plus_the_signal() -> None:
    assert exit_code_of({"exit_code": 7}) == 7
    assert exit_code_of({"exit_code": 130, "signal": "INT"}) == 130
    assert exit_code_of({"exit_code": None, "signal": "TERM"}) == 143
    assert exit_code_of({"proc": "p_1", "state": "lost"}) == 137
