"""Terminal grants (docs/protocol.md §7): an operator's short-lived, counted permission to open a PTY.

Theory of operation: `issue` makes a grant id `g-<16 hex>` and a token
`<grant>.<43 chars of urlsafe randomness>`; only `sha256(token)` is stored, so the token
is shown once and a copy of the database does not let anyone in. `use` splits the grant
id off the token, loads that row and compares the token's hash with the stored one in
constant time (`hmac.compare_digest`), then checks, in this order:

==================  =================  ===============================================
condition           refusal            note
==================  =================  ===============================================
malformed/unknown   `grant_invalid`    also: wrong token, other workspace
revoked             `grant_expired`    a revoked grant reads as expired to its holder
past its ttl        `grant_expired`
no uses left        `grant_consumed`   only when the use would consume one
==================  =================  ===============================================

One *use* is one session started or joined: reconnecting to a session the grant already
joined costs nothing, so a dropped connection can resume with a one-use grant (the
caller only `check`s for that). A caller `check`s before starting anything and `use`s
after; `use` checks again and consumes in one database transaction, together with the
journal entry, so two racing opens cannot both take the last use. The journal records `grant.issued`, `grant.revoked` and `grant.used` with the
grant id, workspace, profile and counts, never the token or its hash.

All methods block on SQLite: call them through `trio.to_thread.run_sync`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from substrate.errors import GrantConsumed, GrantExpired, GrantInvalid
from substrate.schema.grant import GrantInfo
from substrate.store.db import Store
from substrate.store.journal import Journal

SCHEMA = """
CREATE TABLE IF NOT EXISTS grants (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    workspace TEXT NOT NULL,
    profile TEXT NOT NULL,
    token_sha256 TEXT NOT NULL,
    created REAL NOT NULL,
    expires REAL NOT NULL,
    uses INTEGER NOT NULL,
    used INTEGER NOT NULL DEFAULT 0,
    revoked REAL,
    actor TEXT NOT NULL
);
"""

KIND = "interactive_terminal"
GrantState = Literal["active", "expired", "revoked", "consumed"]
_TOKEN_RE = re.compile(r"^(g-[0-9a-f]{16})\.([A-Za-z0-9_-]{43})$")

__all__ = ["KIND", "Grant", "Grants", "parse_duration", "token_digest"]


_DURATION_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhd]?)$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """`600`, `90s`, `10m`, `2h`, `1d` → seconds (for `substrate grant terminal --ttl`).

    Raises ValueError for anything else, or for zero.
    """
    match = _DURATION_RE.match(text.strip())
    if match is None or float(match.group(1)) == 0:
        raise ValueError(f"not a duration: {text!r} (e.g. 600, 90s, 10m, 2h, 1d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def token_digest(token: str) -> str:
    """The stored form of a token: hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode("utf-8", errors="surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Grant:
    """A grant row, as far as a session needs it (never the token or its hash)."""

    id: str
    kind: str
    workspace: str
    profile: str
    expires: float
    uses: int
    used: int


class Grants:
    """The grants table. `clock` is wall-clock seconds (tests pass their own)."""

    def __init__(
        self, store: Store, journal: Journal, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._journal = journal
        self._clock = clock
        store.ensure_schema(SCHEMA)

    def issue(
        self, *, workspace: str, profile: str, ttl_s: float, uses: int, actor: str
    ) -> tuple[Grant, str]:
        """Store a new grant; return it and its token (the only time the token exists).

        The caller has already checked that the workspace exists and that the profile is
        interactive. Costs one transaction.
        """
        grant_id = "g-" + secrets.token_hex(8)
        token = f"{grant_id}.{secrets.token_urlsafe(32)}"
        now = self._clock()
        expires = round(now + ttl_s, 3)
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO grants(id, kind, workspace, profile, token_sha256, created,"
                " expires, uses, used, actor) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (
                    grant_id,
                    KIND,
                    workspace,
                    profile,
                    token_digest(token),
                    now,
                    expires,
                    uses,
                    actor,
                ),
            )
            self._journal.append_in(
                db,
                "grant.issued",
                {"grant": grant_id, "kind": KIND, "profile": profile, "ttl_s": ttl_s, "uses": uses},
                workspace=workspace,
                actor=actor,
            )
        return Grant(grant_id, KIND, workspace, profile, expires, uses, 0), token

    def check(self, token: str, *, need_use: bool) -> Grant:
        """Check a presented token without changing anything. Refuses as in the table above.

        `need_use`: also refuse `grant_consumed` when no use is left. Costs one query.
        """
        with self._store.transaction() as db:
            return self._checked(db, token, need_use)

    def use(self, token: str, *, session: str, actor: str, mode: str) -> Grant:
        """Check a token and take one use, journaling `grant.used`, in one transaction."""
        with self._store.transaction() as db:
            grant = self._checked(db, token, need_use=True)
            used = grant.used + 1
            db.execute("UPDATE grants SET used = ? WHERE id = ?", (used, grant.id))
            self._journal.append_in(
                db,
                "grant.used",
                {
                    "grant": grant.id,
                    "used": used,
                    "uses": grant.uses,
                    "session": session,
                    "mode": mode,
                },
                workspace=grant.workspace,
                actor=actor,
            )
        return replace(grant, used=used)

    def _checked(self, db: Any, token: str, need_use: bool) -> Grant:
        match = _TOKEN_RE.match(token)
        if match is None:
            raise GrantInvalid("not a valid terminal token")
        grant_id = match.group(1)
        row = db.execute("SELECT * FROM grants WHERE id = ?", (grant_id,)).fetchone()
        # Compare hashes even when the row is missing, so timing says nothing.
        stored = row["token_sha256"] if row is not None else "0" * 64
        if not hmac.compare_digest(stored, token_digest(token)) or row is None:
            raise GrantInvalid("not a valid terminal token")
        if row["kind"] != KIND:
            raise GrantInvalid("this grant is not for terminals", grant=grant_id)
        if row["revoked"] is not None:
            raise GrantExpired("this grant was revoked", grant=grant_id)
        if self._clock() >= row["expires"]:
            raise GrantExpired("this grant has expired", grant=grant_id)
        if need_use and row["used"] >= row["uses"]:
            raise GrantConsumed("this grant has no uses left", grant=grant_id)
        return Grant(
            grant_id,
            row["kind"],
            row["workspace"],
            row["profile"],
            row["expires"],
            row["uses"],
            row["used"],
        )

    def revoke(self, grant_id: str, actor: str) -> bool:
        """Revoke a grant; False if it already was. Refuses an unknown id (`grant_invalid`)."""
        with self._store.transaction() as db:
            row = db.execute(
                "SELECT workspace, revoked FROM grants WHERE id = ?", (grant_id,)
            ).fetchone()
            if row is None:
                raise GrantInvalid("no such grant", grant=grant_id)
            if row["revoked"] is not None:
                return False
            db.execute("UPDATE grants SET revoked = ? WHERE id = ?", (self._clock(), grant_id))
            self._journal.append_in(
                db, "grant.revoked", {"grant": grant_id}, workspace=row["workspace"], actor=actor
            )
        return True

    def list(self) -> list[GrantInfo]:
        """Every grant, newest first, with its state; never a token or its hash."""
        now = self._clock()
        rows = self._store.query(
            "SELECT id, kind, workspace, profile, created, expires, uses, used, revoked"
            " FROM grants ORDER BY created DESC, id"
        )
        out: list[GrantInfo] = []
        for r in rows:
            state: GrantState = (
                "revoked"
                if r["revoked"] is not None
                else "expired"
                if now >= r["expires"]
                else "consumed"
                if r["used"] >= r["uses"]
                else "active"
            )
            out.append(
                GrantInfo(
                    grant=r["id"],
                    kind=r["kind"],
                    workspace=r["workspace"],
                    profile=r["profile"],
                    created=r["created"],
                    expires=r["expires"],
                    uses=r["uses"],
                    used=r["used"],
                    revoked=r["revoked"],
                    state=state,
                )
            )
        return out
