"""Wall-clock probes of one guarded write inside a real daemon (`bench/write_breakdown.py`).

Run as `python bench/write_probes.py <substrate arguments>`: it wraps the steps of the
write path (the request's dispatch, the worker thread's `Writer.write`, the plan, the
temp file, its fill and fsync, the intent's wait, the re-read, the rename, the directory
fsync, the entry's commit, the reply's send) with `time.perf_counter` stamps, then runs
`substrate` as `python -m substrate` would. At exit it writes every write's stamps as
JSON lines to `$SUBSTRATE_WRITE_PROBES`. Each wrapper costs about a microsecond: the
figures are a breakdown, not the throughput (that is `foundation_writes.py`'s).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# The checkout whose `substrate` runs comes first on PYTHONPATH (`BenchDaemon`).

#: One dict per write: step name → (start, end), filled by the thread doing it.
_records: list[dict[str, tuple[float, float]]] = []
_local = threading.local()
#: The last request line dispatched and the last reply sent (sequential runs only).
_last: dict[str, tuple[float, float]] = {}


def _current() -> dict[str, tuple[float, float]] | None:
    return getattr(_local, "record", None)


def _probe(owner: Any, name: str, step: str, *, last: bool = False) -> None:
    """Wrap `owner.name` so that the worker thread's record gets `step`'s stamps (of its
    first call; of its last with `last`)."""
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        record = _current()
        if record is None or (step in record and not last):
            return original(*args, **kwargs)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record[step] = (start, time.perf_counter())

    setattr(owner, name, wrapped)


def _install() -> None:
    from substrate.fs import fsops
    from substrate.protocol import server
    from substrate.store.group import GroupCommit
    from substrate.workspace.writes import dir_sync, intents, temp_files, writer

    original_write = writer.Writer.write

    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        record: dict[str, tuple[float, float]] = {}
        if "dispatch" in _last:
            record["dispatch"] = _last.pop("dispatch")
        _local.record = record
        start = time.perf_counter()
        try:
            return original_write(self, *args, **kwargs)
        finally:
            record["write"] = (start, time.perf_counter())
            _local.record = None
            _records.append(record)

    writer.Writer.write = write  # type: ignore[method-assign]
    _probe(writer, "_plan", "plan")
    _probe(temp_files.TempFiles, "create", "create")
    _probe(fsops, "fill", "fill")
    _probe(intents.Pending, "wait", "intent_wait")
    if hasattr(writer, "read_current_held"):  # the re-read under the lock keeps its fd
        _probe(writer, "read_current_held", "reread")
    else:
        _probe(writer, "read_current", "reread", last=True)
    _probe(fsops, "rename_into", "rename")
    _probe(dir_sync.DirSyncs, "sync", "dir_fsync")
    # The last: a writer waits on its intent's ticket (`Pending.wait`) first.
    _probe(GroupCommit, "wait", "entry_commit", last=True)

    original_dispatch = server.Connection._dispatch

    async def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await original_dispatch(self, *args, **kwargs)
        finally:
            _last["dispatch"] = (start, time.perf_counter())

    server.Connection._dispatch = dispatch  # type: ignore[method-assign]
    original_send = server.Connection.send

    async def send(self: Any, data: bytes) -> None:
        start = time.perf_counter()
        try:
            await original_send(self, data)
        finally:
            if _records and "send" not in _records[-1] and b'"new_sha256"' in data:
                _records[-1]["send"] = (start, time.perf_counter())

    server.Connection.send = send  # type: ignore[method-assign]


def _dump() -> None:
    out = os.environ.get("SUBSTRATE_WRITE_PROBES")
    if out:
        with open(out, "w") as f:
            for record in _records:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    _install()
    atexit.register(_dump)
    from substrate.cli.main import main

    sys.argv[0] = "substrate"
    raise SystemExit(main())
