"""Handlers of `journal.*` (docs/protocol.md §8): read, verify and replay the journal."""

from __future__ import annotations

import trio

from substrate.api.base import Caller, Handles
from substrate.api.services import JournalServices
from substrate.schema.journal import (
    JournalReadParams,
    JournalReadResult,
    JournalVerifyParams,
    JournalVerifyResult,
    ReplayFile,
    ReplayParams,
    ReplayResult,
)
from substrate.workspace import writes

handles = Handles(JournalServices)


@handles("journal.read")
async def read(s: JournalServices, caller: Caller, p: JournalReadParams) -> JournalReadResult:
    entries = await trio.to_thread.run_sync(
        lambda: s.journal.read(since=p.since, limit=p.limit, workspace=p.workspace)
    )
    return JournalReadResult(entries=entries)


@handles("journal.verify")
async def verify(s: JournalServices, caller: Caller, p: JournalVerifyParams) -> JournalVerifyResult:
    def run() -> JournalVerifyResult:
        bad = s.journal.verify()
        return JournalVerifyResult(ok=bad is None, entries=s.journal.count(), first_bad_seq=bad)

    return await trio.to_thread.run_sync(run)


@handles("journal.replay")
async def replay(s: JournalServices, caller: Caller, p: ReplayParams) -> ReplayResult:
    ws = s.workspaces.get(p.workspace)
    rows = await trio.to_thread.run_sync(writes.drift_report, ws, s.journal)
    files = [
        ReplayFile(path=path, last_seq=seq, last_sha256=last, current_sha256=now, status=status)  # type: ignore[arg-type]
        for path, seq, last, now, status in rows
    ]
    return ReplayResult(files=files, drifted=sum(f.status != "match" for f in files))
