"""The terminal page in a real browser: headless Chromium (Debian's `chromium`) driven
over the DevTools protocol loads the page from the daemon, opens a session with the
token from the URL fragment, types a command and sees its output (fake PTY)."""

from __future__ import annotations

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

from substrate.grants import Grants
from substrate.journal import Journal
from substrate.pty.backend import FakePtys
from substrate.pty.http import TerminalHttp
from substrate.pty.terminals import Terminals
from substrate.store import Store

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


@pytest.fixture
async def browser() -> AsyncIterator[Cdp]:
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
        with trio.fail_after(30):
            # Chromium reports its port only in this file: poll it.
            while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:  # noqa: ASYNC110
                await trio.sleep(0.05)
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
            yield cdp
            cdp.session = None
            await cdp.call("Browser.close")
            await ws._stream.aclose()
    finally:
        proc.kill()
        await proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[int, str, FakePtys]]:
    store = Store(tmp_path / "db")
    journal = Journal(store)
    grants = Grants(store, journal)
    ptys = FakePtys()
    terminals = Terminals(grants=grants, journal=journal, spawner=ptys)
    http = TerminalHttp(terminals)
    _, token = grants.issue(workspace="w", profile="interactive", ttl_s=600, uses=1, actor="t")
    async with trio.open_nursery() as nursery:
        await nursery.start(terminals.run)
        port = await nursery.start(http.serve, "127.0.0.1:0")
        yield port, token, ptys
        nursery.cancel_scope.cancel()
    store.close()


async def wait_js(cdp: Cdp, expression: str) -> Any:
    """Poll a page expression until it is truthy (20 s at most)."""
    with trio.fail_after(20):
        while not (value := await cdp.js(expression)):  # noqa: ASYNC110
            await trio.sleep(0.1)
    return value


async def test_browser_types_a_command_and_sees_output(
    browser: Cdp, server: tuple[int, str, FakePtys]
) -> None:
    port, token, ptys = server
    await browser.call("Page.navigate", url=f"http://127.0.0.1:{port}/#token={token}")
    await wait_js(browser, "document.body.dataset.state === 'open'")
    # The token left the address bar as soon as the page read it.
    assert "token" not in await browser.js("location.href")
    await wait_js(browser, "document.querySelector('.xterm-rows').innerText.includes('$')")
    await browser.call("Input.insertText", text="echo from-the-browser")
    await browser.call(
        "Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter",
        windowsVirtualKeyCode=13, text="\r",
    )  # fmt: skip
    screen = await wait_js(
        browser,
        "(() => { const t = document.querySelector('.xterm-rows').innerText;"
        " return t.split('from-the-browser').length >= 3 ? t : ''; })()",
    )
    lines = [line.strip() for line in screen.splitlines()]
    assert "from-the-browser" in lines  # the output line, not only the echoed input
    assert len(ptys.spawned) == 1
