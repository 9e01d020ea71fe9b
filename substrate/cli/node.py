"""`substrate status` and `substrate drain`: what an orchestrator asks a node's daemon.

docs/deployment.md: the readiness check and the preStop drain of deploy/kubernetes.

`status` prints `daemon.status` as JSON; with `--ready` it prints nothing and its exit
code is the readiness answer: 0 when the daemon answers, its engine is reachable and it
is not draining, 1 otherwise. `drain` asks `daemon.drain` on the operator socket and
waits (bounded) for the running commands; exit 0 when the node is idle, 1 when commands
still ran at the timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from substrate.protocol.client import Client, RpcError, socket_path
from substrate.schema.journal import MAX_DRAIN_S


def _client(args: argparse.Namespace, *, operator: bool, timeout: float = 30.0) -> Client | None:
    try:
        return Client(socket_path(args.state_dir, operator=operator), timeout=timeout)
    except OSError as exc:
        print(f"substrate: cannot reach the daemon: {exc.strerror}", file=sys.stderr)
        return None


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args, operator=False)
    if client is None:
        return 1
    with client:
        try:
            status = client.call("daemon.status")
        except RpcError as exc:
            print(f"substrate: {exc.refusal or exc.code}: {exc.message}", file=sys.stderr)
            return 1
    if args.ready:
        return 0 if ready(status) else 1
    print(json.dumps(status, indent=2))
    return 0


def ready(status: dict[str, Any]) -> bool:
    """The readiness answer for a `daemon.status` result."""
    engine = status.get("engine") or {}
    return bool(engine.get("reachable")) and not status.get("draining", False)


def cmd_drain(args: argparse.Namespace) -> int:
    # The socket's own read timeout outlasts the drain's wait.
    client = _client(args, operator=True, timeout=args.timeout + 30)
    if client is None:
        return 1
    with client:
        result = client.call("daemon.drain", timeout_s=args.timeout, cancel=args.cancel)
    print(json.dumps(result))
    return 0 if args.cancel or result["running"] == 0 else 1


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "status", help="the daemon's status; --ready: exit 0 only when it serves commands"
    )
    p.add_argument(
        "--ready",
        action="store_true",
        help="print nothing; exit 0 when the engine is reachable and the daemon is not draining",
    )
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "drain", help="operator: start no new command; wait for the running ones (bounded)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help=f"seconds to wait for running commands (default 60, at most {MAX_DRAIN_S:g})",
    )
    p.add_argument("--cancel", action="store_true", help="accept new commands again")
    p.set_defaults(func=cmd_drain)
