"""The journal in PostgreSQL (docs/fleet.md): each node's entries shipped exactly once.

postgres.py   edge   `open_target`, `Target.ship` (COPY, insert once, compare),
                     `Target.chain`; the table's layout and its check; `ExportError`
source.py     I/O    `JournalSource`: committed entries in bounded batches on a
                     read-only connection of its own; `Cursors`: the resume point
shipper.py    I/O    `Exporter` (blocking core, also `journal export`), `Shipper`
                     (the daemon's Trio task: batches, backoff, status)
verify.py     pure   `ChainCheck`: a node's chain recomputed from PostgreSQL's rows
"""

from substrate.export.postgres import (
    COLUMNS,
    SCHEMA_VERSION,
    ExportError,
    describe_dsn,
    open_target,
)
from substrate.export.shipper import Exporter, ExportSettings, Shipper, Status, backoff_s
from substrate.export.source import Cursors, JournalSource
from substrate.export.verify import ChainCheck, verify_rows

__all__ = [
    "COLUMNS",
    "SCHEMA_VERSION",
    "ChainCheck",
    "Cursors",
    "ExportError",
    "ExportSettings",
    "Exporter",
    "JournalSource",
    "Shipper",
    "Status",
    "backoff_s",
    "describe_dsn",
    "open_target",
    "verify_rows",
]
