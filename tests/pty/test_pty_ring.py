"""The scrollback ring and UTF-8 cursors: bounded, seq = byte offset, no split characters."""

from __future__ import annotations

import pytest

from substrate.pty.ring import Cursor, Ring


def test_ring_keeps_newest_bytes() -> None:
    r = Ring(8)
    r.append(b"abcdef")
    assert (r.start, r.end) == (0, 6)
    r.append(b"ghij")
    assert (r.start, r.end) == (2, 10)
    assert r.read(2, 100) == b"cdefghij"
    assert r.read(5, 2) == b"fg"
    assert r.read(10, 5) == b""
    with pytest.raises(ValueError):
        r.read(1, 1)
    with pytest.raises(ValueError):
        r.read(11, 1)


def test_ring_append_larger_than_capacity() -> None:
    r = Ring(4)
    r.append(b"ab")
    r.append(b"0123456789")
    assert (r.start, r.end) == (8, 12)
    assert r.read(8, 10) == b"6789"


def test_ring_capacity_minimum() -> None:
    with pytest.raises(ValueError):
        Ring(3)


def test_tail_clamps() -> None:
    r = Ring(16)
    r.append(b"0123456789abcdefXYZ")
    assert r.start == 3
    assert r.tail(None, 4) == (15, b"fXYZ")
    assert r.tail(0, 100) == (3, b"3456789abcdefXYZ")
    assert r.tail(10, 100) == (10, b"abcdefXYZ")
    assert r.tail(10, 2) == (17, b"YZ")
    assert r.tail(999, 10) == (19, b"")


def _drain(c: Cursor, max_bytes: int = 1 << 20) -> tuple[str, list[int]]:
    out = []
    seqs = []
    while (chunk := c.pull(max_bytes)) is not None:
        assert not chunk.resync
        out.append(chunk.text)
        seqs.append(chunk.seq)
    return "".join(out), seqs


def test_multibyte_split_across_appends_is_never_split() -> None:
    r = Ring(1024)
    c = Cursor(r, 0)
    text = "h\u00e9\u20ac\U0001f600!"
    data = text.encode()
    got: list[str] = []
    for i in range(len(data)):
        r.append(data[i : i + 1])
        chunk = c.pull()
        assert chunk is not None
        got.append(chunk.text)
        # The seq never points into the middle of a character.
        assert data[: chunk.seq].decode() == "".join(got)
    assert "".join(got) == text
    assert c.seq == len(data)


def test_small_pulls_never_split() -> None:
    r = Ring(1024)
    text = "\u00e9" * 50 + "\U0001f600" * 20
    r.append(text.encode())
    c = Cursor(r, 0)
    out, seqs = _drain(c, max_bytes=3)
    assert out == text
    assert seqs[-1] == len(text.encode())


def test_invalid_bytes_become_replacement() -> None:
    r = Ring(64)
    r.append(b"a\xffb\xc3(c")
    c = Cursor(r, 0)
    out, _ = _drain(c)
    assert out == "a\ufffdb\ufffd(c"


def test_flush_emits_held_partial_character() -> None:
    r = Ring(64)
    r.append(b"ok\xe2\x82")
    c = Cursor(r, 0)
    chunk = c.pull()
    assert chunk is not None and (chunk.text, chunk.seq) == ("ok", 2)
    assert c.pull() is None
    final = c.flush()
    assert final is not None and (final.text, final.seq) == ("\ufffd", 4)


def test_resume_from_seq_repeats_nothing() -> None:
    r = Ring(1024)
    r.append("first \u00e9".encode())
    c = Cursor(r, 0)
    _, seqs = _drain(c)
    r.append(b" second")
    resumed = Cursor(r, seqs[-1])
    out, _ = _drain(resumed)
    assert out == " second"


def test_reader_that_falls_behind_gets_resync() -> None:
    r = Ring(8)
    c = Cursor(r, 0)
    r.append(b"0123456789")  # offsets 0-1 dropped; the resync point is 10 - 8 // 2
    chunk = c.pull()
    assert chunk is not None and chunk.resync and chunk.seq == 6
    out, seqs = _drain(c)
    assert out == "6789"
    assert seqs[-1] == 10


def test_resync_skips_a_cut_character() -> None:
    r = Ring(8)
    c = Cursor(r, 0)
    r.append(b"abcdefgh" + "\u20ac".encode() + b"xyz")  # the euro sign is at 8-10
    first = c.pull()
    assert first is not None and first.resync and first.seq == 10  # inside the euro
    out, seqs = _drain(c)
    assert out == "xyz"
    assert seqs[-1] == 14


def test_new_cursor_at_cut_ring_start_skips_tail_bytes() -> None:
    r = Ring(6)
    r.append(b"a" + "\u20ac".encode() + b"bcde")  # 8 bytes, start 2 is inside the euro sign
    c = Cursor(r, r.start)
    out, _ = _drain(c)
    assert out == "bcde"


def test_caught_up() -> None:
    r = Ring(16)
    c = Cursor(r, 0)
    assert c.caught_up
    r.append(b"x")
    assert not c.caught_up
    _drain(c)
    assert c.caught_up
