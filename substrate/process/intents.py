"""Process intents (docs/protocol.md §5): `proc.wait`, `.status`, `.list`, `.subscribe`.

`proc.wait`, `proc.status`, `proc.list`, `proc.subscribe` answered from a running
command (`driver.Entry`) or from its record.

A command of this daemon run is looked up in memory first (byte counts grow, waits
wake as it ends); anything else comes from the `processes` table: an exited command's
result and outputs (inline bytes or artifact), or a `lost` one (its daemon died) with
whatever output the dead daemon had spooled (kept as artifacts marked lost by
`ArtifactStore.repair`). A result rebuilt from a record is the first reply again: the
record keeps its `facts` and `policy_blocked` (docs/protocol.md §5), and `proc.status` of a
finished command carries them too.

Costs: a lookup is a dict probe, or one indexed query; a lost record adds one query for
its artifacts.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import trio

from substrate.artifacts.sink import OutputSink
from substrate.errors import LimitExceeded, ProcessUnknown
from substrate.process.driver import Entry
from substrate.process.facts_summary import shaped
from substrate.process.processes import Processes
from substrate.process.records import ProcRow
from substrate.process.subscriptions import MAX_SUBSCRIPTIONS, STREAMS, Feed, FixedSource, Source
from substrate.schema.artifact import OutputRef
from substrate.schema.proc import FactsMode, ProcPending, ProcResult, ProcStatus

#: A record says running but its command is not registered yet (its exec is starting):
#: look again this often, this long.
SETTLE_POLL_S = 0.05
SETTLE_S = 30.0


class SinkSource:
    """A running (or just closed) stream: its spool, then its inline bytes or artifact."""

    def __init__(self, sink: OutputSink) -> None:
        self._sink = sink

    def size(self) -> int:
        return self._sink.written

    def read(self, offset: int, length: int) -> bytes:
        return self._sink.read_at(offset, length)


async def resolve(processes: Processes, proc: str) -> Entry | ProcRow:
    """The running command, or the record. Refuses `process_unknown`."""
    deadline = trio.current_time() + SETTLE_S
    while True:
        entry = processes.live(proc)
        if entry is not None:
            return entry
        row = await trio.to_thread.run_sync(processes.records.get, proc)
        if row is None:
            raise ProcessUnknown(f"no process {proc}", proc=proc)
        if row.state != "running" or trio.current_time() > deadline:
            return row
        # Recorded, exec starting (or finishing): the entry appears, or the row changes.
        await trio.sleep(SETTLE_POLL_S)


def _pending(proc: str, state: Literal["running", "lost"]) -> ProcPending:
    return ProcPending(proc=proc, state=state)


def shaped_result(result: ProcResult | ProcPending, facts: FactsMode) -> ProcResult | ProcPending:
    """A `proc.run`/`proc.wait` reply: a result's facts as `facts` asks (`shaped`)."""
    return shaped(result, facts) if isinstance(result, ProcResult) else result


def result_of_row(row: ProcRow) -> ProcResult | ProcPending:
    """The `proc.run` result a record holds, or `{proc, state}`."""
    if row.state != "exited" or row.stdout is None or row.stderr is None:
        return _pending(row.id, "running" if row.state == "running" else "lost")
    return ProcResult(
        proc=row.id,
        exit_code=row.exit_code,
        signal=row.signal,
        timed_out=row.timed_out,
        oom_killed=row.oom_killed,
        duration_ms=row.duration_ms or 0.0,
        stdout=row.stdout,
        stderr=row.stderr,
        facts=row.facts,
        policy_blocked=row.policy_blocked,
        changes=row.changes,
        egress_blocked=row.egress_blocked,
        via=row.via,
        exec_facts=row.exec_facts,
        usage=row.usage,
    )


def _lost_sizes(processes: Processes, proc: str) -> dict[str, tuple[str, int]]:
    """stream → (artifact, bytes) of what a dead daemon spooled for `proc`."""
    return {a.stream: (a.artifact, a.bytes) for a in processes.artifacts.by_proc(proc)}


def output_source(processes: Processes, ref: OutputRef) -> Source:
    """What a finished command's output ref holds, readable by offset (inline or artifact)."""
    if ref.inline is not None:
        data = (
            base64.b64decode(ref.inline)
            if ref.encoding == "base64"
            else ref.inline.encode("utf-8", "surrogatepass")
        )
        return FixedSource(len(data), data=data)
    if ref.artifact is None:
        return FixedSource(0, data=b"")
    return FixedSource(ref.bytes, reader=_artifact_reader(processes, ref.artifact))


def _artifact_reader(processes: Processes, artifact: str) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        return processes.artifacts.read_artifact(artifact, offset, length)

    return read


def _row_sources(processes: Processes, row: ProcRow) -> dict[str, Source]:
    """Blocking (may query the artifacts table)."""
    if row.stdout is not None and row.stderr is not None:
        return {
            "stdout": output_source(processes, row.stdout),
            "stderr": output_source(processes, row.stderr),
        }
    found = _lost_sizes(processes, row.id)
    out: dict[str, Source] = {}
    for stream in STREAMS:
        if stream not in found:
            out[stream] = FixedSource(0, data=b"")
            continue
        artifact, size = found[stream]
        out[stream] = FixedSource(size, reader=_artifact_reader(processes, artifact))
    return out


