"""The `claude-code` provider: Anthropic's `claude` CLI (`@anthropic-ai/claude-code`).

The turn: `claude -p --output-format stream-json --verbose --permission-mode acceptEdits
[--allowedTools T,...] [--resume SESSION]`, the prompt on stdin. `--verbose` is what
makes `-p` print every message as a JSON line, not only the result. `acceptEdits`
lets the CLI's Write and Edit change files without asking (there is nobody to ask in a
headless turn; what it writes lands in the working layer, and the gate decides);
other tools run only when listed in `--allowedTools` (the turn's `allowed_tools`, in
the CLI's own syntax, e.g. `Bash(git diff:*)`). The profile's environment sets
`ANTHROPIC_BASE_URL` when the endpoint is not Anthropic's, and
`CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC` keeps the CLI to the model API (egress
allows that host only anyway).

The stream (one JSON object a line): `system/init` (session id), `assistant` messages
whose content holds `text` and `tool_use` blocks, `user` messages holding the
`tool_result`s, and a final `result` (usage, `is_error`). Paths: `file_path` of
Read/Write/Edit/NotebookEdit, `path` of Glob/Grep.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from substrate.agents import envelope as env
from substrate.agents.envelope import Envelope
from substrate.agents.provider import TurnCommand, TurnSpec

#: Tool-input keys that name a file or directory, by tool.
_PATH_KEYS = ("file_path", "notebook_path", "path")


class ClaudeCodeParser:
    def __init__(self) -> None:
        self._done = False

    def line(self, line: bytes) -> list[Envelope]:
        try:
            event = json.loads(line)
        except ValueError:
            return [env.error("malformed_line", "a line of the stream is not JSON")]
        if not isinstance(event, dict):
            return [env.error("malformed_line", "a line of the stream is not a JSON object")]
        kind = event.get("type")
        if kind == "system" and event.get("subtype") == "init":
            return [env.session(event.get("session_id"))]
        if kind == "assistant":
            return list(_assistant(event.get("message")))
        if kind == "user":
            return list(_results(event.get("message")))
        if kind == "result":
            self._done = True
            out = [env.usage(event.get("usage"))]
            if event.get("is_error"):
                out.append(
                    env.error(str(event.get("subtype") or "cli_error"), _str(event.get("result")))
                )
            return out
        return []

    def finished(self, exit_code: int | None) -> list[Envelope]:
        if self._done:
            return []
        return [
            env.error("exited_mid_stream", f"the CLI ended before its result (exit {exit_code})")
        ]


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _content(message: object) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        return []
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _assistant(message: object) -> list[Envelope]:
    out: list[Envelope] = []
    for block in _content(message):
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            out.append(env.text(block["text"]))
        elif block.get("type") == "tool_use":
            given = block.get("input")
            tool_input = given if isinstance(given, dict) else {}
            out.append(
                Envelope(
                    kind="tool_call",
                    tool=_str(block.get("name")) or "?",
                    call_id=_str(block.get("id")),
                    paths=env.paths_of(*(tool_input.get(k) for k in _PATH_KEYS)),
                    input=tool_input,
                )
            )
    return out


def _results(message: object) -> list[Envelope]:
    return [
        Envelope(
            kind="tool_result",
            call_id=_str(block.get("tool_use_id")),
            ok=not bool(block.get("is_error")),
        )
        for block in _content(message)
        if block.get("type") == "tool_result"
    ]


class ClaudeCode:
    name = "claude-code"
    program = "claude"

    def command(self, spec: TurnSpec, profile_env: Mapping[str, str]) -> TurnCommand:
        argv = ["claude", "-p", "--output-format", "stream-json", "--verbose"]
        argv += ["--permission-mode", "acceptEdits"]
        if spec.allowed_tools:
            argv += ["--allowedTools", ",".join(spec.allowed_tools)]
        if spec.resume is not None:
            argv += ["--resume", spec.resume]
        return TurnCommand(argv=tuple(argv), stdin=spec.prompt.encode("utf-8"))

    def parser(self) -> ClaudeCodeParser:
        return ClaudeCodeParser()
