"""The terminal frame codec: client frames validated strictly, server frames encoded."""

from __future__ import annotations

import json

import pytest

from substrate.pty import frames
from substrate.pty.frames import (
    MAX_FRAME_BYTES,
    Close,
    FrameRefused,
    Input,
    Open,
    Resize,
    decode_client_frame,
    decode_first_frame,
)


def test_open_defaults() -> None:
    f = decode_first_frame('{"type":"open","token":"t"}')
    assert f == Open(token="t", cols=80, rows=24, mode="control")


def test_open_full() -> None:
    f = decode_first_frame(
        json.dumps(
            {
                "type": "open",
                "token": "t",
                "cols": 120,
                "rows": 40,
                "mode": "observe",
                "session": "t-0123456789abcdef",
                "since": 17,
            }
        )
    )
    assert isinstance(f, Open)
    assert (f.cols, f.rows, f.mode, f.session, f.since) == (
        120,
        40,
        "observe",
        "t-0123456789abcdef",
        17,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"type":"input","data":"ls\\r"}', Input(data="ls\r")),
        ('{"type":"resize","cols":100,"rows":30}', Resize(cols=100, rows=30)),
        ('{"type":"close"}', Close()),
    ],
)
def test_other_frames(text: str, expected: object) -> None:
    assert decode_client_frame(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"type":"nope"}',
        '{"data":"x"}',
        '{"type":"input","data":"x","extra":1}',
        '{"type":"resize","cols":0,"rows":24}',
        '{"type":"resize","cols":80,"rows":100000}',
        '{"type":"open","token":""}',
        '{"type":"open","token":"t","mode":"admin"}',
        '{"type":"open","token":"t","since":-1}',
        '{"type":"open","token":"t","session":"../x"}',
        # Deep nesting would exhaust the decoder's recursion: refused before parsing.
        # The tag comes last, so the decoder must skip a deep value to find it.
        pytest.param('{"x":' + "[" * 3000 + "]" * 3000 + ',"type":"input","data":"x"}', id="deep"),
        pytest.param('{"data":' + "[" * 3000 + "]" * 3000 + ',"type":"input"}', id="deep-data"),
    ],
)
def test_bad_frames_are_4400(text: str) -> None:
    with pytest.raises(FrameRefused) as info:
        decode_client_frame(text)
    assert (info.value.refusal, info.value.code) == ("invalid_params", frames.CLOSE_BAD_FRAME)


def test_binary_is_refused() -> None:
    with pytest.raises(FrameRefused) as info:
        decode_client_frame(b'{"type":"close"}')
    assert info.value.code == frames.CLOSE_BAD_FRAME


def test_first_frame_must_be_open() -> None:
    with pytest.raises(FrameRefused) as info:
        decode_first_frame('{"type":"input","data":"x"}')
    assert info.value.code == frames.CLOSE_BAD_FRAME
    assert "first frame" in info.value.message


def test_oversize_frame_is_4413() -> None:
    big = json.dumps({"type": "input", "data": "x" * MAX_FRAME_BYTES})
    with pytest.raises(FrameRefused) as info:
        decode_client_frame(big)
    assert (info.value.refusal, info.value.code) == ("too_large", frames.CLOSE_TOO_LARGE)


def test_frame_at_the_cap_is_accepted() -> None:
    overhead = len('{"type":"input","data":""}')
    text = '{"type":"input","data":"' + "y" * (MAX_FRAME_BYTES - overhead) + '"}'
    assert len(text.encode()) == MAX_FRAME_BYTES
    assert decode_client_frame(text) == Input(data="y" * (MAX_FRAME_BYTES - overhead))


def test_server_frames_round_trip() -> None:
    for f in [
        frames.Opened(session="t-0123456789abcdef", mode="control", seq=0),
        frames.Output(seq=5, data="h\u00e9\x1b[0m"),
        frames.Exit(code=3),
        frames.Resync(seq=9),
        frames.Error(refusal="controller_busy", message="busy"),
    ]:
        text = frames.encode(f)
        assert json.loads(text)["type"] in {"opened", "output", "exit", "resync", "error"}
        assert frames.decode_server_frame(text) == f


def test_client_encoder_round_trips() -> None:
    f = Open(token="abc", cols=10, rows=5, mode="observe", since=3)
    assert decode_client_frame(frames.encode_client(f)) == f


def test_close_codes() -> None:
    assert frames.close_code_for("grant_expired") == frames.CLOSE_GRANT
    assert frames.close_code_for("controller_busy") == frames.CLOSE_BUSY
    assert frames.close_code_for("unauthorized") == frames.CLOSE_FORBIDDEN
    assert frames.close_code_for("confinement_unmet") == frames.CLOSE_FAILED
    assert frames.FrameRefused("too_large", "m", 4413).frame() == frames.Error(
        refusal="too_large", message="m"
    )
