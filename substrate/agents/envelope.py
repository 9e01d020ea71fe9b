"""One envelope vocabulary for every agent CLI's stream (docs/agent-provider.md "Envelopes").

A provider's parser turns the CLI's own JSON lines into `Envelope`s of six kinds:
`session` (the CLI's session id, for `--resume`), `text` (what the model said),
`tool_call` (a tool the CLI ran or is running: its name, the workspace paths it names,
its input), `tool_result` (whether it succeeded), `usage` (token counts) and `error`
(with a `reason`: the CLI's, or one of ours — `malformed_line`, `line_too_long`,
`bad_session_id`, `exited_mid_stream`, `timed_out`). Envelopes go to the client that runs
the turn; the journal keeps only tool names, paths and counts (`TurnAudit`).

`LineSplitter` cuts the byte stream into lines with a bounded buffer: a line longer than
`MAX_LINE_BYTES` becomes one `line_too_long` error and is skipped to its end, never held.
Pure: no I/O.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from typing import Any, Literal

import msgspec

EnvelopeKind = Literal["session", "text", "tool_call", "tool_result", "usage", "error"]

#: The longest line of a CLI's stream that is parsed; a longer one is an error envelope.
MAX_LINE_BYTES = 1 << 20
#: The longest text an envelope carries (a model's reply is cut there and says so).
MAX_TEXT_CHARS = 256 << 10
#: Workspace paths named per tool call, at most.
MAX_PATHS_PER_TOOL = 64
#: A session id is a CLI's own token: letters, digits, `-` and `_`, nothing a path could use.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
#: The checkout inside a sandbox (docs/protocol.md §5).
WORKSPACE = "/workspace"


class Envelope(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    kind: EnvelopeKind
    #: `text`: the model's words; `error`: the CLI's message, if it gave one.
    text: str | None = None
    #: `tool_call` / `tool_result`: the tool's name as the CLI calls it, and its call id.
    tool: str | None = None
    call_id: str | None = None
    #: `tool_call`: workspace-relative paths the call names (files it reads or writes).
    paths: tuple[str, ...] = ()
    #: `tool_call`: the tool's input as the CLI reported it (for the client, never journaled).
    input: dict[str, Any] | None = None
    #: `tool_result`: False when the tool failed.
    ok: bool | None = None
    #: `session`: the CLI's session id.
    session: str | None = None
    #: `usage`: token counts.
    input_tokens: int | None = None
    output_tokens: int | None = None
    #: `error`: why (see the module doc).
    reason: str | None = None


def error(reason: str, text: str | None = None) -> Envelope:
    return Envelope(kind="error", reason=reason, text=None if text is None else text[:4096])


def text(words: str) -> Envelope:
    if len(words) > MAX_TEXT_CHARS:
        words = words[:MAX_TEXT_CHARS] + " [cut]"
    return Envelope(kind="text", text=words)


def usage(counts: object) -> Envelope:
    """A `usage` envelope from a CLI's `{input_tokens, output_tokens}` (both CLIs name
    them so); a missing or non-count value is 0."""
    u = counts if isinstance(counts, dict) else {}

    def count(key: str) -> int:
        value = u.get(key)
        return value if isinstance(value, int) and value >= 0 else 0

    return Envelope(
        kind="usage", input_tokens=count("input_tokens"), output_tokens=count("output_tokens")
    )


def session(value: object) -> Envelope:
    """A `session` envelope, or `bad_session_id` when the CLI's id is not a plain token
    (it becomes an argv element of the next turn and a file name in the CLI's home)."""
    if isinstance(value, str) and SESSION_ID_RE.fullmatch(value):
        return Envelope(kind="session", session=value)
    return error("bad_session_id", "the CLI named a session id substrate does not accept")


def workspace_path(value: object, cwd: str = WORKSPACE) -> str | None:
    """A path a tool names, relative to the checkout: None when it is not a string or
    lies outside `/workspace` (lexically: nothing is resolved). Bounded length."""
    if not isinstance(value, str) or not value or len(value) > 4096 or "\x00" in value:
        return None
    joined = posixpath.normpath(posixpath.join(cwd, value))
    if joined == WORKSPACE:
        return "."
    if not joined.startswith(WORKSPACE + "/"):
        return None
    return joined[len(WORKSPACE) + 1 :]


def paths_of(*values: object) -> tuple[str, ...]:
    found: list[str] = []
    for value in values:
        rel = workspace_path(value)
        if rel is not None and rel not in found and len(found) < MAX_PATHS_PER_TOOL:
            found.append(rel)
    return tuple(found)


class LineSplitter:
    """Bytes in, complete lines out; at most `MAX_LINE_BYTES` held (module doc)."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._max = max_line
        self._held = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> Iterator[bytes | Envelope]:
        """Each complete line (without its newline), or a `line_too_long` error."""
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                rest = data[start:]
                if not self._skipping:
                    if len(self._held) + len(rest) > self._max:
                        self._held.clear()
                        self._skipping = True
                        yield error("line_too_long", f"a line over {self._max} bytes was skipped")
                    else:
                        self._held += rest
                return
            piece = data[start:end]
            start = end + 1
            if self._skipping:
                self._skipping = False
                continue
            if len(self._held) + len(piece) > self._max:
                self._held.clear()
                yield error("line_too_long", f"a line over {self._max} bytes was skipped")
                continue
            line = bytes(self._held + piece) if self._held else piece
            self._held.clear()
            if line.strip():
                yield line

    def end(self) -> bytes | None:
        """What is left without a final newline (a CLI cut off mid-line), if anything."""
        line, self._held = bytes(self._held), bytearray()
        skipped, self._skipping = self._skipping, False
        return None if skipped or not line.strip() else line
