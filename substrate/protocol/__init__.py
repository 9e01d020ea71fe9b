"""The wire protocol: JSON-RPC 2.0 over newline-delimited JSON on Unix sockets (docs/protocol.md §1).

`rpc` decodes and encodes messages (sans-IO), `connection` holds a connection's rules
(deadlines, caps; sans-IO), `server` is the Trio socket loop around them, `client` the
client library, `stream_json` joins an agent CLI's stream-json output from `proc.output`
pieces (sans-IO), `proc_text` renders a finished command's result as text for the CLI
and MCP (pure). The server knows no handlers: the daemon gives it a `Backend`.
"""

from __future__ import annotations

from substrate.protocol.caller import Actor, Caller
from substrate.protocol.client import AsyncClient, Client, ConnectionLost, RpcError, open_client
from substrate.protocol.connection import Admission, ConnectionState, call_refusal
from substrate.protocol.rpc import Call, LineSplitter, Outcome, decode_call, refusal_error
from substrate.protocol.server import Backend, Dispatcher, Recorder, bind_unix, serve_socket
from substrate.protocol.stream_json import StreamJsonReader, StreamLine

__all__ = [
    "Actor",
    "Admission",
    "AsyncClient",
    "Backend",
    "Call",
    "Caller",
    "Client",
    "ConnectionLost",
    "ConnectionState",
    "Dispatcher",
    "LineSplitter",
    "Outcome",
    "Recorder",
    "RpcError",
    "StreamJsonReader",
    "StreamLine",
    "bind_unix",
    "call_refusal",
    "decode_call",
    "open_client",
    "refusal_error",
    "serve_socket",
]
