"""Operator secrets (docs/protocol.md §12): 0600 files, given to sandboxes by their profiles.

Operator secrets (docs/protocol.md §12, docs/environments.md): values kept 0600 under the
state dir, named by profiles (`secrets = { ENV = "name" }`), given to sandboxed commands
as environment variables of their exec.

    store.py   I/O   `SecretStore`: set, remove, names, load, version; `NAME_RE`, the caps
"""

from substrate.secrets.store import (
    MAX_SECRETS,
    MAX_VALUE_BYTES,
    NAME_RE,
    SecretStore,
    check_name,
    check_value,
)

__all__ = ["MAX_SECRETS", "MAX_VALUE_BYTES", "NAME_RE", "SecretStore", "check_name", "check_value"]
