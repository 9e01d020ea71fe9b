"""The wire method handlers: one async function per method of `substrate.schema`.

Importing this package imports every handler module, which registers its handlers in
`HANDLERS`; `dispatcher(daemon)` is what the daemon gives the server to run them.
"""

from __future__ import annotations

# Imported for their registrations (`@handles`), in no particular order.
from substrate.api import (
    artifact,
    changes,
    discover,
    fs,
    grant,
    journal,
    proc,
    profile,
    pty,
    upload,
    workspace,
)
from substrate.api.base import HANDLERS, Actor, Caller, Handler, dispatcher, handles

__all__ = [
    "HANDLERS",
    "Actor",
    "Caller",
    "Handler",
    "artifact",
    "changes",
    "discover",
    "dispatcher",
    "fs",
    "grant",
    "handles",
    "journal",
    "proc",
    "profile",
    "pty",
    "upload",
    "workspace",
]
