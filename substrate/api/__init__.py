"""Wire method handlers. Importing this package registers every handler in `HANDLERS`."""

from __future__ import annotations

import importlib

from substrate.api import fs, journal, workspace
from substrate.api.base import HANDLERS, Caller, handles

__all__ = ["HANDLERS", "Caller", "fs", "handles", "journal", "workspace"]

# Handlers owned by later layers; each registers when imported.
for _optional in ("proc", "profile", "artifact", "grant", "pty"):
    try:
        importlib.import_module(f"substrate.api.{_optional}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"substrate.api.{_optional}":
            raise
