"""One agent CLI turn inside substrate, as an agent backend runs it (docs/agent-provider.md).

    python docs/examples/agent_turn.py --workspace ws_... --profile agent-cli \\
        --accept src --accept tests [--resume SESSION] < prompt.txt

1. `proc.start` the operator-bound argv (`claude -p --output-format stream-json
   --verbose ...`; the profile's `argv_allow` fixes the program) with the prompt on
   stdin and `changes: "review"`: whatever the CLI writes stays in the sandbox's working
   layer, none of it in the checkout.
2. `proc.subscribe` and join stdout's `proc.output` pieces into stream-json events as
   they arrive (`substrate.protocol.stream_json`), until `proc.exit`, whose params are
   the result: exit code and the change set kept for review.
3. The backend's own path gate: `changes.apply {changeset, paths}` with the proposed
   paths under `--accept` (the operator's policy still refuses what it denies: those
   come back `blocked`), then `changes.discard` drops the rest.

The session id of the CLI's `result` event goes to the next turn's `--resume`; the
session itself lives in the workspace's persistent home (`$HOME` = `/home/agent`).
Prints each event as one line, then a JSON summary. Uses only substrate's client.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from substrate.protocol.client import Client, socket_path
from substrate.protocol.stream_json import StreamJsonReader, StreamLine, result_event, session_id

#: The program and flags; the prompt goes on stdin (never into argv, which the daemon
#: keeps in its process records). `acceptEdits`: the CLI may write without asking, since
#: nothing it writes lands before the backend's review.
ARGV = ["claude", "-p", "--output-format", "stream-json", "--verbose"]
PERMISSIONS = ["--permission-mode", "acceptEdits"]
#: stderr kept for diagnostics, bytes (the rest stays readable from the process).
STDERR_KEEP = 64 << 10


@dataclass
class Turn:
    """What one run of the CLI produced. `changes` is the result's change set (mode
    "review"); `events` the stream-json objects in order, `bad_lines` the lines that were
    not (with why)."""

    proc: str
    exit_code: int | None
    events: list[dict[str, Any]]
    bad_lines: list[StreamLine]
    session_id: str | None
    result: dict[str, Any] | None
    changes: dict[str, Any]
    stderr: str
    final: dict[str, Any] = field(repr=False)  # the whole `proc.exit` params


@dataclass
class Settled:
    """What became of a turn's change set: applied, refused by the operator's policy
    (`blocked`, with the rule), in conflict with the checkout, waiting for an operator's
    approval (`pending`: the set is then kept), and the paths the backend did not accept
    (discarded with the set)."""

    changeset: str | None
    applied: list[dict[str, Any]] = field(default_factory=list)
    blocked: list[dict[str, Any]] = field(default_factory=list)
    conflicts: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    not_accepted: list[str] = field(default_factory=list)
    discarded: bool = False


def notifications(client: Client) -> Iterator[dict[str, Any]]:
    """The connection's notifications: those that arrived during calls, then new ones."""
    while True:
        while client.notifications:
            yield client.notifications.pop(0)
        yield client.read_message()


