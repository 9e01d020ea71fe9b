"""Client-side helpers for the JSON WebSocket PTY protocol, shared by the terminal tests."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection


async def recv(ws: WebSocketConnection, within_s: float = 20.0) -> dict[str, Any]:
    with trio.fail_after(within_s):
        frame: dict[str, Any] = json.loads(await ws.get_message())
    return frame


async def until_closed(ws: WebSocketConnection) -> None:
    """Read until the server closes (so it has acted on what we sent)."""
    with trio.fail_after(10), contextlib.suppress(ConnectionClosed):
        while True:
            await ws.get_message()


async def send(ws: WebSocketConnection, **frame: Any) -> None:
    await ws.send_message(json.dumps(frame))


async def read_until(
    ws: WebSocketConnection, needle: str, *, allow_resync: bool = False
) -> tuple[str, int]:
    """Collect output until `needle` appears; return (text, last seq).

    With `allow_resync`, a `resync` frame restarts the collected text (the screen reset).
    """
    text, seq = "", -1
    while needle not in text:
        f = await recv(ws)
        if allow_resync and f["type"] == "resync":
            text = ""
            continue
        assert f["type"] == "output", f
        text += f["data"]
        seq = f["seq"]
    return text, seq
