"""Command output: spooled, kept inline or content-addressed, read back (docs/protocol.md §6).

Spooled by sinks as it arrives, kept inline or as content-addressed artifacts, read back
by range, line or pattern (docs/protocol.md §5 "Output refs", §6).

`sink` spools one stream and makes its `OutputRef`; `store` keeps the artifacts
(collection by age and quota, repair after a crash); `lines` reads them back by line.
"""

from substrate.artifacts.sink import OutputSink, SinkClosed, SinkOwner
from substrate.artifacts.store import ArtifactStore, CollectReport, RepairReport

__all__ = [
    "ArtifactStore",
    "CollectReport",
    "OutputSink",
    "RepairReport",
    "SinkClosed",
    "SinkOwner",
]
