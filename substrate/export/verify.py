"""A node's chain checked from PostgreSQL alone (docs/fleet.md, `journal verify --postgres`).

`ChainCheck` is sans-IO: fed a node's rows in seq order, batch after batch, it
recomputes each entry's hash exactly as the journal made it (docs/protocol.md §8: the
canonical JSON of the entry, chained by `prev`) and stops at the first row that does
not fit: a seq missing or repeated, a `prev` that is not the hash before it, a hash that
is not its entry's. `data` comes back from jsonb as text whose spacing and key order
are PostgreSQL's; decoding it and encoding it canonically gives the bytes hashed, as
long as the values are the same (jsonb keeps numbers as decimals, exactly).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from substrate.store.journal import GENESIS, entry_hash

__all__ = ["ChainCheck", "verify_rows"]


class ChainCheck:
    """The state of one walk of a chain: the seq and `prev` the next row must have."""

    def __init__(self) -> None:
        self.expected_seq = 1
        self.prev = GENESIS
        self.checked = 0
        self.first_bad: int | None = None

    def feed(self, rows: Iterable[tuple[Any, ...]]) -> int | None:
        """Check `rows` (epoch, seq, ts, kind, workspace, actor, data text, prev, hash),
        the next ones in seq order; the first bad seq (also kept in `first_bad`), or
        None while every row fits. Rows after a bad one are not looked at."""
        if self.first_bad is not None:
            return self.first_bad
        for epoch, seq, ts, kind, workspace, actor, data, prev, digest in rows:
            try:
                decoded = msgspec.json.decode(data) if isinstance(data, str | bytes) else data
                good = (
                    seq == self.expected_seq
                    and prev == self.prev
                    and entry_hash(
                        seq=int(seq),
                        epoch=int(epoch),
                        ts=float(ts),
                        kind=kind,
                        workspace=workspace,
                        actor=actor,
                        data=decoded,
                        prev=prev,
                    )
                    == digest
                )
            except (msgspec.DecodeError, TypeError, ValueError):
                good = False
            if not good:
                self.first_bad = int(seq) if seq == self.expected_seq else self.expected_seq
                return self.first_bad
            self.prev = digest
            self.expected_seq += 1
            self.checked += 1
        return None


def verify_rows(rows: Iterable[tuple[Any, ...]]) -> int | None:
    """The first bad seq of a whole chain given in order, or None. Pure."""
    return ChainCheck().feed(rows)
