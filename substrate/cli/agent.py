"""`substrate agent run`: one turn of an agent CLI in a workspace, its envelopes live.

`agent.start`, then `proc.subscribe` on the turn's command: each piece of its stdout is
cut into lines and parsed by the same provider the daemon uses (`substrate.agents`),
and each envelope is printed — a JSON object a line (`--json`), or a readable line
(`text`, `tool Write src/a.py`, `error malformed_line`, ...). At the end `agent.wait`
gives the turn's record (session, tools, what the gate applied and what it left), which
is printed last; the exit code is the CLI's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import trio

from substrate.agents import PROVIDERS, Envelope, LineSplitter
from substrate.cli.common import client_for, workspace_handle
from substrate.cli.exec import OutputTracker, exit_code_of
from substrate.protocol.client import AsyncClient, ConnectionLost, open_client, socket_path


def readable(envelope: Envelope) -> str:
    """One envelope as a line a person reads (the `--json` form is `msgspec`'s)."""
    e = envelope
    if e.kind == "text":
        return f"text   {e.text}"
    if e.kind == "tool_call":
        return f"tool   {e.tool} {' '.join(e.paths)}".rstrip()
    if e.kind == "tool_result":
        return f"result {'ok' if e.ok else 'failed'}"
    if e.kind == "session":
        return f"session {e.session}"
    if e.kind == "usage":
        return f"usage  {e.input_tokens} in, {e.output_tokens} out"
    return f"error  {e.reason}" + (f": {e.text}" if e.text else "")


async def _stream(client: AsyncClient, provider: str, proc: str, as_json: bool) -> dict[str, Any]:
    parser, splitter, tracker = PROVIDERS[provider].parser(), LineSplitter(), OutputTracker()

    def show(envelopes: list[Envelope]) -> None:
        for e in envelopes:
            print(msgspec.json.encode(e).decode() if as_json else readable(e), flush=True)

    async for message in client.notifications:
        params = message.get("params") or {}
        if params.get("proc") != proc:
            continue
        if message.get("method") == "proc.exit":
            last = splitter.end()
            if last is not None:
                show(parser.line(last))
            show(parser.finished(params.get("exit_code")))
            return dict(params)
        stream, data, _ = tracker.feed(params)
        if stream != "stdout":
            continue
        for item in splitter.feed(data):
            show([item] if isinstance(item, Envelope) else parser.line(item))
    raise ConnectionLost("the daemon closed the connection before the turn ended")


async def run_turn(
    path: Path, params: dict[str, Any], as_json: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    async with open_client(path) as client:
        started = await client.call("agent.start", **params)
        await client.call("proc.subscribe", proc=started["proc"])
        result = await _stream(client, params["provider"], started["proc"], as_json)
        record = await client.call("agent.wait", turn=started["turn"])
        return result, dict(record)


def cmd_agent(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        params: dict[str, Any] = {
            "workspace": workspace_handle(c, args.workspace),
            "provider": args.provider,
            "prompt": args.prompt,
            "changes": args.changes,
            "allowed_paths": list(args.allow_path),
            "allowed_tools": list(args.allow_tool),
        }
    if args.resume is not None:
        params["resume"] = args.resume
    if args.profile is not None:
        params["profile"] = args.profile
    if args.timeout is not None:
        params["timeout_s"] = args.timeout
    result, record = trio.run(run_turn, socket_path(args.state_dir), params, args.json)
    if args.json:
        print(json.dumps({"turn": record}))
    else:
        print(
            f"turn {record['turn']}: session {record.get('session')}, "
            f"{record['tool_calls']} tool calls, {len(record['applied'])} paths applied, "
            f"{len(record['left'])} left for review"
            + (f" (changes.get {record['changeset']})" if record["left"] else ""),
            file=sys.stderr,
        )
    return exit_code_of(result)


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("agent", help="run an agent CLI's turn in the workspace's sandbox")
    asub = p.add_subparsers(dest="agent_cmd", required=True)
    run = asub.add_parser("run", help="one turn: envelopes live, then the turn's record")
    run.add_argument(
        "--provider", required=True, choices=sorted(PROVIDERS), help="the agent CLI to run"
    )
    run.add_argument("--workspace", help="a handle, root id, or path to adopt (default: cwd)")
    run.add_argument("--prompt", required=True, help="the prompt (sent on the CLI's stdin)")
    run.add_argument("--resume", help="a session id from an earlier turn")
    run.add_argument(
        "--changes",
        choices=("review", "apply"),
        default="review",
        help="review (default): only --allow-path changes apply; apply: all, by the policy",
    )
    run.add_argument(
        "--allow-path", action="append", default=[], help="apply changes under this glob (repeat)"
    )
    run.add_argument(
        "--allow-tool", action="append", default=[], help="a tool the CLI may use (repeat)"
    )
    run.add_argument("--profile", help="the operator's profile (default: the provider's name)")
    run.add_argument("--timeout", type=float, help="seconds (never above the profile's)")
    run.add_argument("--json", action="store_true", help="envelopes as JSON lines")
    p.set_defaults(func=cmd_agent)
