"""A person's browser on a real sandbox shell: headless Chromium loads the daemon's page,
opens a session with a grant token from the URL fragment, types, and sees the shell's
output — the shell running as the workspace owner in the verified sandbox."""

from __future__ import annotations

from typing import Any

# The daemon fixtures are test_terminal's (imported so pytest finds them here).
from test_terminal import Env, dirs, env, leftovers  # noqa: F401

from tests.harness.cdp_browser import open_browser

SCREEN = "document.querySelector('.xterm-rows').innerText"


async def test_browser_shell_in_the_sandbox(env: Env) -> None:  # noqa: F811 (fixture)
    token = await env.grant()
    port = env.daemon.terminals.http.port
    async with open_browser() as browser:
        await browser.call("Page.navigate", url=f"http://127.0.0.1:{port}/#token={token}")
        await browser.wait_js("document.body.dataset.state === 'open'")
        await browser.wait_js(f"{SCREEN}.includes('$')")
        await browser.type_line("echo browser-$((40+2)) $(id -u) $PWD")
        screen: Any = await browser.wait_js(
            f"(() => {{ const t = {SCREEN}; return t.includes('browser-42 1000') ? t : ''; }})()"
        )
        assert "browser-42 1000 /workspace" in screen
        await browser.type_line("exit 3")
        await browser.wait_js("document.body.dataset.state === 'exited'")
        assert "code 3" in await browser.js("document.getElementById('status').textContent")
