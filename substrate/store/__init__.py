"""The daemon's durable state: one SQLite database (WAL) and the hash-chained journal.

`Store` is the database; each table's SQL lives in one module, its owner (the journal
and approvals here, the others in their domains), and others call it.
"""

from __future__ import annotations

from substrate.store.approvals import Approvals
from substrate.store.db import Store
from substrate.store.journal import GENESIS, Entry, Journal, canonical, entry_hash

__all__ = ["GENESIS", "Approvals", "Entry", "Journal", "Store", "canonical", "entry_hash"]
