"""`substrate secret set|list|rm|load`: the operator's secrets (docs/protocol.md §12).

These commands work on the state dir's files directly (`substrate.secrets.SecretStore`),
as the user the daemon runs as, with no daemon needed: a value never crosses a socket
and is never an argument (it would show in `ps` and shell history). `set` reads it from
stdin, without echo at a terminal; one trailing newline is dropped (what `echo` and a
here-string add). A running daemon uses a new value from the next command on.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from substrate.errors import InvalidParams, Refusal
from substrate.protocol.client import state_dir
from substrate.secrets import MAX_VALUE_BYTES, NAME_RE, SecretStore


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
    return _one_newline_less(data)


def _one_newline_less(data: bytes) -> bytes:
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data.removesuffix(b"\n")


#: At most this many files are read by `secret load` (a directory is the operator's, but
#: a wrong path must not read a whole tree).
MAX_LOAD_FILES = 1024


def load_dir(store: SecretStore, directory: Path) -> list[str]:
    """`secret load DIR`: set one secret per file of `DIR` named like a secret (others are
    skipped), its value the file's bytes less one trailing newline. For a Kubernetes
    Secret mounted as a volume (deploy/kubernetes): its files are symlinks into a
    `..data` directory the kubelet swaps atomically, so links are followed here — the
    directory is the operator's, never a workspace. Names set, in order."""
    loaded: list[str] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise InvalidParams(f"cannot list {directory}: {exc.strerror}") from None
    if len(entries) > MAX_LOAD_FILES:
        raise InvalidParams(f"{directory} holds over {MAX_LOAD_FILES} entries")
    for entry in entries:
        if not NAME_RE.fullmatch(entry.name) or not entry.is_file():
            continue
        with open(entry.path, "rb") as f:
            data = f.read(MAX_VALUE_BYTES + 3)
        store.set(entry.name, _one_newline_less(data))
        loaded.append(entry.name)
    return loaded


def cmd_secret(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        if args.secret_cmd == "set":
            store.set(args.name, read_value())
            print(f"secret {args.name} set", file=sys.stderr)
        elif args.secret_cmd == "load":
            for name in load_dir(store, Path(args.directory)):
                print(f"secret {name} set", file=sys.stderr)
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
    pl = ssub.add_parser(
        "load", help="set one secret per file of DIR (a mounted Kubernetes Secret), named by it"
    )
    pl.add_argument("directory", help="a directory of files, each a secret's value")
    p.set_defaults(func=cmd_secret)
