"""Headless Chromium over the DevTools protocol, for the terminal page tests.

`open_browser()` starts Debian's `chromium` (skips when it is not installed: `apt-get
install chromium`) on a private profile and yields a `Cdp` client attached to one page;
it kills the browser and removes the profile afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from tests.harness.waiting import wait_until_async

CHROMIUM = shutil.which("chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
]


class Cdp:
    """A minimal DevTools protocol client on one page session."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.session: str | None = None

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if self.session is not None:
            msg["sessionId"] = self.session
        await self.ws.send_message(json.dumps(msg))
        while True:
            reply = json.loads(await self.ws.get_message())
            if reply.get("id") == msg_id:
                assert "error" not in reply, reply
                result: dict[str, Any] = reply["result"]
                return result

    async def js(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_js(self, expression: str) -> Any:
        """Poll a page expression until it is truthy (30 s at most); return its value."""
        return await wait_until_async(
            lambda: self.js(expression), 30, interval=0.1, message=f"never true: {expression}"
        )

    async def type_line(self, text: str) -> None:
        """Type into the focused element key by key (as a person does), then Enter."""
        for ch in text:
            await self.call("Input.dispatchKeyEvent", type="keyDown", key=ch, text=ch)
            await self.call("Input.dispatchKeyEvent", type="keyUp", key=ch)
        await self.call(
            "Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter",
            windowsVirtualKeyCode=13, text="\r",
        )  # fmt: skip
        await self.call("Input.dispatchKeyEvent", type="keyUp", key="Enter", code="Enter")


@contextlib.asynccontextmanager
async def open_browser() -> AsyncIterator[Cdp]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    profile = Path(tempfile.mkdtemp(prefix="sbst-chromium-"))
    proc = await trio.lowlevel.open_process(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        # Chromium reports its port only in this file: poll it.
        await wait_until_async(
            lambda: port_file.exists() and len(port_file.read_text().splitlines()) >= 2,
            30,
            interval=0.05,
            message="chromium never wrote its DevTools port",
        )
        port, path = port_file.read_text().splitlines()[:2]
        async with open_websocket_url(
            f"ws://127.0.0.1:{port}{path}", max_message_size=64 << 20
        ) as ws:
            cdp = Cdp(ws)
            target = await cdp.call("Target.createTarget", url="about:blank")
            attached = await cdp.call(
                "Target.attachToTarget", targetId=target["targetId"], flatten=True
            )
            cdp.session = attached["sessionId"]
            try:
                yield cdp
            finally:
                cdp.session = None
                with trio.move_on_after(5), contextlib.suppress(Exception):
                    await cdp.call("Browser.close")
                await ws._stream.aclose()
    finally:
        proc.kill()
        await proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
