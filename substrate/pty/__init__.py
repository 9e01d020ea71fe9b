"""Terminals for people (docs/protocol.md §7): grant-gated JSON WebSocket PTY sessions.

Pure cores: `frames` (the wire protocol and close codes), `ring` (bounded scrollback,
UTF-8 cursors), `session` (who may attach, type, resize; when it ends). Edges: `terminals`
(sessions of a daemon run), `connection` (one WebSocket client), `http` (the page and the
upgrade), `docker` (the TTY exec in the workspace's confined container), `backend` (the
process interface and an in-memory fake).
"""

from substrate.pty.grants import Grant, Grants, parse_duration
from substrate.pty.service import TerminalService
from substrate.pty.terminals import Terminals

__all__ = ["Grant", "Grants", "TerminalService", "Terminals", "parse_duration"]
