"""The wire schema: msgspec Structs and the method table, one source of truth (docs/protocol.md §1).

Importing this package declares every method in `METHODS` (each domain module declares
its own). `render()` is the text of `docs/api.schema.json`; `python -m substrate.schema`
regenerates it and the generated regions of `docs/protocol.md`.
"""

from __future__ import annotations

# The domain modules are imported for their declarations (`method(...)`).
from substrate.schema import (
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
    upload,
    workspace,
)
from substrate.schema.common import METHODS, Empty, MethodSpec, Params, Result, method
from substrate.schema.document import json_schema, render

__all__ = [
    "METHODS",
    "Empty",
    "MethodSpec",
    "Params",
    "Result",
    "agents",
    "artifact",
    "changes",
    "discover",
    "fs",
    "grant",
    "journal",
    "json_schema",
    "method",
    "proc",
    "profile",
    "pty",
    "render",
    "upload",
    "workspace",
]
