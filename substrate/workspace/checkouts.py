"""The remembered policy of every checkout ever adopted (docs/protocol.md §2: the policy belongs to the
operator).

A checkout's own policy (what the operator set with `workspace.set_policy`, plus what
agents added at adopt) is kept in the store by the identity of its root directory
(`substrate.workspace.identity`: st_dev, st_ino and what a reused inode cannot
inherit), across release and restarts. Its effective policy is the operator's default plus that,
plus the rules of every remembered checkout nested in it (prefixed) or enclosing it
(re-rooted): `substrate.workspace.policy` does the glob arithmetic, this module the bookkeeping.

Calls are blocking and read the store; inside a `Store.transaction` they see its
uncommitted rows (one connection, a re-entrant lock), so a change and the policies it
implies are computed and committed together.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time

import msgspec

from substrate.errors import PolicyLocked
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.workspace.identity import CheckoutId
from substrate.workspace.policy import (
    DENY_LISTS,
    additions,
    beyond,
    loosening,
    merge,
    prefixed,
    reroot,
)

SCHEMA = """
-- `checkout`: the root's identity (`CheckoutId.key`; "st_dev:st_ino" in rows an older
-- release made, matched by path only, never by that key); `path`: its resolved host path when last
-- adopted, to find the checkouts nested in or enclosing another; `policy`: its own
-- policy (JSON), beside the operator's default.
CREATE TABLE IF NOT EXISTS checkout_policies (
    checkout TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    policy TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS checkout_policies_path ON checkout_policies(path);
"""

#: A policy with no rule at all (`Policy()` holds the default `.git/**`).
NOTHING = Policy(write_deny=[])


def nested(inner: str, outer: str) -> bool:
    """True when host path `inner` is strictly beneath `outer`."""
    return inner.startswith(outer.rstrip("/") + "/")


def glob_count(policy: Policy) -> int:
    return sum(len(getattr(policy, name)) for name in ("write_allow", *DENY_LISTS))


def summary(policy: Policy) -> dict[str, object]:
    """Journal data of a policy change: how many globs per list and a digest of them."""
    return {
        "globs": {name: len(getattr(policy, name)) for name in ("write_allow", *DENY_LISTS)},
        "policy_sha256": hashlib.sha256(msgspec.json.encode(policy)).hexdigest(),
    }


class CheckoutPolicies:
    """The `checkout_policies` table and the policies derived from it."""

    def __init__(self, store: Store, default: Policy) -> None:
        self._store = store
        self.default = default
        store.ensure_schema(SCHEMA)

    def known(self, key: str, path: str) -> bool:
        return bool(
            self._store.query(
                "SELECT 1 FROM checkout_policies WHERE checkout = ? OR path = ?", (key, path)
            )
        )

    def legacy_at(self, ident: CheckoutId, path: str) -> bool:
        """Did an older release remember this checkout: a row keyed by its st_dev:st_ino
        alone *and* recorded at this path? The closest an old row comes to proving it is
        this directory (`save` then takes its policy over, by path, and drops it)."""
        return bool(
            self._store.query(
                "SELECT 1 FROM checkout_policies WHERE checkout = ? AND path = ?",
                (ident.legacy, path),
            )
        )

    def recorded_at(self, path: str) -> bool:
        """Is any checkout remembered at this path?"""
        return bool(self._store.query("SELECT 1 FROM checkout_policies WHERE path = ?", (path,)))

    def own(self, key: str, path: str) -> Policy:
        """The checkout's own policy: by its identity, and by its path when another
        directory was there before (stricter than forgetting that one's)."""
        rows = self._store.query(
            "SELECT policy FROM checkout_policies WHERE checkout = ? OR path = ?", (key, path)
        )
        return merge(*(msgspec.json.decode(r["policy"], type=Policy) for r in rows))

    def save(self, db: sqlite3.Connection, key: str, path: str, policy: Policy) -> None:
        """Remember `policy` as the checkout's own (in the caller's transaction). Another
        identity's row at this path goes: `own` merged it into what is saved."""
        db.execute("DELETE FROM checkout_policies WHERE path = ? AND checkout != ?", (path, key))
        db.execute(
            "INSERT INTO checkout_policies(checkout, path, policy, updated) VALUES (?, ?, ?, ?)"
            " ON CONFLICT(checkout) DO UPDATE SET path = excluded.path,"
            " policy = excluded.policy, updated = excluded.updated",
            (key, path, msgspec.json.encode(policy).decode(), round(time.time(), 6)),
        )

    def additions(self, own: Policy, asked: Policy) -> Policy:
        """What an agent's `asked` adds to a checkout whose own policy is `own`.

        Refuses `policy_locked` when it would loosen `merge(default, own)`: a missing
        deny glob, a wider allow list. Globs the default holds are not counted as added,
        so an operator who loosens the default loosens it for every checkout.
        """
        current = merge(self.default, own)
        dropped, widened = loosening(asked, current)
        if dropped or widened:
            raise PolicyLocked(
                "the checkout's policy is the operator's: an agent may only add "
                "restrictions (see workspace.info for the current policy)",
                dropped=dropped,
                added={"write_allow": widened} if widened else {},
            )
        return additions(asked, current)

    def effective(self, key: str, path: str) -> Policy:
        """The default, the checkout's own policy, and the rules of every remembered
        checkout nested in it or enclosing it. Costs one indexed query and linear work
        in the globs of those checkouts."""
        mine = merge(self.default, self.own(key, path))
        parts = [mine]
        ancestors = [path[:i] for i in range(1, len(path)) if path[i] == "/"]
        marks = ", ".join("?" * len(ancestors))
        rows = self._store.query(
            "SELECT checkout, path, policy FROM checkout_policies"
            f" WHERE path IN ({marks}) OR (path > ? AND path < ?)",
            (*ancestors, path + "/", path + "0"),
        )
        for row in rows:
            there = row["path"]
            if row["checkout"] == key or there == path:
                continue
            theirs = merge(self.default, msgspec.json.decode(row["policy"], type=Policy))
            if nested(path, there):
                parts.append(reroot(theirs, path[len(there) + 1 :].split("/")))
            elif nested(there, path):
                parts.append(prefixed(beyond(theirs, mine), there[len(path) + 1 :].split("/")))
        return merge(*parts)
