"""The terminal service of a daemon: grants, sessions and the HTTP endpoint, wired.

`TerminalService(...)` is built by `substrate.daemon.open_daemon` (it creates the grants
table); `serve` runs the sessions and the HTTP listener in the daemon's nursery.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from substrate.config import Config
from substrate.process.service import Execution
from substrate.pty.docker import DockerPtys
from substrate.pty.grants import Grants
from substrate.pty.http import TerminalHttp, parse_listen
from substrate.pty.terminals import Terminals
from substrate.store.db import Store
from substrate.store.journal import Journal
from substrate.workspace.registry import WorkspaceRegistry

log = logging.getLogger("substrate.pty")


class TerminalService:
    """Everything terminals need; the daemon hands its grants and sessions to the handlers."""

    def __init__(
        self,
        config: Config,
        store: Store,
        journal: Journal,
        execution: Execution,
        workspaces: WorkspaceRegistry,
    ) -> None:
        self.listen = config.listen
        self.grants = Grants(store, journal)
        self.sessions = Terminals(
            grants=self.grants,
            journal=journal,
            spawner=DockerPtys(execution, workspaces.get),
            check_workspace=workspaces.get,
        )

        def refused(refusal: str, data: dict[str, Any]) -> None:
            # Origin refusals happen before any session exists; journal them like RPC ones.
            self.sessions.record("pty.refused", {"refusal": refusal, **data}, actor="web")

        self.http = TerminalHttp(
            self.sessions,
            allowed_origins=list(config.allowed_origins),
            on_refusal=refused,
        )

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Run sessions and the HTTP endpoint until cancelled; `started` gets the port."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.sessions.run)
            try:
                port = await nursery.start(self.http.serve, self.listen)
            except (OSError, ValueError) as exc:
                # The sockets still serve agents; the operator sees why terminals do not.
                log.error("terminals: cannot listen on %s: %s", self.listen, exc)
                self.sessions.record(
                    "pty.unavailable", {"listen": self.listen, "error": str(exc)[:200]}
                )
                port = 0
            task_status.started(port)

    def address(self) -> str | None:
        """Where terminals are served (`HOST:PORT`, the bound port), or None when they are not.

        Clients build their terminal URL from this, never from a default port: a token sent
        to whatever else listens on 7681 would be a leak.
        """
        port = self.http.port
        if not port:
            return None
        host, _ = parse_listen(self.listen)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
