"""`substrate mcp`: the daemon's agent methods as MCP tools, over stdio (docs/mcp.md).

`tools` is the tool table and the input schemas generated from the Structs (pure),
`bounds` cuts results to the size limit (pure), `output` collects `proc_output` from
`proc.subscribe` (sans-IO), `resources` names artifacts as `substrate://artifact/<id>`
(pure), and `server` is the edge: the MCP SDK's stdio server and the daemon connection.
"""

from __future__ import annotations

from substrate.mcp.server import Options, StartupFailed, run, serve
from substrate.mcp.tools import BY_NAME, TOOLS, Tool

__all__ = ["BY_NAME", "TOOLS", "Options", "StartupFailed", "Tool", "run", "serve"]
