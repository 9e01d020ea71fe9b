"""`substrate mcp` driven by the MCP SDK's own client, as an MCP host would run it.

`open_mcp(daemon, *args)` spawns `python -m substrate mcp --state-dir <daemon's> *args`
with the SDK's stdio client (the worktree's `substrate` first on `PYTHONPATH`),
initializes a `ClientSession` and yields it; at the end the SDK closes the server's
stdin and reaps it. The server's stderr goes to `mcp.log` in the daemon's base dir.
`payload(result)` is a tool result's JSON text, decoded (a finished command's: its
structured content; its text reads as lines).
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

from tests.harness.daemon import PACKAGE_ROOT

if TYPE_CHECKING:
    from tests.harness.daemon import DaemonProcess


def mcp_argv(daemon: DaemonProcess, *args: str) -> list[str]:
    """The arguments after the interpreter: `-m substrate mcp --state-dir ... *args`."""
    return ["-m", "substrate", "mcp", "--state-dir", str(daemon.state_dir), *args]


@asynccontextmanager
async def open_mcp(daemon: DaemonProcess, *args: str) -> AsyncIterator[ClientSession]:
    """An initialized MCP session with a fresh `substrate mcp` for this daemon."""
    params = StdioServerParameters(
        command=sys.executable,
        args=mcp_argv(daemon, *args),
        env={"PYTHONPATH": str(PACKAGE_ROOT)},
        cwd=str(daemon.base),
    )
    # The SDK hands the file to the child as its stderr: a real file, opened off the loop.
    errlog = await trio.to_thread.run_sync(open, daemon.base / "mcp.log", "a")
    try:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session
    finally:
        errlog.close()


def payload(result: CallToolResult) -> Any:
    """The JSON a tool result carries as text (also its structured content); a finished
    command's text is lines a model reads, its JSON the structured content alone."""
    assert len(result.content) == 1, result
    block = result.content[0]
    assert isinstance(block, TextContent), block
    if block.text.startswith("exit code "):
        assert isinstance(result.structured_content, dict), result
        assert "exit_code" in result.structured_content
        return result.structured_content
    value = json.loads(block.text)
    assert value == result.structured_content
    return value


async def call_ok(session: ClientSession, tool: str, **arguments: Any) -> Any:
    """Call a tool that must succeed; its payload."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, payload(result)
    return payload(result)


async def call_refused(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    """Call a tool that must come back as a tool error; its `{refusal, ..., data}`."""
    result = await session.call_tool(tool, arguments)
    assert result.is_error, payload(result)
    value: dict[str, Any] = payload(result)
    return value
