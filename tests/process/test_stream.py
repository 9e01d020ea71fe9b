"""`substrate.process.stream` (sans-IO part): the engine's multiplexed exec stream."""

from __future__ import annotations

import struct

from substrate.process.stream import Demuxer


def frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxI", stream, len(payload)) + payload


def test_demuxer_splits_frames_across_any_chunking() -> None:
    stream = frame(1, b"hello ") + frame(2, b"oops") + frame(1, b"world") + frame(1, b"")
    expected = [(1, b"hello "), (2, b"oops"), (1, b"world")]
    for size in (1, 2, 3, 7, 8, 9, len(stream)):
        demux = Demuxer()
        got: list[tuple[int, bytes]] = []
        for i in range(0, len(stream), size):
            got.extend(demux.feed(stream[i : i + size]))
        merged: dict[int, bytes] = {}
        for sid, piece in got:
            merged[sid] = merged.get(sid, b"") + piece
        assert merged == {1: b"hello world", 2: b"oops"}, size
        assert not demux.mid_frame
    whole = Demuxer().feed(stream)
    assert [(s, p) for s, p in whole if p] == expected


def test_demuxer_notices_a_cut_frame() -> None:
    demux = Demuxer()
    demux.feed(frame(1, b"abcdef")[:-2])
    assert demux.mid_frame
