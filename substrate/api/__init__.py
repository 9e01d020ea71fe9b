"""The wire method handlers: one async function per method of `substrate.schema`.

`services` declares what each group of handlers is given (`FsServices`, `ProcServices`,
...); `base` holds the table and `dispatcher(*bundles)`, what the daemon gives the server.
One module per group: `fs`, `upload`, `artifact`, `changes`, `workspace` (with
`approval.grant`), `proc`, `profile` (with `facts.probe`), `grant`, `pty`, `journal`,
`status` (`daemon.status`, `daemon.info`), `agents` (`agent.*`), `discover`. Importing this package imports
every one, which registers its handlers in `HANDLERS`.
"""

from __future__ import annotations

# Imported for their registrations (`@handles`), in no particular order.
from substrate.api import (
    agents,
    artifact,
    changes,
    discover,
    fs,
    grant,
    journal,
    proc,
    profile,
    pty,
    status,
    upload,
    workspace,
)
from substrate.api.base import HANDLERS, Actor, Caller, Handler, Handles, dispatcher
from substrate.api.services import (
    AgentServices,
    ArtifactServices,
    ChangesServices,
    FsServices,
    GrantServices,
    JournalServices,
    NoServices,
    ProcServices,
    ProfileServices,
    PtyServices,
    StatusServices,
    UploadServices,
    WorkspaceServices,
)

__all__ = [
    "HANDLERS",
    "Actor",
    "AgentServices",
    "ArtifactServices",
    "Caller",
    "ChangesServices",
    "FsServices",
    "GrantServices",
    "Handler",
    "Handles",
    "JournalServices",
    "NoServices",
    "ProcServices",
    "ProfileServices",
    "PtyServices",
    "StatusServices",
    "UploadServices",
    "WorkspaceServices",
    "agents",
    "artifact",
    "changes",
    "discover",
    "dispatcher",
    "fs",
    "grant",
    "journal",
    "proc",
    "profile",
    "pty",
    "status",
    "upload",
    "workspace",
]
