"""`substrate secret set|list|rm`: the operator's secrets (docs/protocol.md §12).

These commands work on the state dir's files directly (`substrate.secrets.SecretStore`),
as the user the daemon runs as, with no daemon needed: a value never crosses a socket
and is never an argument (it would show in `ps` and shell history). `set` reads it from
stdin, without echo at a terminal; one trailing newline is dropped (what `echo` and a
here-string add). A running daemon uses a new value from the next command on.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any, TextIO

from substrate.errors import Refusal
from substrate.protocol.client import state_dir
from substrate.secrets import MAX_VALUE_BYTES, SecretStore


def _store(args: argparse.Namespace) -> SecretStore:
    return SecretStore(state_dir(args.state_dir))


def read_value(stdin: TextIO | None = None) -> bytes:
    """The value from stdin, less one trailing `\\n` or `\\r\\n`; at a terminal, a prompt
    without echo. At most `MAX_VALUE_BYTES` + 3 bytes are read: more is refused as
    `too_large` by `SecretStore.set` whatever the newline."""
    stream = sys.stdin if stdin is None else stdin
    if stream.isatty():
        data = getpass.getpass("value: ").encode("utf-8")
    else:
        data = stream.buffer.read(MAX_VALUE_BYTES + 3)
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data.removesuffix(b"\n")


def cmd_secret(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        if args.secret_cmd == "set":
            store.set(args.name, read_value())
            print(f"secret {args.name} set", file=sys.stderr)
        elif args.secret_cmd == "rm":
            store.remove(args.name)
            print(f"secret {args.name} removed", file=sys.stderr)
        else:
            for name in store.names():
                print(name)
    except Refusal as exc:
        print(f"substrate: {exc.name}: {exc.message}", file=sys.stderr)
        return 2
    return 0


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("secret", help="operator: set, list or remove secrets profiles name")
    ssub = p.add_subparsers(dest="secret_cmd", required=True)
    ps = ssub.add_parser("set", help="set NAME to the value read from stdin")
    ps.add_argument("name", help="the secret's name, as profiles name it")
    pr = ssub.add_parser("rm", help="remove NAME")
    pr.add_argument("name", help="the secret's name")
    ssub.add_parser("list", help="the names of the secrets set (never a value)")
    p.set_defaults(func=cmd_secret)
