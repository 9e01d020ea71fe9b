"""A terminal client connection (for `substrate attach`, tests and benchmarks).

`open_terminal(url)` yields a trio-websocket connection to `/pty` carrying the daemon's own
`Origin` (derived from the URL: the server refuses upgrades without an allowed Origin),
and makes sure the TCP stream is closed on exit, which trio-websocket 0.12's client leaves
open when the server ends the connection first.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import trio
from trio_websocket import WebSocketConnection, open_websocket_url

DEFAULT_URL = "ws://127.0.0.1:7681/pty"


def origin_of(url: str) -> str:
    """The http(s) origin that belongs to a ws(s) URL: ws://h:p/pty → http://h:p."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return f"{scheme}://{parts.netloc}"


def normalize_url(url: str) -> str:
    """Accept http://host:port[/] or ws://host:port[/pty]; return the ws URL of `/pty`."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"not a terminal URL: {url!r}")
    return f"{scheme}://{parts.netloc}/pty"


@contextlib.asynccontextmanager
async def open_terminal(
    url: str = DEFAULT_URL, *, origin: str | None = None
) -> AsyncIterator[WebSocketConnection]:
    """Connect to a terminal endpoint; refuses (raises) like trio-websocket does."""
    url = normalize_url(url)
    async with open_websocket_url(
        url,
        extra_headers=[(b"Origin", (origin or origin_of(url)).encode())],
        max_message_size=16 << 20,
    ) as ws:
        try:
            yield ws
        finally:
            with trio.CancelScope(shield=True):
                await ws._stream.aclose()
