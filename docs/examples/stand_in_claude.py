#!/usr/bin/env python3
"""A stand-in for `claude -p --output-format stream-json --verbose`, for trying and testing
the agent-provider flow (docs/agent-provider.md) with no model and no network.

It takes the flags of the real CLI that the flow uses and prints the same kind of
stream-json: a `system`/`init` event, `assistant` messages with `tool_use` blocks, `user`
messages with their `tool_result`, and a last `result` event carrying the `session_id`.
The "model" is a script read from the prompt, one action a line:

    write PATH      write PATH (relative to the working directory) with one line of text
    read PATH       read PATH and answer with its first line
    fetch URL       open an HTTPS tunnel to URL's host through $HTTPS_PROXY (egress)
    anything else   said back in the answer

Like the real CLI it needs `ANTHROPIC_API_KEY` (it proves it has the key by printing the
key's SHA-256 in the init event as `api_key_sha256`, never the key), keeps each session
in `$HOME/.claude/projects/<cwd with / as ->/<session>.jsonl`, and `--resume SESSION`
continues one: the answer says how many prompts came before and what the last was.
The prompt is the positional argument, else stdin. Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MODEL = "stand-in-model"
TOOLS = ["Read", "Write", "WebFetch"]


def emit(event: dict[str, Any]) -> None:
    """One stream-json line on stdout, flushed at once (the client reads it live)."""
    sys.stdout.write(json.dumps(event, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def session_file(session: str) -> Path:
    slug = os.getcwd().replace("/", "-")
    return (
        Path(os.environ.get("HOME", "/nonexistent"))
        / ".claude"
        / "projects"
        / slug
        / (session + ".jsonl")
    )


def fail(session: str, message: str, started: float) -> int:
    emit(
        {
            "type": "result",
            "subtype": "error_during_execution",
            "is_error": True,
            "duration_ms": int((time.monotonic() - started) * 1000),
            "num_turns": 0,
            "result": message,
            "session_id": session,
        }
    )
    return 1


class Turn:
    """The messages of one turn, numbered like the real CLI's tool ids."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.tools = 0
        self.texts: list[str] = []

    def say(self, text: str) -> None:
        self.texts.append(text)
        self._assistant([{"type": "text", "text": text}], "end_turn")

    def tool(self, name: str, tool_input: dict[str, Any], run: Callable[[], str]) -> None:
        """A `tool_use` block, the tool run here, then its `tool_result`."""
        self.tools += 1
        tool_id = f"toolu_{self.tools:04d}"
        self._assistant(
            [{"type": "tool_use", "id": tool_id, "name": name, "input": tool_input}], "tool_use"
        )
        try:
            content, is_error = str(run()), False
        except OSError as exc:
            content, is_error = f"{type(exc).__name__}: {exc.strerror or exc}", True
        emit(
            {
                "type": "user",
                "message": {
                    "role": "user",
                    "content": [
                        {
                            "tool_use_id": tool_id,
                            "type": "tool_result",
                            "content": content,
                            "is_error": is_error,
                        }
                    ],
                },
                "parent_tool_use_id": None,
                "session_id": self.session,
            }
        )

    def _assistant(self, content: list[dict[str, Any]], stop: str) -> None:
        emit(
            {
                "type": "assistant",
                "message": {
                    "id": f"msg_{uuid.uuid4().hex[:24]}",
                    "type": "message",
                    "role": "assistant",
                    "model": MODEL,
                    "content": content,
                    "stop_reason": stop,
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                },
                "parent_tool_use_id": None,
                "session_id": self.session,
            }
        )


def write_file(path: str) -> str:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"# written by the stand-in agent for {path}\n")
    return f"File created successfully at: {target.resolve()}"


def read_file(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline().rstrip("\n")


def fetch(url: str) -> str:
    """An HTTPS tunnel to the URL's host, through the proxy the sandbox names (if any)."""
    host = urlsplit(url).hostname or url
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    if not proxy:
        with socket.create_connection((host, 443), timeout=10):
            return f"connected to {host}:443 directly"
    where = urlsplit(proxy)
    with socket.create_connection((where.hostname or "", where.port or 80), timeout=30) as s:
        s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        status = s.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
    return f"proxy answered: {status}"


def main(argv: list[str]) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(prog="claude", add_help=True)
    parser.add_argument("prompt", nargs="?")
    parser.add_argument("-p", "--print", action="store_true", dest="print_mode")
    parser.add_argument("--output-format", default="text")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("-r", "--resume")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--permission-mode")
    args = parser.parse_args(argv)
    if not args.print_mode or args.output_format != "stream-json":
        print("this stand-in only speaks -p --output-format stream-json", file=sys.stderr)
        return 2
    if not args.verbose:  # as the real CLI says
        print(
            "Error: When using --print, --output-format=stream-json requires --verbose",
            file=sys.stderr,
        )
        return 1
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    session = args.resume or str(uuid.uuid4())
    key = os.environ.get("ANTHROPIC_API_KEY", "")
    if not key:
        return fail(session, "Invalid API key · Please run /login", started)
    history: list[dict[str, Any]] = []
    if args.resume:
        try:
            text = session_file(session).read_text(encoding="utf-8")
        except FileNotFoundError:
            return fail(session, f"No conversation found with session ID: {session}", started)
        history = [json.loads(line) for line in text.splitlines() if line.strip()]
    emit(
        {
            "type": "system",
            "subtype": "init",
            "cwd": os.getcwd(),
            "session_id": session,
            "tools": TOOLS,
            "mcp_servers": [],
            "model": args.model,
            "permissionMode": args.permission_mode or "default",
            "apiKeySource": "ANTHROPIC_API_KEY",
            "api_key_sha256": hashlib.sha256(key.encode()).hexdigest(),
        }
    )
    turn = Turn(session)
    earlier = [h["prompt"] for h in history if h.get("type") == "user"]
    if args.resume:
        turn.say(
            f"Resumed session {session}: {len(earlier)} earlier prompt(s), "
            f"the last: {earlier[-1] if earlier else ''!r}."
        )
    said: list[str] = []
    for line in prompt.splitlines():
        verb, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if verb == "write" and rest:
            turn.tool("Write", {"file_path": rest}, functools.partial(write_file, rest))
        elif verb == "read" and rest:
            turn.tool("Read", {"file_path": rest}, functools.partial(read_file, rest))
        elif verb == "fetch" and rest:
            turn.tool("WebFetch", {"url": rest}, functools.partial(fetch, rest))
        elif line.strip():
            said.append(line.strip())
    answer = " ".join(said) or f"Done: {turn.tools} tool call(s)."
    turn.say(answer)
    store = session_file(session)
    store.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(store, "a", encoding="utf-8") as f:
        f.write(json.dumps({"type": "user", "prompt": prompt.strip()}) + "\n")
        f.write(json.dumps({"type": "assistant", "text": answer}) + "\n")
    emit(
        {
            "type": "result",
            "subtype": "success",
            "is_error": False,
            "duration_ms": int((time.monotonic() - started) * 1000),
            "duration_api_ms": 0,
            "num_turns": len(earlier) + 1,
            "result": answer,
            "session_id": session,
            "total_cost_usd": 0.0,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