async def wait(
    processes: Processes, proc: str, timeout_s: float | None, facts: FactsMode = "summary"
) -> ProcResult | ProcPending:
    """`proc.wait`: the result once it ends; `{proc, state: running}` after `timeout_s`.
    Its facts as `facts` asks (`facts_summary.shaped`)."""
    found = await resolve(processes, proc)
    if isinstance(found, ProcRow):
        return shaped_result(result_of_row(found), facts)
    with trio.move_on_after(float("inf") if timeout_s is None else timeout_s):
        await found.done.wait()
    if not found.done.is_set():
        return _pending(proc, "running")
    return shaped(found.result, facts) if found.result is not None else _pending(proc, "lost")


async def status(processes: Processes, proc: str, facts: FactsMode = "summary") -> ProcStatus:
    """`proc.status`; a finished command's facts as `facts` asks."""
    found = await resolve(processes, proc)
    if isinstance(found, Entry):
        return shaped(_entry_status(found, outcome=True), facts)
    return shaped(await trio.to_thread.run_sync(_row_status, processes, found, True), facts)


def _entry_status(entry: Entry, *, outcome: bool = False) -> ProcStatus:
    """`outcome`: a finished command's status carries its facts and policy_blocked."""
    result = entry.result
    state = entry.state
    return ProcStatus(
        proc=entry.proc,
        workspace=entry.workspace,
        profile=entry.profile,
        argv=entry.argv,
        state="running" if state == "running" else "exited" if state == "exited" else "lost",
        started=entry.started,
        ended=entry.ended,
        exit_code=result.exit_code if result is not None else None,
        signal=result.signal if result is not None else None,
        timed_out=result.timed_out if result is not None else None,
        stdout_bytes=entry.sinks[1].written,
        stderr_bytes=entry.sinks[2].written,
        facts=result.facts if outcome and result is not None else None,
        policy_blocked=result.policy_blocked if outcome and result is not None else None,
        changes=result.changes if outcome and result is not None else None,
        egress_blocked=result.egress_blocked if outcome and result is not None else None,
        usage=result.usage if outcome and result is not None else None,
        exec_facts=result.exec_facts if outcome and result is not None else None,
    )


def _row_status(processes: Processes, row: ProcRow, outcome: bool = False) -> ProcStatus:
    """Blocking (a lost row queries its artifacts). `outcome`: as `_entry_status`."""
    if row.stdout is not None and row.stderr is not None:
        out, err = row.stdout.bytes, row.stderr.bytes
    else:
        found = _lost_sizes(processes, row.id) if row.state == "lost" else {}
        out = found.get("stdout", ("", 0))[1]
        err = found.get("stderr", ("", 0))[1]
    exited = row.state == "exited"
    return ProcStatus(
        proc=row.id,
        workspace=row.workspace,
        profile=row.profile,
        argv=row.argv,
        state="exited" if exited else "lost" if row.state == "lost" else "running",
        started=row.started,
        ended=row.ended,
        exit_code=row.exit_code if exited else None,
        signal=row.signal if exited else None,
        timed_out=row.timed_out if exited else None,
        stdout_bytes=out,
        stderr_bytes=err,
        facts=row.facts if outcome and exited else None,
        policy_blocked=row.policy_blocked if outcome and exited else None,
        changes=row.changes if outcome and exited else None,
        egress_blocked=row.egress_blocked if outcome and exited else None,
        usage=row.usage if outcome and exited else None,
        exec_facts=row.exec_facts if outcome and exited else None,
    )


async def listing(processes: Processes, workspace: str | None, limit: int) -> list[ProcStatus]:
    """`proc.list`: the newest `limit` records; running ones with live byte counts."""

    def collect() -> list[ProcStatus | str]:
        out: list[ProcStatus | str] = []
        for row in processes.records.recent(workspace, limit):
            out.append(row.id if processes.live(row.id) else _row_status(processes, row))
        return out

    rows = await trio.to_thread.run_sync(collect)
    result: list[ProcStatus] = []
    for item in rows:
        if isinstance(item, str):
            entry = processes.live(item)
            if entry is None:  # ended meanwhile
                item = await status(processes, item)
            else:
                item = _entry_status(entry)
        result.append(item)
    return result


async def subscribe(
    processes: Processes,
    proc: str,
    since: int,
    notify: Callable[[str, Any], Awaitable[None]],
    on_close: list[Callable[[], None]],
    facts: FactsMode = "summary",
) -> None:
    """`proc.subscribe`: start the pump (see `substrate.process.subscriptions`); its
    `proc.exit` carries the facts as `facts` asks (`facts_summary.shaped`).

    Refuses `process_unknown`, and `limit_exceeded` past `MAX_SUBSCRIPTIONS` open.
    """
    subs = processes.subscriptions
    if subs.open >= MAX_SUBSCRIPTIONS:
        raise LimitExceeded(
            f"{MAX_SUBSCRIPTIONS} subscriptions are open already", limit=MAX_SUBSCRIPTIONS
        )
    found = await resolve(processes, proc)
    if isinstance(found, Entry):
        entry = found

        async def changed(wait_s: float) -> None:
            with trio.move_on_after(wait_s):
                await entry.done.wait()

        def result() -> ProcResult | ProcPending:
            if entry.result is None:
                return _pending(proc, "lost")
            return shaped(entry.result, facts)

        feed = Feed(
            proc=proc,
            sources={"stdout": SinkSource(entry.sinks[1]), "stderr": SinkSource(entry.sinks[2])},
            ended=entry.done.is_set,
            changed=changed,
            result=result,
        )
    else:
        row = found
        sources = await trio.to_thread.run_sync(_row_sources, processes, row)

        async def nothing(wait_s: float) -> None:
            await trio.sleep(wait_s)

        feed = Feed(
            proc=proc,
            sources=sources,
            ended=lambda: True,
            changed=nothing,
            result=lambda: shaped_result(result_of_row(row), facts),
        )
    subs.start(processes.nursery, feed, since, notify, on_close)
