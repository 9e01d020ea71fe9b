"""What every client command needs: a connection to the daemon, a workspace handle,
`--state-dir` wherever it is written, and times a person can read."""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

from substrate.protocol.client import Client, socket_path


def client_for(args: argparse.Namespace, *, operator: bool = False) -> Client:
    path = socket_path(args.state_dir, operator=operator)
    try:
        return Client(path)
    except OSError as exc:
        raise SystemExit(f"substrate: cannot reach the daemon at {path}: {exc.strerror}") from None


def workspace_handle(client: Client, spec: str | None) -> str:
    """A handle from `--workspace`: a handle, a root_id, or a host path to adopt (default: cwd)."""
    if spec is None or spec.startswith("/") or spec == ".":
        path = os.path.abspath(spec or os.getcwd())
        return str(client.call("workspace.adopt", path=path)["workspace"])
    for ws in client.call("workspace.list")["workspaces"]:
        if spec in (ws["workspace"], ws["root_id"]):
            return str(ws["workspace"])
    raise SystemExit(f"substrate: no workspace {spec!r}")


STATE_DIR_HELP = (
    "the daemon's state dir (default $SUBSTRATE_STATE_DIR, else ~/.local/state/substrate)"
)


class StateDirParser(argparse.ArgumentParser):
    """A subcommand's parser: takes `--state-dir` too, so it may follow the command
    (`substrate journal read --state-dir D`). Given there, it wins over one given before
    the command; absent, the one before stands (SUPPRESS sets nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--state-dir", default=argparse.SUPPRESS, help=STATE_DIR_HELP)


#: Result fields that hold unix times: shown in ISO 8601 by the CLI.
TIME_FIELDS = frozenset(
    {"ts", "created", "updated", "expires", "revoked", "started", "ended", "adopted", "observed_at"}
)


def iso_time(ts: float) -> str:
    """A unix time as ISO 8601 in local time with its offset, to the millisecond."""
    return datetime.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")


def human_times(value: Any) -> Any:
    """`value` (decoded JSON) with each positive number under a `TIME_FIELDS` key shown
    by `iso_time`, at any depth. Pure."""
    if isinstance(value, dict):
        return {
            k: iso_time(v)
            if k in TIME_FIELDS and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
            else human_times(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [human_times(v) for v in value]
    return value
