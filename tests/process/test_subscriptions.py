"""Pure parts of `substrate.process.subscriptions` and one pump over fixed sources (no Docker)."""

from __future__ import annotations

import base64
from typing import Any

from substrate.process import subscriptions
from substrate.process.subscriptions import (
    LAG_BYTES,
    PIECE_BYTES,
    Feed,
    FixedSource,
    complete_prefix,
    encode_piece,
    plan_read,
    pump,
)


def test_complete_prefix_never_splits_a_character() -> None:
    text = "aé€😀".encode()
    assert complete_prefix(text) == len(text)
    assert complete_prefix(text[:-1]) == len(text) - 4
    assert complete_prefix(text[:-3]) == len(text) - 4
    assert complete_prefix("a€".encode()[:-1]) == 1
    assert complete_prefix(b"\xff\xfe") == 2  # invalid bytes go out as base64
    assert complete_prefix(b"") == 0


def test_encode_piece_text_or_base64() -> None:
    assert encode_piece("p", "stdout", 3, b"hi\n", None).data == "hi\n"
    binary = encode_piece("p", "stderr", 0, b"\xff\x00", 7)
    assert binary.data is None and base64.b64decode(binary.data_b64 or "") == b"\xff\x00"
    assert binary.skipped_from == 7 and binary.stream == "stderr"


def test_plan_read_coalesces_and_skips_when_far_behind() -> None:
    assert plan_read(10, 10) is None
    plan = plan_read(0, 100)
    assert plan is not None and (plan.offset, plan.length, plan.skipped_from) == (0, 100, None)
    plan = plan_read(0, PIECE_BYTES * 3)
    assert plan is not None and plan.length == PIECE_BYTES and plan.skipped_from is None
    far = LAG_BYTES + PIECE_BYTES * 2
    plan = plan_read(5, far)
    assert plan is not None
    assert (plan.offset, plan.length, plan.skipped_from) == (far - PIECE_BYTES, PIECE_BYTES, 5)


async def test_pump_replays_from_since_then_exits() -> None:
    out = bytes(range(256)) * 1000 + "é".encode()
    err = b"warning\n"
    sent: list[tuple[str, Any]] = []

    async def notify(method: str, params: Any) -> None:
        sent.append((method, params))

    async def never(wait_s: float) -> None:
        raise AssertionError("a finished feed never waits")

    feed = Feed(
        proc="p_1",
        sources={
            "stdout": FixedSource(len(out), data=out),
            "stderr": FixedSource(len(err), data=err),
        },
        ended=lambda: True,
        changed=never,
        result=lambda: {"proc": "p_1", "exit_code": 0},
    )
    await pump(feed, 3, notify)
    assert sent[-1] == ("proc.exit", {"proc": "p_1", "exit_code": 0})
    got = {"stdout": b"", "stderr": b""}
    for method, notice in sent[:-1]:
        assert method == "proc.output"
        piece = (
            notice.data.encode() if notice.data is not None else base64.b64decode(notice.data_b64)
        )
        assert notice.offset == 3 + len(got[notice.stream])
        assert len(piece) <= subscriptions.PIECE_BYTES
        got[notice.stream] += piece
    assert got == {"stdout": out[3:], "stderr": err[3:]}