def run_turn(
    client: Client,
    workspace: str,
    profile: str,
    prompt: str,
    *,
    resume: str | None = None,
    extra_args: Sequence[str] = PERMISSIONS,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> Turn:
    """Run the CLI once with `changes: "review"` and read its stream until it ends.

    Refusals of `proc.start` come as `RpcError` (`argv_denied`: the profile does not
    allow the program; `secret_unknown`: the operator has not set the API key;
    `limit_exceeded`: too many change sets kept, apply or discard some). Blocks until
    the command ends (the profile's `timeout_s` bounds it).
    """
    argv = [*ARGV, *extra_args, *(["--resume", resume] if resume else [])]
    started = client.call(
        "proc.start",
        workspace=workspace,
        profile=profile,
        argv=argv,
        stdin=prompt,
        changes="review",
    )
    proc = started["proc"]
    client.call("proc.subscribe", proc=proc)
    reader = StreamJsonReader()
    lines: list[StreamLine] = []
    stderr = bytearray()
    final: dict[str, Any] = {}
    for message in notifications(client):
        params = message.get("params") or {}
        if params.get("proc") != proc:
            continue
        if message.get("method") == "proc.exit":
            final = params
            break
        if message.get("method") != "proc.output":
            continue
        if params.get("stream") == "stdout":
            for line in reader.feed_output(params):
                lines.append(line)
                if line.event is not None and on_event is not None:
                    on_event(line.event)
        elif len(stderr) < STDERR_KEEP:
            text = params.get("data")
            piece = text.encode() if text else base64.b64decode(params.get("data_b64") or "")
            stderr += piece[: STDERR_KEEP - len(stderr)]
    lines.extend(reader.finish())
    return Turn(
        proc=proc,
        exit_code=final.get("exit_code"),
        events=[line.event for line in lines if line.event is not None],
        bad_lines=[line for line in lines if line.event is None],
        session_id=session_id(lines),
        result=result_event(lines),
        changes=final.get("changes") or {},
        stderr=stderr.decode("utf-8", "replace"),
        final=final,
    )


def accepted(path: str, roots: Sequence[str]) -> bool:
    """`path` is one of `roots` or beneath one (workspace-relative, no globs)."""
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def settle(client: Client, turn: Turn, accept: Sequence[str]) -> Settled:
    """Apply the proposed changes under `accept`, then discard the rest of the set.

    The change set lists at most 1,000 changes per answer; a turn that proposes more is
    refused here (ValueError) rather than half-reviewed. A set with changes waiting for
    an operator's approval is kept (not discarded) so that the approved plans can be
    applied later with `changes.apply`.
    """
    changes = turn.changes
    changeset = changes.get("changeset")
    if changes.get("deferred"):
        raise ValueError("the turn shared its layer with another command: run turns alone")
    if changeset is None:
        return Settled(changeset=None)
    proposed = changes.get("review", [])
    if changes.get("counts", {}).get("review", 0) > len(proposed):
        raise ValueError(f"{changeset} proposes more changes than one answer lists")
    paths = sorted({entry["path"] for entry in proposed})
    take = [p for p in paths if accepted(p, accept)]
    out = Settled(changeset=changeset, not_accepted=[p for p in paths if p not in take])
    state = "pending"
    if take:
        done = client.call("changes.apply", changeset=changeset, paths=take)
        out.applied, out.blocked = done["applied"], done["blocked"]
        out.conflicts, out.pending = done["conflicts"], done["pending"]
        state = done["state"]
    if state == "pending" and not out.pending:
        client.call("changes.discard", changeset=changeset)
        out.discarded = True
    return out


def _print_event(event: dict[str, Any]) -> None:
    kind = event.get("type")
    if kind == "assistant":
        for block in event.get("message", {}).get("content", []):
            if block.get("type") == "text":
                print(f"[assistant] {block.get('text', '')}")
            elif block.get("type") == "tool_use":
                print(f"[tool_use] {block.get('name')} {json.dumps(block.get('input'))}")
    elif kind == "result":
        print(f"[result] {event.get('subtype')}: {event.get('result', '')}")
    else:
        print(f"[{kind}] {event.get('subtype', '')}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", help="the daemon's state dir (its agent socket)")
    parser.add_argument("--workspace", required=True, help="workspace handle (ws_...)")
    parser.add_argument("--profile", default="agent-cli", help="the operator's CLI profile")
    parser.add_argument("--accept", action="append", default=[], help="dir to accept changes in")
    parser.add_argument("--resume", help="session id of an earlier turn")
    args = parser.parse_args(argv)
    prompt = sys.stdin.read()
    with Client(socket_path(args.state_dir), timeout=None) as client:
        turn = run_turn(
            client, args.workspace, args.profile, prompt, resume=args.resume, on_event=_print_event
        )
        done = settle(client, turn, args.accept)
    summary = {
        "proc": turn.proc,
        "exit_code": turn.exit_code,
        "session_id": turn.session_id,
        "is_error": None if turn.result is None else turn.result.get("is_error"),
        "changeset": done.changeset,
        "applied": [e["path"] for e in done.applied],
        "blocked": [{"path": e["path"], "rule": e.get("rule")} for e in done.blocked],
        "conflicts": [e["path"] for e in done.conflicts],
        "pending": [e["path"] for e in done.pending],
        "not_accepted": done.not_accepted,
    }
    print(json.dumps(summary, indent=2))
    return 0 if turn.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
