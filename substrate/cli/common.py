"""What every client command needs: a connection to the daemon and a workspace handle."""

from __future__ import annotations

import argparse
import os

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
