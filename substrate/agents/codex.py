"""The `codex` provider: OpenAI's `codex` CLI (`@openai/codex`), `codex exec --json`.

The turn: `codex exec --json --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox
[-c ...] [resume SESSION] -`, the prompt on stdin (`-`). Codex's own sandbox (Landlock
and seccomp of its own) is bypassed on purpose: the turn already runs in substrate's
sandbox, whose seccomp policy would refuse Codex's nested one, and what it writes goes
to the working layer, where the gate decides. Codex has no per-tool allow-list in `exec`:
its shell and patch tools are always there; `allowed_tools` may name `web_search`
(enabled with `-c tools.web_search=true`); any other name is refused (`invalid_params`,
`unknown_tools`) rather than silently ignored. The model endpoint: when the profile's
environment sets `OPENAI_BASE_URL` (the operator's), the turn names it as a model
provider of its own (`-c model_providers.substrate={...}`): this CLI does not read that
variable itself.

The stream: `thread.started` (the session id), `item.started` / `item.completed` of
items typed `agent_message` (text), `command_execution` (a shell command: exit code),
`file_change` (paths with `add`/`update`/`delete`), `mcp_tool_call`, `web_search`,
then `turn.completed` (usage) or `turn.failed`; a top-level `error` is the CLI's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from substrate.agents import envelope as env
from substrate.agents.envelope import Envelope
from substrate.agents.provider import TurnCommand, TurnSpec
from substrate.errors import InvalidParams

#: `allowed_tools` names codex accepts, and the config each turns on.
_TOOL_FLAGS = {"web_search": "tools.web_search=true"}
#: Item types that are tool calls, and the name the envelope gives each.
_TOOL_ITEMS = {
    "command_execution": "shell",
    "file_change": "apply_patch",
    "mcp_tool_call": "mcp",
    "web_search": "web_search",
}


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


class CodexParser:
    def __init__(self) -> None:
        self._done = False
        self._started: set[str] = set()

    def line(self, line: bytes) -> list[Envelope]:
        try:
            event = json.loads(line)
        except ValueError:
            return [env.error("malformed_line", "a line of the stream is not JSON")]
        if not isinstance(event, dict):
            return [env.error("malformed_line", "a line of the stream is not a JSON object")]
        kind = event.get("type")
        if kind == "thread.started":
            return [env.session(event.get("thread_id"))]
        if kind in ("item.started", "item.completed", "item.updated"):
            item = event.get("item")
            return self._item(kind, item) if isinstance(item, dict) else []
        if kind == "turn.completed":
            self._done = True
            return [env.usage(event.get("usage"))]
        if kind == "turn.failed":
            self._done = True
            failure = event.get("error")
            message = failure.get("message") if isinstance(failure, dict) else None
            return [env.error("turn_failed", message if isinstance(message, str) else None)]
        if kind == "error":
            message = event.get("message")
            return [env.error("cli_error", message if isinstance(message, str) else None)]
        return []

    def _item(self, kind: str, item: dict[str, Any]) -> list[Envelope]:
        item_type = item.get("type")
        item_id = item.get("id") if isinstance(item.get("id"), str) else None
        if item_type == "agent_message":
            words = item.get("text")
            return [env.text(words)] if kind == "item.completed" and isinstance(words, str) else []
        if item_type == "error" and kind == "item.completed":
            message = item.get("message")
            return [env.error("cli_error", message if isinstance(message, str) else None)]
        tool = _TOOL_ITEMS.get(item_type) if isinstance(item_type, str) else None
        if tool is None or kind == "item.updated":
            return []
        out: list[Envelope] = []
        if item_id is None or item_id not in self._started:
            if item_id is not None:
                self._started.add(item_id)
            out.append(_call(tool, item_id, item))
        if kind == "item.completed":
            out.append(Envelope(kind="tool_result", tool=tool, call_id=item_id, ok=_ok(item)))
        return out

    def finished(self, exit_code: int | None) -> list[Envelope]:
        if self._done:
            return []
        return [
            env.error("exited_mid_stream", f"the CLI ended before its turn did (exit {exit_code})")
        ]


def _call(tool: str, item_id: str | None, item: dict[str, Any]) -> Envelope:
    paths: tuple[str, ...] = ()
    shown: dict[str, Any] = {}
    if tool == "apply_patch":
        changes = item.get("changes")
        listed = [c for c in changes if isinstance(c, dict)] if isinstance(changes, list) else []
        paths = env.paths_of(*(c.get("path") for c in listed))
        shown = {"changes": [{"path": c.get("path"), "kind": c.get("kind")} for c in listed[:64]]}
    elif tool == "shell" and isinstance(item.get("command"), str):
        shown = {"command": item["command"][:4096]}
    elif tool == "mcp":
        shown = {k: item.get(k) for k in ("server", "tool") if isinstance(item.get(k), str)}
    elif tool == "web_search" and isinstance(item.get("query"), str):
        shown = {"query": item["query"][:1024]}
    return Envelope(kind="tool_call", tool=tool, call_id=item_id, paths=paths, input=shown)


def _ok(item: dict[str, Any]) -> bool:
    if item.get("status") == "failed":
        return False
    code = item.get("exit_code")
    return code is None or code == 0


class Codex:
    name = "codex"
    program = "codex"

    def command(self, spec: TurnSpec, profile_env: Mapping[str, str]) -> TurnCommand:
        unknown = sorted(set(spec.allowed_tools) - set(_TOOL_FLAGS))
        if unknown:
            raise InvalidParams(
                "codex has no switch for these tools (its shell and patch tools are always on)",
                path="$.allowed_tools",
                unknown_tools=unknown,
            )
        argv = ["codex", "exec", "--json", "--skip-git-repo-check"]
        argv.append("--dangerously-bypass-approvals-and-sandbox")
        for tool in spec.allowed_tools:
            argv += ["-c", _TOOL_FLAGS[tool]]
        base_url = profile_env.get("OPENAI_BASE_URL")
        if base_url:
            provider = (
                f"{{name={_toml_string('substrate')}, base_url={_toml_string(base_url)}, "
                f'env_key="OPENAI_API_KEY", wire_api="responses"}}'
            )
            argv += [
                "-c",
                f"model_providers.substrate={provider}",
                "-c",
                "model_provider=substrate",
            ]
        if spec.resume is not None:
            argv += ["resume", spec.resume]
        argv.append("-")
        return TurnCommand(argv=tuple(argv), stdin=spec.prompt.encode("utf-8"))

    def parser(self) -> CodexParser:
        return CodexParser()
