"""`substrate journal verify --postgres` and `journal export`: the journal in PostgreSQL (docs/fleet.md).

`verify --postgres DSN --node NAME` walks that node's chain in `substrate_journal` from
PostgreSQL alone (no daemon, no state dir) and prints `{ok, checked, first_bad_seq?}`;
exit 0 when intact, 1 when not, 2 when PostgreSQL cannot be asked. `export --postgres
DSN` ships what the state dir's journal holds beyond its cursor, once, and exits (as the
daemon's user, with the daemon running or not: the inserts are idempotent).

The password comes from `--password-secret NAME` (an operator secret of the state dir),
else from libpq's own ways (PGPASSWORD, ~/.pgpass, the DSN). Messages never hold it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sqlite3
import sys
from collections.abc import Iterator
from typing import Any

from substrate.errors import Refusal
from substrate.export import (
    ChainCheck,
    Cursors,
    Exporter,
    ExportError,
    ExportSettings,
    JournalSource,
    describe_dsn,
    open_target,
)
from substrate.fs.state import StatePaths
from substrate.protocol.client import state_dir
from substrate.secrets import SecretStore

#: Rows read from PostgreSQL per query while verifying.
VERIFY_BATCH = 5000


def _password(args: argparse.Namespace) -> str | None:
    name = getattr(args, "password_secret", None)
    if not name:
        return None
    return SecretStore(state_dir(args.state_dir)).load([name])[name]


def cmd_verify_postgres(args: argparse.Namespace) -> int:
    """Verify `--node`'s chain in PostgreSQL; see the module doc for the exit codes."""
    if not args.node:
        print("substrate: journal verify --postgres needs --node NAME", file=sys.stderr)
        return 2
    try:
        target = open_target(args.postgres, password=_password(args), create=False)
    except (ExportError, Refusal) as exc:
        return _failed(exc)
    check = ChainCheck()
    after = 0
    try:
        while rows := target.chain(args.node, after, VERIFY_BATCH):
            if check.feed(rows) is not None:
                break
            after = int(rows[-1][1])
    except ExportError as exc:
        return _failed(exc)
    finally:
        target.close()
    result: dict[str, Any] = {"ok": check.first_bad is None, "checked": check.checked}
    if check.first_bad is not None:
        result["first_bad_seq"] = check.first_bad
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0 if check.first_bad is None else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Ship the state dir's journal once; prints how many entries and where it stands."""
    paths = StatePaths(state_dir(args.state_dir))
    if not paths.database.exists():
        print(f"substrate: no state database at {paths.database}", file=sys.stderr)
        return 2
    node = args.node or socket.gethostname()
    try:
        password = _password(args)
        settings = ExportSettings(dsn=args.postgres, node=node, password=lambda: password)
        describe_dsn(args.postgres)
    except (ExportError, Refusal) as exc:
        return _failed(exc)
    db = sqlite3.connect(paths.database, isolation_level=None, timeout=10.0)
    source = JournalSource(paths.database, node)
    try:
        exporter = Exporter(settings, source, Cursors(lambda: _transaction(db)))
        shipped = exporter.ship_all()
    except ExportError as exc:
        return _failed(exc)
    finally:
        source.close()
        db.close()
    where = {"node": node, "shipped": shipped, "last_seq": exporter.last_seq}
    print(json.dumps(where, indent=2, sort_keys=True))
    return 0


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _failed(exc: ExportError | Refusal) -> int:
    print(f"substrate: {exc}", file=sys.stderr)
    return 2


def add_export_command(jsub: argparse._SubParsersAction[Any]) -> None:
    """`journal export` (its parser; `journal verify` takes `add_postgres_options`)."""
    p = jsub.add_parser("export", help="ship the journal to PostgreSQL once, then exit")
    p.add_argument("--postgres", required=True, metavar="DSN", help=_DSN_HELP)
    p.add_argument("--node", help="this node's name in substrate_journal (default: host name)")
    _password_option(p)


def add_postgres_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--postgres",
        metavar="DSN",
        help="verify a node's chain in PostgreSQL instead: " + _DSN_HELP,
    )
    p.add_argument("--node", help="with --postgres: the node whose chain is verified")
    _password_option(p)


def _password_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--password-secret",
        metavar="NAME",
        help="the operator secret holding the password (default: PGPASSWORD, ~/.pgpass)",
    )


_DSN_HELP = "a libpq DSN or URI (docs/fleet.md)"
