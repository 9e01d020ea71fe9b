"""The terminal page in a real browser: headless Chromium (Debian's `chromium`) driven
over the DevTools protocol loads the page from the daemon, opens a session with the
token from the URL fragment, types a command and sees its output (fake PTY)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from substrate.pty.backend import FakePtys
from substrate.pty.grants import Grants
from substrate.pty.http import TerminalHttp
from substrate.pty.terminals import Terminals
from substrate.store.db import Store
from substrate.store.journal import Journal
from tests.harness.cdp_browser import Cdp, open_browser

SCREEN = "document.querySelector('.xterm-rows').innerText"


@pytest.fixture
async def browser() -> AsyncIterator[Cdp]:
    async with open_browser() as cdp:
        yield cdp


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


async def test_browser_types_a_command_and_sees_output(
    browser: Cdp, server: tuple[int, str, FakePtys]
) -> None:
    port, token, ptys = server
    await browser.call("Page.navigate", url=f"http://127.0.0.1:{port}/#token={token}")
    await browser.wait_js("document.body.dataset.state === 'open'")
    # The token left the address bar as soon as the page read it.
    assert "token" not in await browser.js("location.href")
    await browser.wait_js(f"{SCREEN}.includes('$')")
    await browser.type_line("echo from-the-browser")
    screen = await browser.wait_js(
        f"(() => {{ const t = {SCREEN}; return t.split('from-the-browser').length >= 3 ? t : ''; }})()"
    )
    lines = [line.strip() for line in screen.splitlines()]
    assert "from-the-browser" in lines  # the output line, not only the echoed input
    assert len(ptys.spawned) == 1
