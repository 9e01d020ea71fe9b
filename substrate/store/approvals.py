"""Operator approvals of exact plans (docs/protocol.md §4): the `approvals` table and all its SQL.

An approval lets one apply of exactly one plan digest in one workspace through a
`require_approval` glob. `approval.grant` adds one (`grant_in`); a guarded write looks
for an unused, unexpired one (`find`) and consumes it (`consume_in`) in the transaction
that journals the write, so an approval is used at most once.
"""

from __future__ import annotations

import secrets
import sqlite3

from substrate.store.db import Store

SCHEMA = """
CREATE TABLE IF NOT EXISTS approvals (
    id TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    plan_digest TEXT NOT NULL,
    expires REAL NOT NULL,
    used REAL
);
"""


class Approvals:
    """The approvals table. Blocking: call from a worker thread."""

    def __init__(self, store: Store) -> None:
        self._store = store
        store.ensure_schema(SCHEMA)

    def grant_in(
        self, db: sqlite3.Connection, workspace: str, plan_digest: str, expires: float
    ) -> str:
        """Add an approval inside the caller's transaction (which journals it); its id."""
        approval_id = "apr_" + secrets.token_hex(8)
        db.execute(
            "INSERT INTO approvals(id, workspace, plan_digest, expires) VALUES (?, ?, ?, ?)",
            (approval_id, workspace, plan_digest, expires),
        )
        return approval_id

    def find(self, workspace: str, plan_digest: str, now: float) -> str | None:
        """The id of an unused approval of this plan that has not expired at `now`, the
        soonest to expire first; None when there is none."""
        rows = self._store.query(
            "SELECT id FROM approvals WHERE workspace = ? AND plan_digest = ?"
            " AND used IS NULL AND expires > ? ORDER BY expires LIMIT 1",
            (workspace, plan_digest, now),
        )
        return str(rows[0]["id"]) if rows else None

    def consume_in(self, db: sqlite3.Connection, approval_id: str, now: float) -> None:
        """Mark an approval used, inside the transaction that journals its write."""
        db.execute("UPDATE approvals SET used = ? WHERE id = ?", (now, approval_id))
